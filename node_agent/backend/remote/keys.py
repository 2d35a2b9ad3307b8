"""Object keys of the remote tier.

A key is ``fkv2/<fingerprint>/<block digest>``:

* the *block digest* is the block's prefix-chained hash (``hashing.py``; the
  request namespace is already folded into the chain) reduced to its low 128 bits
  (all of it for ``xxh3_64`` and ``xxh3_128``), 32 hex digits; REMOTE moves carry
  it whole on the PP fan-out stream, so every stage keys its blocks alike;
* the *fingerprint* is a digest of everything that makes two blocks with the same
  tokens hold incompatible bytes: the stage's model shape and dtype, tokens per
  block, the buffer layout, TP size, the PP rank and size, the hash algorithm, the
  pool's namespace salt (Kubernetes namespace and pool name), the cache epoch and
  the stage's model namespace (``engine_api/identity.py``: the engine's model
  identity and the pool's ``modelSalt``).

So an agent can only ever find (and load) blocks written under exactly its own
fingerprint: a block of another layout, pool, epoch or stage is simply a miss.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from node_agent.vocab.layout import KVLayout

#: Width of a block digest: keys and object headers carry the low 128 bits of the
#: block hash.
DIGEST_BITS = 128
DIGEST_MASK = (1 << DIGEST_BITS) - 1
#: Bumped whenever the object format (a header, then the block bytes in region
#: order: :mod:`.objects`) changes.
FORMAT_VERSION = 2


def block_digest(block_hash: int) -> int:
    """The remote digest of a block hash (its low 128 bits)."""
    return block_hash & DIGEST_MASK


@dataclass(frozen=True)
class KeySpace:
    """The fingerprint of one PP stage's blocks, and key derivation from block ids."""

    layout: KVLayout
    pp_rank: int = 0
    pp_size: int = 1
    namespace: str = "default"
    pool: str = "default"
    cache_epoch: int = 0
    hash_algorithm: str = "xxh3_64"
    model: str | None = None
    """The stage's model namespace (None: an engine that sent no identity)."""

    def __post_init__(self) -> None:
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank={self.pp_rank} is outside 0..pp_size-1 "
                             f"(pp_size={self.pp_size}); pass this stage's rank in its group")

    @cached_property
    def fingerprint(self) -> str:
        """32 hex digits identifying the byte format and the salt of this stage's blocks."""
        lay = self.layout
        parts = {
            "format": FORMAT_VERSION,
            "num_layers": lay.num_layers, "num_kv_heads": lay.num_kv_heads,
            "head_size": lay.head_size, "kv_dim": lay.kv_dim, "dtype": str(lay.dtype.value),
            "tokens_per_block": lay.tokens_per_block, "tp_size": lay.tp_size,
            "layout": str(lay.name.value), "bytes_per_block": lay.bytes_per_block,
            "pp_rank": self.pp_rank, "pp_size": self.pp_size,
            "namespace": self.namespace, "pool": self.pool, "cache_epoch": self.cache_epoch,
            "hash": self.hash_algorithm,
        }
        if self.model is not None:  # absent keeps the keys of stages without a model
            parts["model"] = self.model
        text = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(text, digest_size=16).hexdigest()

    def prefix(self) -> str:
        """The key prefix shared by every block of this stage (``fkv2/<fingerprint>/``)."""
        return self._prefix

    @cached_property
    def _prefix(self) -> str:
        return f"fkv{FORMAT_VERSION}/{self.fingerprint}/"

    def keys(self, digests: Sequence[int]) -> list[str]:
        """The object keys of ``digests`` (already reduced with :func:`block_digest`):
        the prefix and 32 lower-case hex digits (a 32K-token prompt's 2048 keys in
        well under a millisecond)."""
        p = self._prefix
        return [f"{p}{d:032x}" for d in digests]
