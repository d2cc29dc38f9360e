"""Batched predictor passes against one pass per prompt, same prompts, same run.

Loads a checkpoint (default: the shipped one) as a sidecar does, takes ``--prompts``
real prompts of about ``--tokens`` tokens each (0.5-1.5x, from Tiny Shakespeare),
and times, alternately for ``--repeats`` rounds, their passes one by one
(``Predictor.stream``) and as one batched pass (``Predictor.stream_batch``, what
``server/batcher.py`` runs for concurrent transfers). Every prompt's layers from the
batch are compared bit for bit with its lone pass's; exit status 1 if any differs.

Usage::

    .venv/bin/python benchmarks/predictor_batch.py [--prompts 8] [--tokens 64] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus" / "tinyshakespeare.txt"


def prompts(n: int, tokens: int, seed: int) -> list[np.ndarray]:
    from transformers import AutoTokenizer

    from speckv.predictor.target import target_dir

    tok = AutoTokenizer.from_pretrained(target_dir(), local_files_only=True)
    text = CORPUS.read_text(encoding="utf-8")[:400_000] if CORPUS.is_file() else "To be or not to be. " * 20_000
    ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], np.int64)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = max(1, int(tokens * (0.5 + rng.random())))
        start = int(rng.integers(0, len(ids) - length))
        out.append(ids[start:start + length])
    return out


def one_by_one(pred, ps: list[np.ndarray]) -> tuple[float, list[dict]]:
    got: list[dict[int, np.ndarray]] = [{} for _ in ps]
    t0 = time.perf_counter()
    for ids, g in zip(ps, got, strict=True):
        pred.stream(ids, lambda i, b, g=g: g.__setitem__(i, b.copy()))
    return time.perf_counter() - t0, got


def batched(pred, ps: list[np.ndarray]) -> tuple[float, list[dict]]:
    got: list[dict[int, np.ndarray]] = [{} for _ in ps]
    sinks = [lambda i, b, g=g: g.__setitem__(i, b.copy()) for g in got]
    t0 = time.perf_counter()
    errors = pred.stream_batch([(ids, s, None) for ids, s in zip(ps, sinks, strict=True)])
    seconds = time.perf_counter() - t0
    if any(e is not None for e in errors):
        raise RuntimeError(f"a batched prompt failed: {errors}")
    return seconds, got


def identical(a: list[dict], b: list[dict]) -> bool:
    return all(sorted(x) == sorted(y) and all(np.array_equal(x[i], y[i]) for i in x) for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--predictor", default=None, help="checkpoint directory (default: the shipped one)")
    ap.add_argument("--target", default="default", help="its target, for derived weights (default: the embedded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from speckv.server.config import ServerConfig
    from speckv.server.runtime import Runtime

    pred = Runtime.load(ServerConfig(role="decoder", predictor=args.predictor, target=args.target)).predictor
    ps = prompts(args.prompts, args.tokens, args.seed)
    batched(pred, ps[:2])  # warm both paths (first-call allocations, kernel selection)
    lone, joint, same = [], [], True
    for _ in range(args.repeats):
        t1, a = one_by_one(pred, ps)
        t2, b = batched(pred, ps)
        lone.append(t1)
        joint.append(t2)
        same = same and identical(a, b)
    r = {"rung": pred.checkpoint.rung.name, "batchable": pred.batches, "prompts": len(ps),
         "tokens": [len(p) for p in ps], "one_by_one_s": statistics.median(lone), "batched_s": statistics.median(joint),
         "speedup": statistics.median(lone) / statistics.median(joint), "identical": same, "repeats": args.repeats}
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{r['prompts']} prompts of {sum(r['tokens'])} tokens ({r['rung']}): "
              f"one by one {r['one_by_one_s']:.3f} s, "
              f"batched {r['batched_s']:.3f} s ({r['speedup']:.2f}x, medians of {r['repeats']}); "
              f"bit-identical: {r['identical']}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
