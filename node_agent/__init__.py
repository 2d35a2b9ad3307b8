"""flexkv-operator node agent: KV cache backends, the FlexKV connector, PP fan-out,
the engine API and the agent's HTTP surface.

This package never imports kopf: it talks to Kubernetes through the ``kubernetes``
client only. Heavy optional dependencies (``flexkv``) are imported lazily.
"""

__version__ = "0.1.0"
