"""SGLang plugin: the node agent as SGLang's FlexKV host tier.

An ``sglang.srt.plugins`` entry point (:func:`.plugin.register`) registers the
radix-cache backend ``flexkv-agent``; :class:`.connector.AgentKVConnector` has
the interface of SGLang's ``FlexKVConnector`` and is served by this node's agent
through :class:`node_agent.client.EngineClient`. The agents' PP group replaces
SGLang's gloo fan-out. See docs/sglang.md.

Only :mod:`.radix_cache` and :mod:`.plugin` (inside functions) import SGLang;
importing this package, :mod:`.connector`, :mod:`.kv_pool` or :mod:`.settings`
does not.
"""

from node_agent.integrations.sglang.plugin import BACKEND_NAME

__all__ = ["BACKEND_NAME"]
