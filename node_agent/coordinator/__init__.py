"""The FlexKV-style connector of one PP stage: ``store_kv``, ``lookup``,
``retrieve``, ``release``, ``poll_completed``, ``reset``, ``status``, ``ready``.

The group leader decides; followers execute its physical plans (docs/pp.md).
"""

from node_agent.coordinator.config import CoordinatorConfig
from node_agent.coordinator.coordinator import BackendFactory, Coordinator, StoreFactory
from node_agent.coordinator.errors import SlotsStillWrittenError, UnknownRequestError

__all__ = [
    "BackendFactory",
    "Coordinator",
    "CoordinatorConfig",
    "SlotsStillWrittenError",
    "StoreFactory",
    "UnknownRequestError",
]
