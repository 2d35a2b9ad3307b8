"""What the operator and the agents must agree on, written once (docs/contracts.md).

The operator imports this package and nothing else of ``node_agent``, so every
module here imports only the standard library and never another ``node_agent``
module: importing it loads no torch, no zmq and no agent runtime.

* :mod:`.kube`: the CRD's group, version and kinds, the labels and annotations of
  the agents' Leases, and the names of Leases and ``KVCacheGroup`` objects;
* :mod:`.files`: the agent configuration file, its mounts, the CurveZMQ key files
  and the downward-API variables the agent's pod carries;
* :mod:`.quantity`: Kubernetes quantities (``8Gi``), parsed exactly;
* :mod:`.mooncake`: the bounds of the remote tier's Mooncake settings.
"""
