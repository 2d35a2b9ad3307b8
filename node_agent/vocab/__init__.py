"""The data-plane vocabulary every layer of the agent speaks.

Plain types and pure functions with no dependency on any other ``node_agent``
package, so that the engine API, the coordinator, the fan-out codec, the backends
and both engine integrations can share them without depending on each other.
"""
