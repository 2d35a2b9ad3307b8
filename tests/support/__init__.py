"""Helpers every test suite shares: bounded waits (``waiting``), free ports
(``ports``), a settable clock (``clock``), group views from KVCacheGroup status
(``group_views``), the emulated Kubernetes API server (``kube_api``) and the
operator's import probe (``operator_imports``).

Import as ``from tests.support.<module> import ...`` (the one convention for
helpers shared across suites).
"""
