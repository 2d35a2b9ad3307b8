"""A call to an agent that was SIGKILLed ends with ``AgentUnavailableError`` as soon
as the client sees that nothing listens on the socket file the agent left behind,
instead of waiting out the call's timeout: a real agent process and the client."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import yaml

from node_agent.client import AgentUnavailableError, EngineClient, RankInfo, SharedKVBuffers
from tests.agent.harness import (
    LAYOUT,
    NUM_SLOTS,
    agent_mapping,
    short_dir,
    start_agent_process,
    stop_process,
    wait_healthy,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def test_a_call_to_a_killed_agent_fails_as_unavailable_not_after_its_timeout() -> None:
    work = short_dir("kill")
    data = agent_mapping(work, "solo")
    path = work / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = start_agent_process(path, work / "agent.log")
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    try:
        wait_healthy(f"http://127.0.0.1:{data['ports']['http']}", proc)
        client = EngineClient(str(data["engineSocket"]), RankInfo(replica="eng-0"),
                              timeout=60)
        client.register_kv_buffers(LAYOUT, bufs.handles)
        tokens = np.arange(100, 164, dtype=np.int64)
        assert client.lookup("before", tokens) == 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert Path(str(data["engineSocket"])).exists()  # left behind by the killed agent
        with pytest.raises(AgentUnavailableError, match="went away during the call"):
            client.lookup("after", tokens)
        client.close()
    finally:
        bufs.close()
        stop_process(proc)
        shutil.rmtree(work, ignore_errors=True)
