"""benchmarks/RESULTS.md: the residual-model ideas and the predictor ladder, in one run.

    .venv/bin/python benchmarks/results.py            # ~25 min on a 2-core CPU; writes benchmarks/RESULTS.md

Texts: the first 2048 tokens of tinyshakespeare, and WikiText-2 validation
tokens [6144, 8192), which no checkpoint calibrated on (calibration takes
tokens [0, 4096)). For every rung a checkpoint is built exactly as
``speckv predictor build --rung R --derive-weights`` builds it.

Bits/scalar are exact: per element, the rANS op's -log2(freq / 2^15) plus
the raw bits the model writes for it (``model.symbolize``'s sections), split
by K and V; each table's total is checked against the real codec's coded size
of the same stream (the difference is the container: headers, rANS states,
padding). Residual-model variants:

- seed: the published static mixture, mu as predicted (container model 1);
- A: the seed's sigma and mu, escape weight 1e-4 (the tuned tables);
- E: mu' = bf16(a mu + b) per channel and sigma refit, the seed's tables;
- A+E = tuned (container model 2, the default).

Predictor cost: target prefill, predictor and plain FP8 copy timed alternately
(median of ``--repeats``) on this machine; nominal cost counts an FP8 layer as
half a BF16 one (as on an FP8 tensor-core GPU; on a CPU the FP8 copy is
emulated in FP32 and costs about as much as the target).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # results_report.py sits next to this script
CORPUS = REPO.parent / "shared" / "corpus"
RUNGS = ["none", "fp8", "hybrid:2", "hybrid:3", "hybrid:4", "hybrid:6", "hybrid:8"]
IDEA_RUNGS = ("fp8", "hybrid:4")  # the ideas table: the FP8 copy and the shipped default rung
VARIANTS = ("seed", "A", "E", "A+E")
HELD_OUT = (6144, 8192)  # WikiText-2 validation tokens no checkpoint calibrated on


def _ladder():
    spec = importlib.util.spec_from_file_location("speckv_ladder", REPO / "benchmarks" / "ladder.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def variant_models(ck: Any) -> dict[str, Any]:
    """The four residual-model variants of a checkpoint (ResidualModel per name)."""
    from speckv.coder.residual import MODEL_SEED, MODEL_TUNED, ResidualModel, models_of

    m = models_of(ck)
    seed, tuned = m[MODEL_SEED], m[MODEL_TUNED]
    return {"seed": seed, "A": ResidualModel(MODEL_TUNED, tuned.tables, seed.log2_sigma),
            "E": ResidualModel(MODEL_TUNED, seed.tables, tuned.log2_sigma, tuned.mu_scale, tuned.mu_shift),
            "A+E": tuned}


def element_bits(fmt: Any, tables: Any, ctx: Any, x: np.ndarray) -> np.ndarray:
    """Exact bits of each element: its rANS op plus the raw bits the model writes for it."""
    from speckv.coder.model import bin_index, low_bits, magnitude, split, symbolize
    from speckv.coder.rans import PROB_BITS

    sym = symbolize(fmt, tables, ctx, x)
    g = tables.gauss
    bits = PROB_BITS - np.log2(g.freq[g.offset[ctx.t] + sym.j].astype(np.float64))
    radius = tables.radius[ctx.t]
    esc = sym.j == 2 * radius + 1
    mag = magnitude(bin_index(fmt, x, ctx.k)[0])
    zero = (mag == 0) & ~esc
    normal = ~(esc | zero)
    _, e, _ = split(fmt, x)
    raw = np.where(normal, np.maximum(low_bits(fmt, mag), 0), 0).astype(np.float64)
    raw += np.where(zero, fmt.mant + (ctx.k + fmt.bias - e), 0)  # mantissa + unary (delta zeros and a one)
    raw += np.where(esc, fmt.bits, 0)
    return bits + raw


def stream_bits(codec: Any, kv: Any, ids: np.ndarray, mu: Any) -> tuple[float, float, float]:
    """(K, V, total) bits/scalar of a whole stream under the codec's encode model."""
    from speckv.coder.plan import adapted_plan

    plan = codec._plan(kv, ids, mu)
    plan = adapted_plan(plan, codec.stream_header(plan.fmt.name == "bf16", plan.mu.shape, ids),  # format 4 shifts
                        codec.backend)
    layers = plan.mu.shape[0]
    ctx = codec._context(plan, slice(0, layers))
    per = element_bits(plan.fmt, plan.model.tables, ctx, plan.x.ravel()).reshape(plan.x.shape)
    k, v = per[:, 0].mean(), per[:, 1].mean()
    return float(k), float(v), float((k + v) / 2)


