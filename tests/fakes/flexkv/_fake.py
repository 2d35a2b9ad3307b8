"""Process-wide state of the fake: managers by GPU register port, and test knobs."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexkv.kvmanager import KVManager

#: Every KVManager constructed in this process, in order (tests inspect the last one).
MANAGERS: list[KVManager] = []
#: Started managers by ``gpu_register_port``: where KVTPClient registrations land.
BY_REGISTER_PORT: dict[str, KVManager] = {}


class Knobs:
    """Test switches. The only relaxation of FlexKV's rules is ``require_cuda``:
    real ``KVTPClient.register_to_server`` rejects non-CUDA tensors, and CI has no GPU."""

    require_cuda: bool = True


def reset() -> None:
    """Forget every manager and restore the knobs (call between tests)."""
    MANAGERS.clear()
    BY_REGISTER_PORT.clear()
    Knobs.require_cuda = True
