"""Fixtures shared by the vLLM test modules.

``tiny_models`` writes each generated random-weight Llama once per session
(``node_agent.integrations.vllm.tiny_model`` under .venv-vllm, seconds of torch and
transformers imports each) and hands the same directory to every module that asks
for that model. The engines only read it, so sharing it changes nothing they
compute; each module still starts its own agent, so no KV one module's engines
stored is seen by another's.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.agent.harness import short_dir
from tests.vllm.harness import TinyModels


@pytest.fixture(scope="session")
def tiny_models() -> Iterator[TinyModels]:
    """The session's generated models (see :class:`TinyModels`), removed at its end."""
    root = short_dir("vmodels")
    try:
        yield TinyModels(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
