"""The predictor ladder (issue 8): bits/scalar against predictor cost, per rung.

For each rung (fp8, hybrid:k, none, and ``target`` = hybrid:L, all layers BF16)
it builds a checkpoint calibrated exactly like the shipped default (first 4096
tokens of WikiText-2 validation, 2048-token segments, weights derived from the
target) into a temporary directory, then on the first ``--tokens`` tokens of
tinyshakespeare measures:

- bits/scalar: the real codec's coded size (header + chunk records, as
  ``speckv bench``), after checking the round trip bit for bit; the encoder
  uses the first timed run's mu and the decoder the last run's, so the
  predictor's run-to-run determinism is checked too;
- predictor_s and target_s: median wall time of ``--repeats`` runs each, on
  this machine, with the sidecars' deterministic settings (2 threads); the
  predictor under a sidecar's OpenMP wait policy, the target in a child process
  under an engine's (``speckv.cli.wait_policy``);
- predictor_cost = predictor_s / target_s, and nominal_cost =
  (k + 0.5 (L - k)) / L, an FP8 layer counted as half a BF16 layer as on an
  FP8 tensor-core GPU. On a CPU the FP8 copy is emulated (e4m3 weights
  dequantised to FP32, the same FP32 GEMM as the target), so its measured cost
  is ~1 per FP8 layer, not 0.5: the table prints both.

The target's KV of the calibration segments is computed once and shared by
every rung (same target, same segments: the bytes of each checkpoint are what
``speckv predictor build --rung R`` writes).

    .venv/bin/python benchmarks/ladder.py --json /tmp/ladder.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "corpus"
DEFAULT_RUNGS = ["fp8", "hybrid:2", "hybrid:4", "hybrid:6", "hybrid:8", "hybrid:10", "hybrid:15", "none", "target"]


class CachingTarget:
    """The target with ``kv`` memoised by prompt: calibration runs it once for all rungs."""

    def __init__(self, target: Any) -> None:
        self._t = target
        self._kv: dict[bytes, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    def kv(self, ids: Any) -> Any:
        key = ids.tobytes()
        if key not in self._kv:
            self._kv[key] = self._t.kv(ids)
        return self._kv[key]


def timed(fn: Any, repeats: int) -> tuple[float, list[float], list[Any]]:
    """(median seconds, all runs, the first and the last result)."""
    times, outs = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        if i in (0, repeats - 1):
            outs.append(out)
    return statistics.median(times), times, outs


def measure_rung(rung: str, target: Any, calib_target: Any, ids: Any, kv: Any, target_s: float,
                 args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import numpy as np
    import torch

    from speckv.coder.codec import Codec, CodecConfig, bf16_bits
    from speckv.predictor.calibrate import build_checkpoint
    from speckv.predictor.checkpoint import load_checkpoint
    from speckv.predictor.predict import Predictor

    layers = target.config.num_hidden_layers
    name = f"hybrid:{layers}" if rung == "target" else rung
    out = root / rung.replace(":", "-")
    t0 = time.perf_counter()
    pin = build_checkpoint(calib_target, args.calib, out, tokens=args.calib_tokens, derive_weights=True,
                           source="embedded", rung=name)
    build_s = time.perf_counter() - t0
    ck = load_checkpoint(out, pin=pin)
    pred = Predictor.from_checkpoint(ck, target)
    pred_s, pred_runs, (mu, *last) = timed(lambda: pred.mu(ids), args.repeats)
    other = last[-1] if last else Predictor.from_checkpoint(ck, target).mu(ids)  # the decoder's mu
    codec = Codec.from_predictor(pred, CodecConfig(coder=args.coder))
    t0 = time.perf_counter()
    records = list(codec.encode(kv, ids, mu))
    enc_s = time.perf_counter() - t0
    deterministic = torch.equal(other.view(torch.int16), mu.view(torch.int16))
    t0 = time.perf_counter()
    lossless = bool(np.array_equal(codec.decode(records, ids, other), bf16_bits(kv)))
    dec_s = time.perf_counter() - t0
    coded = sum(len(r) for r in records)
    n = int(kv.numel())
    exact_layers = sum(int(torch.equal(mu[i].view(torch.int16), kv[i].view(torch.int16))) for i in range(layers))
    return {"rung": rung, "checkpoint_rung": ck.rung.name, "pin": pin, "bits_per_scalar": 8 * coded / n,
            "coded_bytes": coded, "scalars": n, "lossless": lossless, "deterministic": deterministic,
            "predictor_s": pred_s, "predictor_runs_s": pred_runs, "target_s": target_s,
            "predictor_cost": pred_s / target_s, "nominal_cost": ck.rung.nominal_cost(layers),
            "layers_equal_to_target": exact_layers, "build_s": build_s, "encode_s": enc_s, "decode_s": dec_s}


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    title = (f"Predictor ladder, {meta['target']}: {meta['tokens']} tokens of {meta['text']}, "
             f"calibrated on {meta['calib_tokens']} tokens of {meta['calib']}; target prefill "
             f"{meta['target_s']:.2f} s (median of {meta['repeats']}), {meta['threads']} threads, CPU")
    head = ("| rung | bits/scalar | ratio vs BF16 | lossless | predictor s | predictor_cost (measured) "
            "| nominal cost (FP8 layer = 0.5) | layers = target KV |")
    lines = [title, "", head, "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rung']} | {r['bits_per_scalar']:.3f} | {16 / r['bits_per_scalar']:.2f}x | "
                     f"{r['lossless'] and r['deterministic']} | {r['predictor_s']:.2f} | {r['predictor_cost']:.3f} | "
                     f"{r['nominal_cost']:.3f} | {r['layers_equal_to_target']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rungs", nargs="+", default=DEFAULT_RUNGS)
    ap.add_argument("--text", type=Path, default=CORPUS / "tinyshakespeare.txt")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calib", type=Path, default=CORPUS / "wikitext2-valid.txt")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each model (median)")
    ap.add_argument("--coder", choices=("numpy", "native", "cuda", "auto"), default="auto")
    ap.add_argument("--json", type=Path, default=None, help="write the rows and settings here")
    args = ap.parse_args(argv)

    from speckv.cli.wait_policy import agreed_timer, use_sidecar_policy

    predictor_policy = use_sidecar_policy()  # NOTE: before torch loads; the target is timed under the engine's

    from speckv.predictor.calibrate import read_text
    from speckv.predictor.target import COMPUTE_THREADS, DEFAULT_TARGET, load_target

    target = load_target()
    ids = target.tokenize(read_text(args.text, chars=args.tokens * 16), args.tokens)
    timer, kv = agreed_timer(str(DEFAULT_TARGET), ids, target.kv(ids), lambda: target.kv(ids))
    with timer:  # its first prefill warms it up
        target_runs = [timer.time() for _ in range(args.repeats)]
    target_s = statistics.median(target_runs)
    meta = {"target": target.name, "text": args.text.name, "tokens": int(len(ids)), "calib": args.calib.name,
            "calib_tokens": args.calib_tokens, "target_s": target_s, "target_runs_s": target_runs,
            "repeats": args.repeats, "threads": COMPUTE_THREADS, "coder": args.coder,
            "predictor_policy": predictor_policy, "target_policy": timer.policy}
    print(f"target prefill: median {target_s:.2f} s of {[round(t, 2) for t in target_runs]}", file=sys.stderr)
    calib_target = CachingTarget(target)
    rows = []
    with tempfile.TemporaryDirectory(prefix="speckv-ladder-") as tmp:
        for rung in args.rungs:
            row = measure_rung(rung, target, calib_target, ids, kv, target_s, args, Path(tmp))
            print(f"{rung}: {row['bits_per_scalar']:.3f} bits/scalar, predictor {row['predictor_s']:.2f} s "
                  f"(cost {row['predictor_cost']:.3f}, nominal {row['nominal_cost']:.3f}), lossless "
                  f"{row['lossless']}, deterministic {row['deterministic']}", file=sys.stderr)
            rows.append(row)
            if args.json:  # partial results survive an interrupted run
                args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows, meta))
    return 0 if all(r["lossless"] and r["deterministic"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
