"""Block hashes as vLLM's prefix cache computes them, for the events routers read.

vLLM (``vllm/v1/core/kv_cache_utils.py``, ``prefix_caching_hash_algo: sha256``,
its default) hashes block ``i`` of a request as
``sha256(pickle((h_{i-1}, tuple(block_token_ids), extra_keys)))`` with pickle's
highest protocol, ``h_{-1} = NONE_HASH = sha256(pickle(seed))``. The seed is the
engine's ``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"``. A request
without LoRA, multimodal inputs, cache salt or prompt embeddings has
``extra_keys = None``; the agent hashes only such blocks the vLLM way (its
namespace covers the rest, but their vLLM hash needs keys the agent never sees).
An event carries, as vLLM's ``maybe_convert_block_hash`` does, the hash's low 64
bits as an int (big-endian; vLLM's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)
or, with that variable 0, the 32-byte hash itself.

The hasher's blocks must be vLLM's hash blocks: the agent's ``tokensPerBlock``
equal to the engine's block size (the vLLM connector requires it).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

from node_agent.events.wire import ExternalHash

#: vLLM's seed for NONE_HASH when ``PYTHONHASHSEED`` is unset (sha256 algorithms).
DEFAULT_SEED = "vllm-none-hash"
_PROTOCOL = pickle.HIGHEST_PROTOCOL
_LOW64 = (1 << 64) - 1


def _sha256(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PROTOCOL)).digest()


class VllmHasher:
    """vLLM's ``sha256`` block hash chain for one seed."""

    def __init__(self, seed: str = DEFAULT_SEED, int_hashes: bool = True) -> None:
        self.seed = seed
        self.int_hashes = int_hashes
        self.none_hash = _sha256(seed)

    def chain(self, parent: bytes | None, blocks: Sequence[Sequence[int]]) -> list[bytes]:
        """The raw 32-byte hashes of ``blocks`` (Python ints per block) following the
        raw hash ``parent`` (None: the first block of a prompt)."""
        prev = self.none_hash if parent is None else parent
        out: list[bytes] = []
        for block in blocks:
            prev = _sha256((prev, tuple(block), None))
            out.append(prev)
        return out

    def external(self, raw: bytes) -> ExternalHash:
        """What an event carries for the raw hash ``raw``."""
        return int.from_bytes(raw, "big") & _LOW64 if self.int_hashes else raw
