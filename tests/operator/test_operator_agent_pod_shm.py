"""Why mounting one host directory at /dev/shm is enough for CPU KV buffers across pods.

Engines create their KV buffer segments by name and the agent opens them by name
(``node_agent.engine_api.buffers``); on Linux a POSIX shared-memory name is the file
``/dev/shm/<name>``. The operator mounts the node's ``/dev/shm/flexkv`` at the agent
container's ``/dev/shm`` and engine pods mount it there too, so both sides resolve a
name to the same tmpfs file. These checks pin that resolution down with the real
engine and agent code: an engine's segment is a file under /dev/shm, and a file
placed there (as an engine in another pod writes it through the shared directory) is
what the agent opens.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest
from flexkv_operator import host_paths

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/dev/shm").is_dir(),
    reason="POSIX shared memory as files under /dev/shm is Linux behaviour",
)
torch = pytest.importorskip("torch", reason="agent extra (torch) not installed")
buffers = pytest.importorskip("node_agent.engine_api.buffers", reason="agent not importable")
client = pytest.importorskip("node_agent.client", reason="agent not importable")


def test_an_engine_segment_is_a_file_in_dev_shm() -> None:
    kv = client.SharedKVBuffers([[[4, 8]]], torch.float32, prefix="flexkv-mount-check")
    try:
        (handle,) = kv.handles[0]
        path = Path(host_paths.SHM_MOUNT) / handle["name"]
        assert path.is_file() and path.stat().st_size == 4 * 8 * 4
        kv.tensors[0][0].fill_(7.0)
        assert path.read_bytes() == torch.full((4, 8), 7.0).numpy().tobytes()
    finally:
        kv.close()
    assert not path.exists()


def test_the_agent_opens_a_file_placed_in_dev_shm_by_name() -> None:
    name = f"flexkv-mount-check-{os.getpid()}-{secrets.token_hex(4)}"
    path = Path(host_paths.SHM_MOUNT) / name
    data = torch.arange(24, dtype=torch.float16).reshape(2, 3, 4)
    path.write_bytes(data.numpy().tobytes())
    try:
        opened = buffers.open_buffer(
            {"kind": "shm", "name": name, "dtype": "float16", "shape": [2, 3, 4], "offset": 0})
        try:
            assert torch.equal(opened.tensor, data)
            opened.tensor[1, 2, 3] = -1.0  # writes land in the shared file
            assert torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float16)[-1] == -1
        finally:
            opened.close()
    finally:
        path.unlink(missing_ok=True)


def test_a_name_missing_from_dev_shm_is_a_clear_error() -> None:
    """What an agent reports when an engine pod did not mount the shared directory."""
    name = f"flexkv-absent-{secrets.token_hex(6)}"
    with pytest.raises(buffers.HandleError, match=f"{name}.*does not exist"):
        buffers.open_buffer({"kind": "shm", "name": name, "dtype": "uint8", "shape": [1]})
