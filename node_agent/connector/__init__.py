"""The FlexKV-style connector of one PP stage: ``store_kv``, ``lookup``,
``retrieve``, ``release``, ``poll_completed``, ``reset``, ``status``, ``ready``.

The group leader decides; followers execute its physical plans (docs/pp.md).
"""

from node_agent.connector.config import ConnectorConfig
from node_agent.connector.connector import BackendFactory, Connector, StoreFactory
from node_agent.connector.errors import UnknownRequestError

__all__ = [
    "BackendFactory",
    "Connector",
    "ConnectorConfig",
    "StoreFactory",
    "UnknownRequestError",
]
