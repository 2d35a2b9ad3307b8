"""The engine API: the local socket engine ranks use to reach their node agent.

``protocol`` is the wire format, ``buffers`` shares KV buffers by handle,
``server`` serves requests, ``service`` maps them onto the agent's connectors.
"""
