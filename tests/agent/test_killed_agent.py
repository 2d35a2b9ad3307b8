"""A call to an agent that was SIGKILLed ends with ``AgentUnavailableError`` as soon
as the client sees that nothing listens on the socket file the agent left behind,
instead of waiting out the call's timeout: a real agent process and the client."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import numpy as np
import pytest

from node_agent.client import AgentUnavailableError, EngineClient, RankInfo, SharedKVBuffers
from tests.agent.harness import LAYOUT, NUM_SLOTS, agent_process, short_dir

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def test_a_call_to_a_killed_agent_fails_as_unavailable_not_after_its_timeout() -> None:
    work = short_dir("kill")
    bufs = SharedKVBuffers.for_layout(LAYOUT, NUM_SLOTS)
    try:
        with agent_process(work) as agent:
            client = EngineClient(agent.socket, RankInfo(replica="eng-0"), timeout=60)
            client.register_kv_buffers(LAYOUT, bufs.handles)
            tokens = np.arange(100, 164, dtype=np.int64)
            assert client.lookup("before", tokens) == 0
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait(timeout=30)
            assert Path(agent.socket).exists()  # left behind by the killed agent
            with pytest.raises(AgentUnavailableError, match="went away during the call"):
                client.lookup("after", tokens)
            client.close()
    finally:
        bufs.close()
        shutil.rmtree(work, ignore_errors=True)
