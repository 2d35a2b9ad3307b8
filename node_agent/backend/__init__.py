"""KV cache backends: the FlexKV manager contract and its implementations.

* :mod:`.base` - the manager contract every backend implements (:class:`KVBackend`).
* :mod:`.replication` - PP leader/follower contract (plans, tier moves, ``StageStore``).
* :mod:`.layout` - KV layout of a stage and validation of registered engine buffers.
* :mod:`.embedded` - :class:`~.embedded.EmbeddedBackend`, the built-in backend, with
  :mod:`.stage_store` (``TierStore``, a follower's storage), :mod:`.index`,
  :mod:`.hashing`, :mod:`.cpu_tier`, :mod:`.ssd_tier`, :mod:`.transfer`,
  :mod:`.config`; design in ``docs/backend.md``.
* :mod:`.flexkv_adapter` - the adapter over FlexKV's ``KVManager`` (optional extra).

Only the torch-free contract types are re-exported here, so importing this package
stays cheap; import implementations from their modules.
"""

from node_agent.backend.base import (
    BackendStats,
    KVBackend,
    KVBackendError,
    KVResponse,
    KVResponseStatus,
    TaskNotFoundError,
    TierStats,
)

__all__ = [
    "BackendStats",
    "KVBackend",
    "KVBackendError",
    "KVResponse",
    "KVResponseStatus",
    "TaskNotFoundError",
    "TierStats",
]
