"""A FAKE ``flexkv`` package for tests: it is not FlexKV and moves no GPU memory.

Real FlexKV (github.com/taco-project/FlexKV) is built from source against CUDA
and cannot be installed in CI. This package has the same module paths and call
signatures as the parts of FlexKV that ``node_agent.backend.flexkv_adapter``
uses, and it checks every argument of every call against FlexKV's real API and
the rules in docs/flexkv.md: a call FlexKV would reject, or one that FlexKV
would silently mis-execute (wrong dtype, a mask that is not a bool array, a slot
mapping that is not made of whole GPU pages, a launch of an id that is not a
matched, un-launched task), raises ``AssertionError`` or ``TypeError`` naming
the bad value. It keeps a small dict-based prefix index and copies KV rows
between registered tensors and its own block store, so masks, hits and round
trips are realistic.

Tests put the directory holding this package on ``sys.path`` through a fixture
(``monkeypatch.syspath_prepend``); product code never sees it.
"""

IS_FAKE = True
