"""The w8a8i rungs' int8 attention against float SDPA, one layer of the embedded model's shape.

Per thread count: milliseconds per layer of float32 SDPA (what the w8a8 rungs run), BF16 SDPA and
the native int8 kernel (``speckv.predictor.int8_attention``: its fastest path here, and its fastest
but AMX), medians of ``--repeats``, on random BF16 q/k/v of the embedded SmolLM2-135M's attention
shape (9 query heads, 3 kv heads, head_dim 64); the kernel's output is compared bit for bit with the
scalar path (the torch reference's bits, tests/predictor/test_int8_attention.py) and with the path
without AMX, and its relative error against float32 SDPA is reported.

    .venv/bin/python benchmarks/attention_bench.py --tokens 2048 --json

Where the time goes inside the kernel: ``perf record`` on this script (the scores' VNNI products,
the softmax weights' exp2 and quantisation, the P @ V VNNI products; on an AMX CPU, 2026-12-03: the
per-row, per-key-block steps of the softmax weights, not the tile products).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(tokens: int, threads: list[int], repeats: int, seed: int = 0) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from speckv.predictor import int8_attention as ia

    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(HEADS, tokens, HEAD_DIM, generator=g) * 2).bfloat16()
    k = (torch.randn(KV_HEADS, tokens, HEAD_DIM, generator=g) * 2).bfloat16()
    v = torch.randn(KV_HEADS, tokens, HEAD_DIM, generator=g).bfloat16()
    sdpa = lambda dt: F.scaled_dot_product_attention(q[None].to(dt), k[None].to(dt), v[None].to(dt),  # noqa: E731
                                                    is_causal=True, enable_gqa=True)
    rows = []
    old = ia.THREADS
    try:
        for n in threads:
            torch.set_num_threads(n)
            ia.THREADS = n
            row = {"threads": n, "sdpa_fp32_ms": median_ms(lambda: sdpa(torch.float32), repeats),
                   "sdpa_bf16_ms": median_ms(lambda: sdpa(torch.bfloat16), repeats),
                   "int8_ms": median_ms(lambda: ia.attention(q, k, v), repeats),
                   "int8_no_amx_ms": median_ms(lambda: ia.attention(q, k, v, amx=False), repeats)}
            row["speedup_vs_fp32"] = row["sdpa_fp32_ms"] / row["int8_ms"]
            rows.append(row)
    finally:
        ia.THREADS = old
    out = ia.attention(q, k, v)
    ref = sdpa(torch.float32)[0].transpose(0, 1)
    same = all(torch.equal(out.view(torch.int16), ia.attention(q, k, v, **kw).view(torch.int16))
               for kw in ({"scalar": True}, {"amx": False}))
    err = float((out.float() - ref).norm() / ref.norm())
    return {"tokens": tokens, "shape": [HEADS, KV_HEADS, HEAD_DIM], "rows": rows, "scalar_equal": same,
            "rel_error_vs_fp32": err}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = measure(a.tokens, a.threads, a.repeats)
    if a.json:
        print(json.dumps(r))
    else:
        for row in r["rows"]:
            print(f"{row['threads']} thread(s): SDPA fp32 {row['sdpa_fp32_ms']:.1f} ms, "
                  f"bf16 {row['sdpa_bf16_ms']:.1f} ms, int8 {row['int8_ms']:.1f} ms "
                  f"(without AMX {row['int8_no_amx_ms']:.1f}) "
                  f"({row['speedup_vs_fp32']:.2f}x fp32)")
        print(f"scalar path equal: {r['scalar_equal']}; error vs fp32 SDPA {r['rel_error_vs_fp32']:.4f}")
    return 0 if r["scalar_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
