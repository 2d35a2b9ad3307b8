"""The model identity that keys a stage's blocks in every tier.

Two engines whose KV caches have the same shape (layers, heads, head size, dtype,
block size) may still run different weights: a fine-tune, or a new weights
version under the same name. KV computed by one is wrong for the other, so the
agent keys blocks by the model as the engine knows it, not only by the layout.

:class:`ModelIdentity` holds what an engine says about its model (served name,
model path or id, revision, tokenizer and tokenizer revision, and an optional
salt for weights that change under one name); :meth:`ModelIdentity.digest` is
its stable 32-hex-digit digest. The engine sends the digest in the ``model``
field of every call's rank (:class:`node_agent.client.RankInfo`); the agent binds
a stage to the digest of the rank that registered it, folds it (with the pool's
``modelSalt``) into the namespace of the stage's block hashes, so CPU, SSD and
remote block ids differ per model, and into the remote key fingerprint. A call
whose digest differs from its stage's is refused: two models never share a
block unless their identities are equal. An engine that sends no identity (an
empty digest) keeps the unsalted namespace of earlier agents.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass

DIGEST_HEX = 32
"""Length of a model digest in hex digits (a 128-bit BLAKE2b digest)."""
_DIGEST = re.compile(r"^[0-9a-f]{32}$")
_FORMAT = 1


@dataclass(frozen=True)
class ModelIdentity:
    """What an engine knows about its model; every field optional (None: not known)."""

    served_name: str | None = None
    """The name the engine serves the model under (vLLM ``--served-model-name``)."""
    model: str | None = None
    """The model's path or hub id."""
    revision: str | None = None
    """The weights' revision (a hub commit, tag or branch)."""
    tokenizer: str | None = None
    """The tokenizer's path or hub id."""
    tokenizer_revision: str | None = None
    """The tokenizer's revision."""
    salt: str | None = None
    """An operator-chosen string for weights that change under one name and revision
    (bump it when the weights change; engines with other salts never share blocks)."""

    def digest(self) -> str:
        """32 lower-case hex digits: equal exactly when every field is equal."""
        text = json.dumps({"format": _FORMAT, **asdict(self)}, sort_keys=True,
                          separators=(",", ":")).encode()
        return hashlib.blake2b(text, digest_size=DIGEST_HEX // 2).hexdigest()


def check_digest(where: str, value: object) -> str:
    """``value`` when it is a model digest or ``""`` (no identity); ``ValueError``
    naming ``where``, the value and the fix otherwise."""
    if value == "" or (isinstance(value, str) and _DIGEST.match(value)):
        return str(value)
    raise ValueError(f"{where} {value!r} must be {DIGEST_HEX} lower-case hex digits (the "
                     "ModelIdentity.digest() of the engine's model) or empty")


def stage_namespace(model: str, pool_salt: str) -> str | None:
    """The block-hash namespace of a stage serving ``model`` (a digest or ``""``) in a
    pool whose ``modelSalt`` is ``pool_salt``; None (the namespace of agents without
    model identities) when both are empty."""
    if not model and not pool_salt:
        return None
    return "model:" + hashlib.blake2b(f"{model}\x00{pool_salt}".encode(),
                                      digest_size=DIGEST_HEX // 2).hexdigest()
