"""Putting the checking fake ``flexkv`` package (tests/fakes/flexkv) on the import path.

Product code imports ``flexkv`` lazily; tests that exercise that path call
:func:`load_fake_flexkv` from a fixture. It drops any ``flexkv`` modules already
imported, prepends tests/fakes to ``sys.path`` for the test only, and resets the
fake's recorded managers before and after.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

FAKES = Path(__file__).resolve().parent / "fakes"


def drop_flexkv_modules() -> None:
    """Forget every imported ``flexkv`` module, so the next import finds the path's."""
    for name in [m for m in sys.modules if m == "flexkv" or m.startswith("flexkv.")]:
        del sys.modules[name]


@contextmanager
def load_fake_flexkv(
    monkeypatch: pytest.MonkeyPatch, require_cuda: bool = False
) -> Iterator[ModuleType]:
    """The fake's control module (``flexkv._fake``), importable as ``flexkv`` inside."""
    drop_flexkv_modules()
    monkeypatch.syspath_prepend(str(FAKES))
    fake = importlib.import_module("flexkv._fake")
    fake.reset()
    fake.Knobs.require_cuda = require_cuda
    try:
        yield fake
    finally:
        fake.reset()
        drop_flexkv_modules()
