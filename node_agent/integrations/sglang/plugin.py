"""The ``sglang.srt.plugins`` entry point and the radix-cache backend factory.

SGLang 0.5.23 runs every entry point of the group ``sglang.srt.plugins`` through
``load_plugins()`` (``sglang/srt/plugins/__init__.py``) first thing in each
scheduler process (``run_scheduler_process`` in
``sglang/srt/managers/scheduler.py``). :func:`register` then calls
``register_radix_cache_backend("flexkv-agent", build_radix_cache)``
(``sglang/srt/mem_cache/registry.py``), and ``--radix-cache-backend
flexkv-agent`` makes ``create_tree_cache`` call :func:`build_radix_cache` with
its ``TreeCacheBuildContext``.

Importing this module does not import SGLang; :func:`register` does, and says
how to fix a missing SGLang.
"""

from __future__ import annotations

import logging
from typing import Any

from node_agent.integrations.sglang.settings import PluginSettings, model_identity

log = logging.getLogger(__name__)

#: The name for ``--radix-cache-backend``.
BACKEND_NAME = "flexkv-agent"


def _sglang_registry() -> Any:
    try:
        from sglang.srt.mem_cache import registry
    except ImportError as exc:
        raise ImportError(
            f"the flexkv-agent SGLang plugin needs SGLang ({exc}); install it next to this "
            "package (pip install 'sglang==0.5.23'), or uninstall flexkv-operator from the "
            "engine's environment, or set SGLANG_PLUGINS to a list without flexkv-agent"
        ) from exc
    return registry


def register() -> None:
    """Entry point: register the ``flexkv-agent`` radix-cache backend (idempotent)."""
    registry = _sglang_registry()
    if registry.get_radix_cache_factory(BACKEND_NAME) is build_radix_cache:
        return
    registry.register_radix_cache_backend(BACKEND_NAME, build_radix_cache)
    log.info("Registered SGLang radix-cache backend", extra={"backend": BACKEND_NAME})


def _pp_position() -> tuple[int, int]:
    """This scheduler's PP rank and size, from SGLang's runtime context."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    try:
        return int(par.pp_rank), int(par.pp_size)
    except (AttributeError, RuntimeError, AssertionError, TypeError):
        group = getattr(par, "pp_group", None)
        if group is None:
            return 0, 1
        return int(group.rank_in_group), int(group.world_size)


def _attn_tp_size(tp_size: int) -> int:
    """Attention TP width from SGLang's runtime context (``tp_size`` when unknown)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().attn_tp_size)
    except (AttributeError, RuntimeError, AssertionError, TypeError):
        return tp_size


def build_radix_cache(ctx: Any) -> Any:
    """SGLang's radix-cache factory for ``--radix-cache-backend flexkv-agent``.

    ``ctx`` is SGLang's ``TreeCacheBuildContext``. Configuration errors (settings,
    an unsupported KV pool, DP attention, a layout the agent refuses) raise
    at start-up; an absent agent does not (SGLang serves from its radix cache and
    the connector keeps trying)."""
    from node_agent.client import EngineClient, RankInfo
    from node_agent.integrations.sglang.connector import AgentKVConnector
    from node_agent.integrations.sglang.kv_pool import layout_from_kv_pool
    from node_agent.integrations.sglang.radix_cache import AgentRadixCache

    settings = PluginSettings.from_env()
    pp_rank, pp_size = _pp_position()
    tp_rank, tp_size = int(ctx.tp_rank), int(ctx.tp_size)
    attn_tp = _attn_tp_size(tp_size)
    if attn_tp != tp_size:
        raise ValueError(
            f"--radix-cache-backend {BACKEND_NAME} needs every TP rank to serve the same "
            f"requests, but attention TP size is {attn_tp} of tp_size={tp_size} (DP "
            "attention); drop --enable-dp-attention or use --enable-flexkv with FlexKV's "
            "own connector"
        )
    replica = settings.replica_for(pp_size)
    model = model_identity(ctx.server_args, settings.model_salt).digest()
    page_size = int(ctx.params.page_size)
    # TP rank 0 alone makes the agent's data calls (they move every TP rank's KV);
    # the other TP ranks take its answers over SGLang's own TP CPU group, as every
    # scheduler step already does for the requests themselves.
    broadcast = None
    if tp_size > 1:
        group = ctx.tp_group

        def broadcast(obj: Any) -> Any:
            return group.broadcast_object(obj, src=0)

    def make_connector(kv_pool: Any) -> AgentKVConnector:
        layout, buffers = layout_from_kv_pool(kv_pool, page_size, tp_size=tp_size)
        client = EngineClient(settings.socket,
                              RankInfo(replica=replica, pp_rank=pp_rank, pp_size=pp_size,
                                       tp_rank=tp_rank, tp_size=tp_size, model=model),
                              timeout=settings.timeout)
        conn = AgentKVConnector(client, layout, buffers, page_size=page_size,
                                retry_seconds=settings.retry_seconds,
                                orphan_store_seconds=settings.orphan_store_seconds,
                                tp_rank=tp_rank, tp_size=tp_size, tp_broadcast=broadcast)
        if conn.connect():
            log.info("Registered KV buffers with the node agent",
                     extra={"socket": settings.socket, "replica": replica,
                            "ppRank": pp_rank, "ppSize": pp_size, "tpRank": tp_rank})
        return conn

    return AgentRadixCache(ctx.params, make_connector)
