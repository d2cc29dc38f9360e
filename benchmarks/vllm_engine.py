"""One vLLM engine (CPU backend) of benchmarks/vllm_pair.py, run inside vLLM's own
environment (``make test-vllm`` makes it): a single instance, or the prefill
(producer) or decode (consumer) half of a pair joined by speckv's connector or by
vLLM's own ExampleConnector (a shared folder), for comparison.

    python benchmarks/vllm_engine.py ROLE MODEL_DIR EXTRA_CONFIG_JSON [ENGINE_ARGS_JSON]

ROLE: single | producer | consumer | example_producer | example_consumer. The engine
loads, prints ``READY``, then runs one job per stdin line, ``{"prompts": [...],
"params": [kv_transfer_params | null, ...], "max_tokens": N}``, answering each with one
``RESULT {...}`` line; an empty line ends it. The caller pins it to a core
(VLLM_CPU_OMP_THREADS_BIND).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

CONNECTORS = {"producer": ("SpeckvConnector", "kv_producer"), "consumer": ("SpeckvConnector", "kv_consumer"),
              "example_producer": ("ExampleConnector", "kv_producer"),
              "example_consumer": ("ExampleConnector", "kv_consumer")}


def build(role: str, model: str, extra: dict[str, Any], engine_args: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = dict(engine_args)
    if role in CONNECTORS:
        name, kv_role = CONNECTORS[role]
        module = {"kv_connector_module_path": "speckv.client.vllm"} if name == "SpeckvConnector" else {}
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector=name, kv_role=kv_role, kv_connector_extra_config=extra,
                                                    kv_load_failure_policy="recompute", **module)
    # NOTE: stats on, so the connector's counters reach vLLM's metrics (llm.get_metrics())
    return LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=1024, seed=0, disable_log_stats=False,
               **kw)


def run(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    sps = [SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                          extra_args={"kv_transfer_params": p} if p else None) for p in job["params"]]
    t0 = time.monotonic()
    outs = llm.generate(job["prompts"], sps, use_tqdm=False)
    return {"generate_s": round(time.monotonic() - t0, 4), "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "kv_transfer_params": [o.kv_transfer_params for o in outs],
            "connector_metrics": {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                                  if m.name.startswith("vllm:speckv_")}}


def main() -> None:
    role, model, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    engine_args = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    # NOTE: the protocol keeps stdout to itself: vLLM (and the engine processes it spawns,
    # which inherit fd 1) log to stdout, and a log line could split a RESULT line
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    t0 = time.monotonic()
    llm = build(role, model, extra, engine_args)
    print(f"READY {time.monotonic() - t0:.1f}", file=proto, flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        print("RESULT " + json.dumps(run(llm, json.loads(line))), file=proto, flush=True)


if __name__ == "__main__":  # NOTE: vLLM's engine core is a spawned process: the guard is required
    main()
