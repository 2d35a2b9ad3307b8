"""Kubernetes integration through the ``kubernetes`` client (never kopf): the agent's
heartbeat Lease and the group views read from KVCacheGroup status (or a file)."""
