"""The remote tier: a pool of KV blocks shared by every agent, on Mooncake Store.

Modules, one job each (docs/remote.md):

* :mod:`.settings` -- :class:`RemoteSettings`, the tier's validated settings;
* :mod:`.keys` -- object keys: the block's prefix-chained hash plus a fingerprint of
  everything that makes block bytes incompatible;
* :mod:`.calls` -- :class:`BoundedCaller`, every remote call bounded by a timeout;
* :mod:`.health` -- :class:`RemoteHealth`, master up / down and its metric;
* :mod:`.mooncake_client` -- the only importer of ``mooncake``;
* :mod:`.writer` -- :class:`WriteBehind`, the bounded write-behind queue;
* :mod:`.tier` -- :class:`RemoteTier`, lookup / fetch / write of CPU-tier blocks.

Nothing here imports ``mooncake`` at module import time: only
:func:`.mooncake_client.connect` does, when a remote tier is configured.
"""
