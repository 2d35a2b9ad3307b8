"""``POST /v1/lookup``: how much of a prompt this agent's cache holds, by tier.

For KV-aware routers. The body is JSON::

    {"tokenIds": [1, 2, ...], "replica": "llama-0", "ppRank": 0}

``replica`` may be left out when the agent serves one replica; ``ppRank``
defaults to 0. For long prompts a router can skip JSON: a body of
``Content-Type: application/octet-stream`` is the token ids as little-endian
int64, with ``replica`` and ``ppRank`` as query parameters
(``POST /v1/lookup?replica=llama-0``). The answer names the stage and the tokens
of the longest cached prefix of ``tokenIds`` held by each local tier::

    {"replica": "llama-0", "ppRank": 0, "tokensPerBlock": 16, "queriedTokens": 40,
     "cachedTokens": 32, "tiers": {"cpu": 16, "ssd": 16}}

It is read-only: no task, no pin, no LRU touch, no decision lock, no fetch from the
remote tier (which it does not consult). A bad body is a 400 naming the field,
the bad value and the fix; a body over :data:`MAX_BODY_BYTES` a 413 (refused
before it is buffered, so a huge body costs the agent no memory); an unknown stage
a 404 listing the known ones; a stage that cannot answer now (not its group's
leader on this node, or a backend that cannot be read without a decision) a 409.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


class LookupRequestError(Exception):
    """A lookup that cannot be answered: ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class LookupRequest:
    """A checked ``POST /v1/lookup`` body."""

    tokens: npt.NDArray[np.int64]
    replica: str | None
    pp_rank: int


_KEYS = ("tokenIds", "replica", "ppRank")
_INT64_MAX = 2**63 - 1
#: The largest body a lookup reads: 4Mi int64 token ids (a JSON body of that many
#: ids is larger, so JSON holds fewer). A larger one is refused before it is read.
MAX_BODY_BYTES = 32 * 2**20


def _bad(message: str) -> LookupRequestError:
    return LookupRequestError(400, message)


def body_too_large(size: int | None) -> LookupRequestError:
    """The 413 for a body over :data:`MAX_BODY_BYTES` (``size`` bytes, None: not known
    yet, more than the limit arrived)."""
    what = f"{size} bytes" if size is not None else "more bytes"
    return LookupRequestError(
        413, f"body: {what} is over the {MAX_BODY_BYTES}-byte limit of a lookup; send the "
        "token ids as little-endian int64 (Content-Type: application/octet-stream, 8 bytes "
        f"a token, at most {MAX_BODY_BYTES // 8} tokens) or look up a shorter prefix")


def parse_lookup_binary(body: bytes, query: Mapping[str, str]) -> LookupRequest:
    """Check an ``application/octet-stream`` body (little-endian int64 token ids) and
    its query parameters; :class:`LookupRequestError` (400) names what is wrong."""
    if len(body) % 8:
        raise _bad(f"body: {len(body)} bytes is not a whole number of 8-byte token ids; "
                   "send the token ids as little-endian int64")
    unknown = sorted(set(query) - {"replica", "ppRank"})
    if unknown:
        raise _bad(f"{unknown[0]}: unknown query parameter; allowed are replica, ppRank")
    tokens = np.frombuffer(body, dtype="<i8").astype(np.int64, copy=False)
    if len(tokens) and int(tokens.min()) < 0:
        where = int(np.argmin(tokens))
        raise _bad(f"tokenIds[{where}]: {int(tokens[where])} is out of range; token ids are "
                   f"between 0 and {_INT64_MAX}")
    replica = query.get("replica")
    if replica is not None and not replica:
        raise _bad("replica: '' is not a replica name; send the engine replica's name, or "
                   "leave it out when the agent serves one")
    raw_rank = query.get("ppRank", "0")
    if not (raw_rank.isascii() and raw_rank.isdigit()):  # "²" is a digit int() refuses
        raise _bad(f"ppRank: {raw_rank!r} is not a pipeline stage rank; send an integer >= 0 "
                   "(0 when the engine has one stage)")
    return LookupRequest(tokens=tokens, replica=replica, pp_rank=int(raw_rank))


def parse_lookup(body: bytes) -> LookupRequest:
    """Check a request body; :class:`LookupRequestError` (400) names what is wrong."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"body: not JSON ({exc}); send {{\"tokenIds\": [1, 2, 3]}}") from None
    if not isinstance(data, dict):
        raise _bad(f"body: {type(data).__name__} is not a JSON object; send "
                   "{\"tokenIds\": [1, 2, 3]}")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise _bad(f"{unknown[0]}: unknown field; allowed fields are {', '.join(_KEYS)}")
    if "tokenIds" not in data:
        raise _bad("tokenIds: missing; send the prompt's token ids as a JSON array of "
                   "integers")
    raw = data["tokenIds"]
    if not isinstance(raw, list):
        raise _bad(f"tokenIds: {type(raw).__name__} is not an array; send a JSON array "
                   "of integers")
    try:
        arr = np.asarray(raw)
    except (ValueError, OverflowError):
        arr = np.asarray([], dtype=object)
    # numpy reads true as 1: look for booleans only when the body holds one (cheap).
    has_bool = (b"true" in body or b"false" in body) and any(type(v) is bool for v in raw)
    if len(raw) and (has_bool or arr.dtype.kind not in "iu" or arr.ndim != 1):
        # numpy holds ints beyond 64 bits (or a mix of negative and beyond int64) as
        # objects: name the first value out of range, not an integer that is fine.
        where, bad = next(((i, v) for i, v in enumerate(raw)
                           if isinstance(v, bool) or not isinstance(v, int)
                           or not 0 <= v <= _INT64_MAX), (0, raw[0]))
        if type(bad) is int:
            raise _bad(f"tokenIds[{where}]: {bad} is out of range; token ids are "
                       f"between 0 and {_INT64_MAX}")
        raise _bad(f"tokenIds[{where}]: {bad!r} is not an integer token id; send integers "
                   f"between 0 and {_INT64_MAX}")
    if len(raw) and (int(arr.min()) < 0 or int(arr.max()) > _INT64_MAX):
        where = int(np.argmin(arr)) if int(arr.min()) < 0 else int(np.argmax(arr))
        raise _bad(f"tokenIds[{where}]: {raw[where]} is out of range; token ids are "
                   f"between 0 and {_INT64_MAX}")
    tokens = arr.astype(np.int64) if len(raw) else np.empty(0, dtype=np.int64)
    replica = data.get("replica")
    if replica is not None and (not isinstance(replica, str) or not replica):
        raise _bad(f"replica: {replica!r} is not a replica name; send the engine "
                   "replica's name as a string, or leave it out when the agent serves one")
    pp_rank = data.get("ppRank", 0)
    if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or pp_rank < 0:
        raise _bad(f"ppRank: {pp_rank!r} is not a pipeline stage rank; send an integer "
                   ">= 0 (0 when the engine has one stage)")
    return LookupRequest(tokens=tokens, replica=replica, pp_rank=pp_rank)
