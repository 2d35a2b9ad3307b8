"""KV events for KV-aware routers: which blocks this agent holds, per tier.

The agent publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` on a
ZMQ PUB socket in vLLM's own wire format (:mod:`node_agent.events.wire`), with
block hashes computed the way vLLM computes them (:mod:`node_agent.events.hashes`)
or the agent's own (``kvEvents.blockHash: agent``). Publishing never blocks the
data path: the backend only enqueues (:class:`StageEvents`), a sender thread
hashes, encodes and sends (:class:`KvEventPublisher`). docs/operations.md, "KV
events for routers", is the user's guide.
"""

from node_agent.events.publisher import KvEventPublisher, KvEventsBindError, StageEvents

__all__ = ["KvEventPublisher", "KvEventsBindError", "StageEvents"]
