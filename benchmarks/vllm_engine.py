"""One vLLM engine (CPU backend) of benchmarks/vllm_pair.py, run inside vLLM's own
environment (``make test-vllm`` makes it): a single instance, or the prefill
(kv_producer) or decode (kv_consumer) half of a pair joined by speckv's connector.

    python benchmarks/vllm_engine.py JOB.json     # prints one JSON line: "RESULT {...}"

JOB: {"role": "single"|"producer"|"consumer", "model": DIR, "prompts": [text, ...],
"params": [kv_transfer_params | null, ...], "max_tokens": N, "extra_config": {...}}.
A producer stays up after generating (its Submits may still be streaming) until a
line arrives on stdin. Each engine is pinned to its core by the caller
(VLLM_CPU_OMP_THREADS_BIND).
"""

from __future__ import annotations

import json
import sys
import time


def build(job: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if job["role"] != "single":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="SpeckvConnector", kv_connector_module_path="speckv.client.vllm",
            kv_role="kv_producer" if job["role"] == "producer" else "kv_consumer",
            kv_load_failure_policy="recompute", kv_connector_extra_config=job.get("extra_config", {}))
    return LLM(model=job["model"], dtype="bfloat16", enforce_eager=True, max_model_len=job.get("max_model_len", 1024),
               seed=0, **kw)


def run(job: dict) -> dict:
    from vllm import SamplingParams

    t0 = time.monotonic()
    llm = build(job)
    load_s = time.monotonic() - t0
    n = job["max_tokens"] if job["role"] != "producer" else 1
    sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                          extra_args={"kv_transfer_params": p} if p else None) for p in job["params"]]
    t1 = time.monotonic()
    outs = llm.generate(job["prompts"], sps, use_tqdm=False)
    gen_s = time.monotonic() - t1
    return {"role": job["role"], "load_s": round(load_s, 2), "generate_s": round(gen_s, 3),
            "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "kv_transfer_params": [o.kv_transfer_params for o in outs]}


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    print("RESULT " + json.dumps(run(job)), flush=True)
    if job["role"] == "producer":
        sys.stdin.readline()  # NOTE: keep the engine (and its Submit streams) up until told


if __name__ == "__main__":  # NOTE: vLLM's engine core is a spawned process: the guard is required
    main()
