"""Bounds of ``tiers.remote.mooncake`` that the operator checks in a pool and the
agent checks in its configuration (docs/contracts.md section 1)."""

from __future__ import annotations

#: The smallest segment Mooncake accepts (its setup fails below: "Total size must
#: be at least 16777216").
MIN_SEGMENT_BYTES = 16 << 20
#: Bounds of ``localBufferSize``: the staging buffer is allocated and registered per
#: stage when an engine registers, so it must hold two blocks (checked then, against
#: the layout) and stay a fraction of a node's memory (checked at start).
MIN_LOCAL_BUFFER_BYTES = 1 << 20
MAX_LOCAL_BUFFER_BYTES = 64 << 30
#: Ports Mooncake takes for its transfer engine: 1024..65535 outside Linux's
#: ephemeral range 32768..60999. Any other MC_MIN_RPC_PORT / MC_MAX_RPC_PORT makes
#: it fall back to a random port in 15000..17000 ("Invalid port range"), so both
#: ``storePort`` and ``storePort + 1`` must lie in one of these.
PORT_RANGES = ((1024, 32767), (61000, 65535))
#: The ``storePort`` values that keep both ports in :data:`PORT_RANGES`.
STORE_PORT_RANGES = ((1024, 32766), (61000, 65534))
