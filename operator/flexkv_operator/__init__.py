"""flexkv-operator control plane: CRDs, reconcile of KVCachePool, PP leader election.

Imported as ``flexkv_operator``; the folder ``operator/`` that holds it has no
``__init__.py`` so it never shadows the standard library module ``operator``.
This package never imports torch or zmq.
"""

__version__ = "0.1.0"