def coded_bits(codec: Any, kv: Any, ids: np.ndarray, mu: Any) -> float:
    """The real codec's bits/scalar, after a bit-exact round trip."""
    from speckv.coder.codec import Fp8KV, bf16_bits

    records = list(codec.encode(kv, ids, mu))
    back = codec.decode(records, ids, mu)
    same = (np.array_equal(back.codes, kv.codes) if isinstance(kv, Fp8KV)
            else np.array_equal(back, bf16_bits(kv)))
    if not same:
        raise AssertionError("round trip not bit-exact")
    return 8 * sum(len(r) for r in records) / (kv.codes.size if isinstance(kv, Fp8KV) else kv.numel())


def timings(target: Any, pred: Any, fp8_copy: Any, ids: np.ndarray, repeats: int) -> dict[str, float]:
    """Median seconds of the target, the rung's predictor and the plain FP8 copy, alternating."""
    runs: dict[str, list[float]] = {"target": [], "predictor": [], "fp8_copy": []}
    for _ in range(repeats):
        for name, fn in (("target", target.kv), ("predictor", pred.mu), ("fp8_copy", fp8_copy)):
            t0 = time.perf_counter()
            fn(ids)
            runs[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in runs.items()}


def measure(rung: str, env: dict[str, Any], args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from speckv.coder.codec import Codec, CodecConfig
    from speckv.predictor.calibrate import build_checkpoint
    from speckv.predictor.checkpoint import load_checkpoint
    from speckv.predictor.predict import Predictor

    target = env["target"]
    pin = build_checkpoint(env["calib_target"], args.calib, root / rung.replace(":", "-"), derive_weights=True,
                           source="embedded", rung=rung)
    ck = load_checkpoint(root / rung.replace(":", "-"), pin)
    pred = Predictor.from_checkpoint(ck, target)
    row: dict[str, Any] = {"rung": rung, "pin": pin, "nominal_cost": ck.rung.nominal_cost(env["layers"])}
    t = timings(target, pred, env["fp8_copy"], env["texts"]["tinyshakespeare"][0], args.repeats)
    row.update(predictor_cost=t["predictor"] / t["target"], fp8_copy_cost=t["fp8_copy"] / t["target"], **t)
    variants = VARIANTS if rung in IDEA_RUNGS else ("seed", "A+E")
    for text, (ids, kvs) in env["texts"].items():
        mu = pred.mu(ids)
        for dtype, kv in kvs.items():
            for name in variants:
                codec = Codec(ck.tables, ck.calib.sigma_log2_q, pin, config=CodecConfig(coder="numpy"),
                              models={2: variant_models(ck)[name]} if name != "seed" else None)
                row[f"{text}/{dtype}/{name}"] = stream_bits(codec, kv, ids, mu)
            numpy_codec = Codec.from_checkpoint(ck, CodecConfig(coder="numpy"))
            row[f"{text}/{dtype}/coded"] = coded_bits(numpy_codec, kv, ids, mu)
    print(f"{rung}: " + ", ".join(f"{k} {v[2] if isinstance(v, tuple) else v:.3f}" for k, v in row.items()
                                  if "/" in k), file=sys.stderr, flush=True)
    return row


def texts(target: Any, tokens: int) -> dict[str, tuple[np.ndarray, dict[str, Any]]]:
    from speckv.coder.codec import Fp8KV
    from speckv.predictor.calibrate import read_text
    from speckv.predictor.fp8 import kv_to_fp8

    shake = target.tokenize(read_text(CORPUS / "tinyshakespeare.txt", chars=tokens * 16), tokens)
    wiki = target.tokenize(read_text(CORPUS / "wikitext2-valid.txt", chars=HELD_OUT[1] * 16),
                           HELD_OUT[1])[HELD_OUT[0]:HELD_OUT[0] + tokens]
    out = {}
    for name, ids in (("tinyshakespeare", shake), ("wikitext-held-out", wiki)):
        kv = target.kv(ids)
        q, s = kv_to_fp8(kv)
        out[name] = (ids, {"bf16": kv, "fp8": Fp8KV(q.numpy(), s.numpy())})
    return out


def coder_speed(tokens: int) -> str:
    """The coder-speed section: ``benchmarks/coder_bench.py`` (every CPU coder, both dtypes)."""
    import coder_bench  # noqa: E402 -- next to this script

    return coder_bench.section(coder_bench.measure(tokens, None), tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rungs", nargs="+", default=RUNGS)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calib", type=Path, default=CORPUS / "wikitext2-valid.txt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    args = ap.parse_args(argv)

    from results_report import render  # noqa: E402 -- next to this script

    from speckv.cli.bench import fp8_copy_forward
    from speckv.predictor.target import load_target

    target = load_target()
    env = {"target": target, "calib_target": _ladder().CachingTarget(target), "layers": target.config.num_hidden_layers,
           "fp8_copy": fp8_copy_forward(target), "texts": texts(target, args.tokens)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="speckv-results-") as tmp:
        for rung in args.rungs:
            rows.append(measure(rung, env, args, Path(tmp)))
    speed = coder_speed(args.tokens)
    args.out.write_text(render(rows, speed, args, IDEA_RUNGS, VARIANTS))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
