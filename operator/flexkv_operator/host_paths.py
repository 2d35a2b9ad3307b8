"""The node directories an agent pod mounts, and which SSD paths a pool may name.

Every hostPath directory of an agent pod is handed to the agent's user by an init
container (``chown``, see :mod:`flexkv_operator.agent_pod`), so a directory a
pool names must be a dedicated one: :func:`ssd_path_problem` refuses system
directories, paths that are not written in normal form, and paths that would
collide with the agent container's own mounts.
"""

from __future__ import annotations

import posixpath

from flexkv_operator import names

#: Host directory of the ``ipc://`` engine socket, mounted at the same path.
ENGINE_SOCKET_DIR = names.ENGINE_SOCKET_DIR
#: Host directory (on the node's tmpfs) that agent and engine pods mount at
#: :data:`SHM_MOUNT`, so POSIX shared-memory segments an engine creates by name
#: are the agent's to open by the same name.
SHM_HOST_DIR = "/dev/shm/flexkv"
SHM_MOUNT = "/dev/shm"
#: The agent's writable scratch directory (an emptyDir; the root filesystem is read-only).
TMP_MOUNT = "/tmp"

# Trees an SSD path may neither be nor lie inside: the node's system directories,
# the container runtime's state, and the agent container's own mount points.
_FORBIDDEN_TREES = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
    "/root", "/run", "/sbin", "/sys", "/tmp", "/usr", "/var/run", "/var/log",
    "/var/lib/kubelet", "/var/lib/containerd", "/var/lib/docker", "/var/lib/containers",
    ENGINE_SOCKET_DIR, SHM_MOUNT, names.CONFIG_MOUNT, TMP_MOUNT,
)
# Directories an SSD path may lie inside but not be (they hold other things).
_SHARED_PARENTS = ("/", "/home", "/media", "/mnt", "/opt", "/srv", "/var", "/var/lib",
                   "/var/cache")

_EXAMPLE = "/mnt/nvme0/flexkv"


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def ssd_path_problem(path: str) -> str | None:
    """Why ``path`` cannot be an SSD tier directory, or None when it can.

    ``path`` is already known to be an absolute string. The answer names the path
    and the fix, for a ``spec.tiers.ssd.paths`` problem.
    """
    normal = "/" + posixpath.normpath(path).lstrip("/")
    if normal != path:
        return (
            f"{path!r} is not in normal form (no '.', '..', '//' or trailing '/'); "
            f"write it as {normal!r}"
        )
    for tree in _FORBIDDEN_TREES:
        if _inside(path, tree):
            return (
                f"{path!r} lies in {tree!r}, which the node or the agent pod already uses; "
                f"the agent's init container would hand it to the agent user. Use a "
                f"dedicated directory such as {_EXAMPLE}"
            )
    if path in _SHARED_PARENTS:
        return (
            f"{path!r} is a shared system directory; the agent's init container would hand "
            f"it to the agent user. Use a dedicated directory below it, such as {_EXAMPLE}"
        )
    return None
