"""vLLM integration: ``FlexKVAgentConnector``, loaded by vLLM through
``kv_connector_module_path="node_agent.integrations.vllm"``.

Only this subpackage imports vllm (tests/test_layout.py checks it), and only
when the connector class is first looked up, so its vLLM-free helpers
(:mod:`.config`, :mod:`.shm_pool`, :mod:`.tiny_model`) import without vLLM.
See docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FlexKVAgentConnector"]


def __getattr__(name: str) -> Any:
    if name == "FlexKVAgentConnector":
        from node_agent.integrations.vllm.connector import FlexKVAgentConnector

        return FlexKVAgentConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
