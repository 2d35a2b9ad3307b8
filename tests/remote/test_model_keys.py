"""Remote keys of two models of one KV shape never meet: the stage's model
namespace (engine identity and the pool's ``modelSalt``) is in the key fingerprint
and in the block hashes the block ids come from (no master needed)."""

from __future__ import annotations

import dataclasses

import numpy as np

from node_agent.backend.hashing import BlockHasher
from node_agent.backend.remote.keys import KeySpace, block_digest
from node_agent.engine_api.identity import ModelIdentity, stage_namespace
from node_agent.vocab.layout import KVDtype, KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_size=8, dtype=KVDtype.FLOAT16,
                  tokens_per_block=4)
X = ModelIdentity(served_name="llama", model="/m/llama", revision="v1").digest()
Y = ModelIdentity(served_name="llama", model="/m/llama", revision="v2").digest()


def test_model_identity_and_pool_salt_change_the_fingerprint_and_the_block_ids() -> None:
    base = KeySpace(LAYOUT, 0, 1, "ns", "pool", 0)
    namespaces = [stage_namespace(X, ""), stage_namespace(Y, ""), stage_namespace(X, "w2"),
                  stage_namespace("", "w2")]
    spaces = [dataclasses.replace(base, model=n) for n in namespaces]
    prefixes = {s.prefix() for s in spaces}
    assert len(prefixes) == len(spaces) and base.prefix() not in prefixes
    # No identity and no salt: the keys (and hashes) of stages without a model.
    assert stage_namespace("", "") is None
    assert dataclasses.replace(base, model=None).prefix() == base.prefix()
    tokens = np.arange(64, dtype=np.int64)
    hasher = BlockHasher(LAYOUT.tokens_per_block)
    ids = {n: [block_digest(h) for h in hasher.hashes(tokens, n)] for n in [None, *namespaces]}
    for a in ids:
        for b in ids:
            if a != b:
                assert not set(ids[a]) & set(ids[b]), (a, b)


def test_identity_digest_is_stable_and_covers_every_field() -> None:
    full = ModelIdentity("s", "m", "r", "t", "tr", "salt")
    assert full.digest() == ModelIdentity("s", "m", "r", "t", "tr", "salt").digest()
    variants = [dataclasses.replace(full, **{f.name: "other"})
                for f in dataclasses.fields(full)]
    assert len({v.digest() for v in variants} | {full.digest()}) == len(variants) + 1
    assert len(full.digest()) == 32
