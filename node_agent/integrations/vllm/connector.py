"""``FlexKVAgentConnector``: vLLM's KV connector backed by the node's FlexKV agent.

Turned on with::

    --kv-transfer-config '{"kv_connector": "FlexKVAgentConnector",
      "kv_connector_module_path": "node_agent.integrations.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"engineSocket": "/var/run/flexkv/engine.sock"}}'

vLLM builds one instance per role: SCHEDULER in the engine-core process (every
data call, :mod:`.scheduler_side`) and WORKER in each worker process (KV cache
registration, :mod:`.worker_side`). The two talk only through vLLM's own
per-step metadata: the scheduler's :class:`AgentConnectorMetadata` says whether
transfers are pending and which loads failed; each worker echoes the failed
blocks as ``invalid_block_ids`` and returns :class:`AgentWorkerMetadata` while
anything is pending, so that every step (even an empty one) reaches
``update_connector_output``, where the scheduler adds its completions.

Under pipeline parallelism the metadata also carries the calls stage 0 made
(:class:`~.stage_calls.StageOp`); TP rank 0 of every other stage makes them on
its own node's agent (:mod:`.stage_calls`) and reports each ``retrieve`` that
returned in its worker metadata (docs/vllm.md, pipeline parallelism).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from node_agent.client import RankInfo
from node_agent.integrations.vllm.config import (
    ConnectorConfigError,
    model_identity,
    parse_extra_config,
)
from node_agent.integrations.vllm.scheduler_side import SchedulerSide
from node_agent.integrations.vllm.shm_pool import SharedKVAllocation
from node_agent.integrations.vllm.stage_calls import StageCaller, StageOp
from node_agent.integrations.vllm.worker_side import (
    Registrar,
    cuda_handles,
    describe_kv_caches,
    shm_handles,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class AgentConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    pending: bool = False
    failed: dict[str, list[int]] = field(default_factory=dict)
    stage_ops: list[StageOp] = field(default_factory=list)
    """Under PP: the calls stage 0 made since the last step, for the other stages."""


@dataclass
class AgentWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: the failed loads whose blocks this step reported invalid,
    and (PP stages 1..N-1) the ``(pp_rank, rid)`` of each ``retrieve`` that returned,
    and of each answered ``SlotsInUse`` (its copy may still write the blocks)."""

    failed_rids: set[str] = field(default_factory=set)
    loads_ended: set[tuple[int, str]] = field(default_factory=set)
    loads_stuck: set[tuple[int, str]] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, AgentWorkerMetadata)
        return AgentWorkerMetadata(self.failed_rids | other.failed_rids,
                                   self.loads_ended | other.loads_ended,
                                   self.loads_stuck | other.loads_stuck)


@dataclass
class AgentConnectorStats(KVConnectorStats):
    """Counters of the scheduler side since the last report (summed on aggregate)."""

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def bypass_reason(request: Request) -> str | None:
    """Why ``request``'s KV is not a function of its token ids and the engine's model
    alone (None: it is). The agent's blocks are keyed by token ids under the model's
    identity, so such a request must neither load another request's blocks nor store
    its own: vLLM's own prefix cache keys them with extra hash keys (the LoRA
    adapter, the multimodal inputs, the prompt embeddings, the cache salt) that the
    agent does not carry."""
    if getattr(request, "lora_request", None) is not None:
        return "lora"
    if getattr(request, "mm_features", None):
        return "multimodal"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds"
    if getattr(request, "cache_salt", None):
        return "cache_salt"
    return None


_PROM = {
    "agent_errors": ("vllm:flexkv_agent_errors",
                     "Calls to the FlexKV agent that failed (agent down or restarting); "
                     "requests were recomputed"),
    "hit_tokens": ("vllm:flexkv_agent_hit_tokens",
                   "Prompt tokens the FlexKV agent found, once per request"),
    "lookups": ("vllm:flexkv_agent_lookups", "Lookups made to the FlexKV agent"),
    "loaded_tokens": ("vllm:flexkv_agent_loaded_tokens",
                      "Tokens loaded from the FlexKV agent into vLLM's KV blocks"),
    "load_failures": ("vllm:flexkv_agent_load_failures",
                      "Loads from the FlexKV agent that failed and were recomputed"),
    "stored_tokens": ("vllm:flexkv_agent_stored_tokens",
                      "Tokens whose KV was stored into the FlexKV agent"),
    "stores_skipped": ("vllm:flexkv_agent_stores_skipped",
                       "Stores given up without a call: the FlexKV agent was known down"),
    "bypassed": ("vllm:flexkv_agent_bypassed_requests",
                 "Requests served without the FlexKV agent (no lookup, no store): their KV "
                 "depends on more than the token ids (a LoRA adapter, multimodal inputs, "
                 "prompt embeddings or a cache_salt)"),
}


class AgentPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters of :data:`_PROM`, one series per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for key, (name, doc) in _PROM.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for key, counter in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                counter.labels(*labels).inc(value)


class FlexKVAgentConnector(KVConnectorBase_V1):
    """A KV connector whose cache is the node's FlexKV agent (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.cfg = parse_extra_config(transfer.kv_connector_extra_config)
        if transfer.kv_load_failure_policy != "recompute":
            raise ConnectorConfigError(
                f"kv_load_failure_policy is {transfer.kv_load_failure_policy!r}; the FlexKV "
                "agent is a cache, a failed load must be recomputed: add "
                '"kv_load_failure_policy": "recompute" to --kv-transfer-config'
            )
        parallel = vllm_config.parallel_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(parallel.tensor_parallel_size)
        self.pp_size = int(parallel.pipeline_parallel_size)
        self.identity = model_identity(vllm_config.model_config, self.cfg.model_salt)
        self.model_digest = self.identity.digest()
        self._sched: SchedulerSide | None = None
        self._registrar: Registrar | None = None
        self._alloc: SharedKVAllocation | None = None
        self._stage: StageCaller | None = None
        self._pp_rank = 0
        self._empty_step = False
        """The last step :meth:`build_connector_meta` built scheduled no tokens."""
        if role == KVConnectorRole.SCHEDULER:
            self._check_agent_present()
            self._sched = SchedulerSide(self.cfg, self.block_size, self.tp_size,
                                        self.model_digest, pp_size=self.pp_size)
        else:
            self._head_size = int(vllm_config.model_config.get_head_size())

    def _check_agent_present(self) -> None:
        path = self.cfg.socket_for(0).removeprefix("ipc://")
        if self.cfg.require_agent and not os.path.exists(path):
            raise ConnectorConfigError(
                f"no FlexKV agent socket at kv_connector_extra_config.engineSocket={path!r}; "
                "start the agent (flexkv-agent run --config agent.yaml), point engineSocket at "
                "its engineSocket, or set requireAgent to false to start without it"
            )

    # ============================== worker side ==============================

    def get_mem_pool_context(self) -> SharedKVAllocation | None:
        if self.cfg_device_is_cpu():
            # Under PP the segment's name says the stage (operators and tests find it).
            prefix = "flexkv-vllm" if self.pp_size == 1 else f"flexkv-vllm-pp{_pp_rank()}"
            self._alloc = SharedKVAllocation(prefix)
            return self._alloc
        return None

    def cfg_device_is_cpu(self) -> bool:
        return str(self._vllm_config.device_config.device_type) == "cpu"

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        layout, tensors = describe_kv_caches(kv_caches, self.block_size, self._head_size,
                                             self.tp_size)
        if tensors[0].is_cuda:
            handles = cuda_handles(tensors)
        else:
            alloc = self._alloc
            if alloc is None or alloc.name is None or alloc.tensor is None:
                raise RuntimeError("FlexKV connector: vLLM's KV cache was not allocated in "
                                   "shared memory (get_mem_pool_context was not used)")
            handles = shm_handles(tensors, alloc.name, alloc.tensor)
        self._pp_rank = _pp_rank()
        socket = self.cfg.socket_for(self._pp_rank)
        rank = RankInfo(replica=self.cfg.replica, pp_rank=self._pp_rank, pp_size=self.pp_size,
                        tp_rank=get_tensor_model_parallel_rank(), tp_size=self.tp_size,
                        model=self.model_digest)
        self._registrar = Registrar(self.cfg, rank, layout, handles, self.block_size,
                                    socket=socket)
        if self._registrar.register(at_start=True):
            log.info("KV cache registered with the FlexKV agent: %s layers, layout %s, "
                     "%s tokens per block, model %s (%s), PP stage %s of %s at %s",
                     layout.num_layers, layout.name.value, self.block_size, self.model_digest,
                     self.identity, self._pp_rank, self.pp_size, socket)
        if self._pp_rank > 0 and rank.tp_rank == 0:
            self._stage = StageCaller(socket, RankInfo(
                replica=self.cfg.replica, pp_rank=self._pp_rank, pp_size=self.pp_size,
                tp_rank=0, tp_size=self.tp_size, model=self.model_digest),
                self.block_size, self.cfg.call_timeout_seconds, self.cfg.retry_seconds)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Stage 0's loads are made by the scheduler side, between steps; under PP the
        # other stages make the calls stage 0 made, on their own agents.
        meta = self._meta()
        if self._stage is not None and meta is not None and meta.stage_ops:
            self._stage.submit(meta.stage_ops)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def _meta(self) -> AgentConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, AgentConnectorMetadata) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        meta = self._meta()
        if meta is None:
            return set()
        return {b for blocks in meta.failed.values() for b in blocks}

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._registrar is not None:
            self._registrar.check()
        meta = self._meta()
        ended: set[tuple[int, str]] = set()
        stuck: set[tuple[int, str]] = set()
        if self._stage is not None:
            # Ended first: a stuck rid is recorded before its end, so it is never
            # reported ended in an earlier step than stuck.
            ended = {(self._pp_rank, rid) for rid in self._stage.take_loads_ended()}
            stuck = {(self._pp_rank, rid) for rid in self._stage.take_loads_stuck()}
        if not ended and not stuck and (meta is None or not (meta.pending or meta.failed)):
            return None
        return AgentWorkerMetadata(set(meta.failed) if meta is not None else set(), ended,
                                   stuck)

    # ============================== scheduler side ==============================

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        reason = bypass_reason(request)
        if reason is not None:  # its KV depends on more than its token ids
            self._sched.bypass(request.request_id, reason)
            return 0, False
        hit = self._sched.lookup(request.request_id, request.all_token_ids, num_computed_tokens)
        if hit is None:  # PP: the stages' lookups are under way; vLLM asks again next step
            return None, False
        return hit, hit > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._sched.after_alloc(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        # A step that schedules nothing waits for a load to end once it ran (in
        # update_connector_output, when its worker report completed none): the
        # step's own work overlaps the copy, and a load that ends in the wait is
        # reported in the same step.
        self._empty_step = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        report = self._sched.step_report()
        return AgentConnectorMetadata(pending=report.pending, failed=report.failed,
                                      stage_ops=self._sched.take_stage_ops())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        worker_meta = connector_output.kv_connector_worker_meta
        echoed: set[str] = set()
        ended: set[tuple[int, str]] = set()
        stuck: set[tuple[int, str]] = set()
        if isinstance(worker_meta, AgentWorkerMetadata):
            echoed, ended = worker_meta.failed_rids, worker_meta.loads_ended
            stuck = worker_meta.loads_stuck
        empty, self._empty_step = self._empty_step, False
        recv, sent = self._sched.step_output(set(echoed), ended, empty=empty,
                                             loads_stuck=stuck)
        if recv:
            connector_output.finished_recving = set(connector_output.finished_recving or ()) | recv
        if sent:
            connector_output.finished_sending = set(connector_output.finished_sending or ()) | sent

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        if bypass_reason(request) is not None:
            self._sched.bypass_ended(request.request_id)
            return False, None  # never stored: another request could not tell it apart
        held = self._sched.finished(request.request_id, request.all_token_ids,
                                    request.num_computed_tokens, block_ids)
        return held, None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._sched is None:
            return None
        stats = AgentConnectorStats(data=self._sched.take_counters())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None,
                                 ) -> KVConnectorStats | None:
        return AgentConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return AgentPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.close()
        if self._stage is not None:
            self._stage.close()
        if self._registrar is not None:
            self._registrar.close()
        if self._alloc is not None:
            self._alloc.close()


def _pp_rank() -> int:
    """This worker's PP rank (0 when vLLM's PP group is not initialised)."""
    from vllm.distributed.parallel_state import get_pp_group

    try:
        return int(get_pp_group().rank_in_group)
    except AssertionError:
        return 0
