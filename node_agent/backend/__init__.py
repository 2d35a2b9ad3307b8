"""KV cache backends: the FlexKV manager contract and its implementations."""

from node_agent.backend.base import (
    KVBackend,
    KVBackendError,
    KVResponse,
    KVResponseStatus,
    TaskNotFoundError,
)

__all__ = [
    "KVBackend",
    "KVBackendError",
    "KVResponse",
    "KVResponseStatus",
    "TaskNotFoundError",
]
