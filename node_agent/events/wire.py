"""vLLM's KV-event wire format, written without vLLM.

A message is three ZMQ frames, as vLLM's ``ZmqEventPublisher`` sends them: the
topic (UTF-8, empty by default), the batch's sequence number (8 bytes, big
endian) and the payload. The payload is the msgpack encoding of a
``KVEventBatch``: an array ``[ts, events, data_parallel_rank]`` whose events are
maps tagged by ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), so ``msgspec.msgpack.Decoder(KVEventBatch)`` of vLLM
decodes it. Fields with a default in vLLM's structs (``extra_keys``,
``group_idx`` ...) are omitted, as vLLM omits them when unset.

Media follow vLLM's upper-case style (``"GPU"``, ``"CPU"``): the agent's tiers
are ``"CPU"``, ``"SSD"`` and ``"REMOTE"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

#: Block hashes on the wire: 32 bytes (vLLM's default) or an int of at most 64 bits.
ExternalHash = bytes | int

MEDIUM_CPU = "CPU"
MEDIUM_SSD = "SSD"
MEDIUM_REMOTE = "REMOTE"

Event = dict[str, Any]


def block_stored(hashes: Sequence[ExternalHash], parent: ExternalHash | None,
                 token_ids: Sequence[int], block_size: int, medium: str) -> Event:
    """A ``BlockStored`` event: ``hashes`` in chain order, ``parent`` the hash of the
    block before the first one (None at the start of a prompt), ``token_ids`` the
    tokens of every block in order."""
    return {"type": "BlockStored", "block_hashes": list(hashes),
            "parent_block_hash": parent, "token_ids": list(token_ids),
            "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None}


def block_removed(hashes: Sequence[ExternalHash], medium: str) -> Event:
    """A ``BlockRemoved`` event: ``hashes`` left tier ``medium``."""
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def all_blocks_cleared() -> Event:
    """An ``AllBlocksCleared`` event: forget every block of this publisher."""
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload of a ``KVEventBatch`` of ``events`` taken at ``ts``."""
    return msgpack.packb([ts, list(events), data_parallel_rank], use_bin_type=True)


def seq_frame(seq: int) -> bytes:
    """A batch's sequence number frame (8 bytes, big endian)."""
    return seq.to_bytes(8, "big")
