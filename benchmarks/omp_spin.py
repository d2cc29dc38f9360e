"""How long torch's idle OpenMP workers spin, and what it costs the predictor and the coder.

After each parallel op torch's OpenMP workers (libgomp) spin, 300,000 rounds by default,
before they sleep. In a predictor pass torch ops alternate with the native kernels, whose own
thread pool then shares the cores with those spinning workers. ``GOMP_SPINCOUNT`` (read once,
when libgomp loads) bounds the spin; it is a wait policy and changes no bit.

Each variant runs in its own child process (so libgomp reads its setting), alternating with
the others for ``--rounds`` rounds; a child loads the shipped predictor, runs one warm pass,
then times ``--passes`` x (predictor pass, target prefill) and the native coder's encode and
decode (best of 2) on that prompt's KV. Medians per variant, and each variant over the first.

    .venv/bin/python benchmarks/omp_spin.py --rounds 3 --json /tmp/omp_spin.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

VARIANTS = {"default": None, "10000": "10000", "1000": "1000", "0": "0"}


def child(tokens: int, passes: int) -> dict[str, Any]:
    """One variant's figures, in this process (its GOMP_SPINCOUNT already set)."""
    import time

    import numpy as np

    from speckv.cli.bench import best_time, load_text
    from speckv.coder.codec import Codec, CodecConfig, bf16_bits
    from speckv.predictor.session import Session

    sess = Session.open()
    ids = sess.target.tokenize(load_text(None)[0], tokens)
    pre = sess.prefill(ids)  # warm
    pred, targ = [], []
    for _ in range(passes):
        again = sess.prefill(ids)
        if not np.array_equal(bf16_bits(again.mu), bf16_bits(pre.mu)):
            raise RuntimeError("mu differs between passes")
        pred.append(again.predictor_s)
        targ.append(again.target_s)
    codec = Codec.from_predictor(sess.predictor, CodecConfig(coder="native"))
    t0 = time.perf_counter()
    te, recs = best_time(lambda: list(codec.encode(pre.kv, ids, pre.mu)))
    td, back = best_time(lambda: codec.decode(recs, ids, pre.mu))
    if not np.array_equal(back, bf16_bits(pre.kv)):
        raise RuntimeError("the round trip is not lossless")
    mb = bf16_bits(pre.kv).nbytes / 1e6
    return {"policy": os.environ.get("GOMP_SPINCOUNT", "default"),
            "predictor_s": statistics.median(pred), "target_s": statistics.median(targ),
            "encode_mb_s": mb / te, "decode_mb_s": mb / td, "coder_wall_s": time.perf_counter() - t0}


def run_variant(name: str, tokens: int, passes: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if VARIANTS[name] is not None:
        env["GOMP_SPINCOUNT"] = VARIANTS[name]
    out = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(tokens), "--passes", str(passes)],
                         env=env, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.tokens, a.passes)))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in a.variants}
    for r in range(a.rounds):
        for v in a.variants:
            runs[v].append(run_variant(v, a.tokens, a.passes))
            print(f"round {r + 1} GOMP_SPINCOUNT={v}: {json.dumps(runs[v][-1])}", file=sys.stderr, flush=True)
    keys = ("predictor_s", "target_s", "encode_mb_s", "decode_mb_s")
    med = {v: {k: statistics.median(x[k] for x in runs[v]) for k in keys} for v in a.variants}
    base = med[a.variants[0]]
    print(f"| GOMP_SPINCOUNT | {' | '.join(keys)} | pass / target | each over {a.variants[0]} |")
    print("|---|" + "---:|" * (len(keys) + 2))
    for v, m in med.items():
        rel = ", ".join(f"{k.split('_')[0]} {m[k] / base[k]:.3f}" for k in keys)
        print(f"| {v} | {' | '.join(f'{m[k]:.3f}' for k in keys)} | {m['predictor_s'] / m['target_s']:.3f} | {rel} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "medians": med, "tokens": a.tokens, "passes": a.passes}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
