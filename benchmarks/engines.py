"""Every rung on every engine: bits/scalar when the KV comes from other engines' kernels (issue 17).

For each rung a checkpoint is built exactly as ``speckv predictor build --rung R --derive-weights``
builds it (the shipped rung: the shipped checkpoint), mu is computed once by the sidecars' own
predictor, and the real codec codes the KV of each engine stand-in of ``speckv.predictor.engines``
(sdpa = same kernels, eager, fp32, bf16, threads1, avx2, batch2, fp8cache), BF16 and FP8, each
stream decoded and compared bit for bit. Per rung it reports the worst engine with a BF16 cache,
and the worst excess over the fp8 rung (the published method) on the same KV: the issue's bar is
0.05 bits. fp8cache (attention reads an FP8 cache, its codes at its static scales, rounded as
``--fp8-toward-zero`` says) is reported in its own column, under plain mu or (``--fp8-attention``)
the mu told how its attention reads its cache.

    .venv/bin/python benchmarks/engines.py --json /tmp/engines.json   # ~15 min on a 2-core CPU

Bits are deterministic (no timings), so a busy machine changes only how long it takes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # ladder.py sits next to this script
CORPUS = REPO.parent / "shared" / "corpus"
DEFAULT_RUNGS = ["fp8", "hybrid:4", "w8a8", "w8a8:4", "w8a8x:4", "portable"]
REFERENCE = "fp8"  # the published method's rung: every rung is held to it on the same KV
DTYPES = ("bf16", "fp8")


def checkpoint(rung: str, target: Any, calib_target: Any, root: Path, args: argparse.Namespace) -> Any:
    """The shipped checkpoint for the shipped rung, else one built like `speckv predictor build`."""
    from speckv.predictor.calibrate import build_checkpoint
    from speckv.predictor.checkpoint import load_checkpoint
    from speckv.predictor.store import SHIPPED_RUNG, default_checkpoint_dir

    if rung == SHIPPED_RUNG:
        return load_checkpoint(default_checkpoint_dir())
    out = root / rung.replace(":", "-")
    pin = build_checkpoint(calib_target, args.calib, out, tokens=args.calib_tokens, derive_weights=True,
                           source="embedded", rung=rung)
    return load_checkpoint(out, pin=pin)


def coded_bits(codec: Any, kv: Any, ids: Any, mu: Any, dtype: str, fp8_toward_zero: bool = False,
               fp8_cache: Any = None) -> float:
    """Wire bits per scalar of the real codec's stream, after a bit-exact round trip (``fp8_cache``:
    the FP8-cache engine's Fp8Attention, whose static scales its codes are at)."""
    import numpy as np

    from speckv.coder.codec import Fp8KV, bf16_bits
    from speckv.predictor.engines import fp8_cache_codes
    from speckv.predictor.fp8 import kv_to_fp8

    if dtype == "fp8" and fp8_cache is not None:
        x: Any = fp8_cache_codes(kv, fp8_cache)
    elif dtype == "fp8":
        q, s = kv_to_fp8(kv, toward_zero=fp8_toward_zero)
        x = Fp8KV(q.numpy(), s.numpy())
    else:
        x = bf16_bits(kv)
    records = list(codec.encode(x, ids, mu))
    back = codec.decode(records, ids, mu)
    same = (np.array_equal(back.codes, x.codes) and np.array_equal(back.scales.view(np.uint32),
                                                                  x.scales.view(np.uint32))
            if dtype == "fp8" else np.array_equal(back, x))
    if not same:
        raise AssertionError(f"{dtype} round trip is not bit-exact")
    return 8 * sum(len(r) for r in records) / int(kv.numel())


def judge(rows: list[dict[str, Any]], engines: list[str]) -> None:
    """Per row: the worst engine per dtype, and the worst excess over the reference rung, over the
    engines with a BF16 cache (``fp8cache`` is reported on its own: its BF16 KV is FP8-rounded)."""
    ref = next((r for r in rows if r["rung"] == REFERENCE), None)
    judged = [e for e in engines if e != "fp8cache"] or engines
    for r in rows:
        for dt in DTYPES:
            bits = {e: r["bits"][f"{dt}/{e}"] for e in judged}
            r[f"worst_{dt}"] = max(bits.values())
            r[f"worst_{dt}_engine"] = max(bits, key=bits.__getitem__)
            if ref is not None:
                r[f"excess_{dt}"] = max(bits[e] - ref["bits"][f"{dt}/{e}"] for e in judged)


def table(rows: list[dict[str, Any]], engines: list[str], meta: dict[str, Any]) -> str:
    head = "| rung | " + " | ".join(f"BF16 {e}" for e in engines) + " | BF16 worst | FP8 sdpa | FP8 worst | " \
           f"worst excess over {REFERENCE}, BF16 / FP8 |"
    lines = [f"{meta['tokens']} tokens of {meta['text']}; engines' differing scalars (BF16): " +
             ", ".join(f"{e} {meta['differ'][e]:.3f}" for e in engines), "", head,
             "|---|" + "---:|" * (len(engines) + 4)]
    for r in rows:
        cells = [f"{r['bits'][f'bf16/{e}']:.3f}" for e in engines]
        excess = f"{r['excess_bf16']:+.3f} / {r['excess_fp8']:+.3f}" if "excess_bf16" in r else "-"
        lines.append(f"| {r['rung']} | " + " | ".join(cells) +
                     f" | {r['worst_bf16']:.3f} ({r['worst_bf16_engine']}) | {r['bits']['fp8/sdpa']:.3f} | "
                     f"{r['worst_fp8']:.3f} ({r['worst_fp8_engine']}) | {excess} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rungs", nargs="+", default=DEFAULT_RUNGS)
    ap.add_argument("--engines", nargs="+", default=None, help="default: every engine")
    ap.add_argument("--text", type=Path, default=CORPUS / "tinyshakespeare.txt")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calib", type=Path, default=CORPUS / "wikitext2-valid.txt")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--json", type=Path, default=None, help="write the rows and settings here")
    ap.add_argument("--fp8-attention", action="store_true",
                    help="code the fp8cache engine's KV under mu told how its attention reads its cache "
                         "(SubmitHeader.fp8_attention), not plain mu")
    ap.add_argument("--fp8-toward-zero", action="store_true",
                    help="FP8 codes rounded toward zero (vLLM's CPU cache writer) instead of to nearest")
    args = ap.parse_args(argv)

    from ladder import CachingTarget

    from speckv.coder.codec import Codec, CodecConfig
    from speckv.predictor.calibrate import read_text
    from speckv.predictor.engines import ENGINES, differing_fraction, engine_kv, fp8_cache_attention, fp8_cache_kv
    from speckv.predictor.predict import Predictor
    from speckv.predictor.target import load_target

    engines = list(args.engines or ENGINES)
    target = load_target()
    ids = target.tokenize(read_text(args.text, chars=args.tokens * 16), args.tokens)
    same = target.kv(ids)
    engine_fa = fp8_cache_attention(same, toward_zero=args.fp8_toward_zero)  # the fp8cache engine: scales, rounding
    fa = engine_fa if args.fp8_attention else None
    kvs = {e: (same if e == "sdpa" else fp8_cache_kv(target, ids, engine_fa) if e == "fp8cache"
               else engine_kv(target, ids, e)) for e in engines}
    meta = {"target": target.name, "text": args.text.name, "tokens": int(len(ids)), "engines": engines,
            "fp8_rounding": "toward zero" if args.fp8_toward_zero else "nearest",
            "fp8cache_mu": "fp8_attention" if args.fp8_attention else "plain",
            "differ": {e: differing_fraction(kv, same) for e, kv in kvs.items()}}
    print("differing scalars:", meta["differ"], file=sys.stderr)
    rows: list[dict[str, Any]] = []
    calib_target = CachingTarget(target)
    with tempfile.TemporaryDirectory(prefix="speckv-engines-") as tmp:
        for rung in args.rungs:
            ck = checkpoint(rung, target, calib_target, Path(tmp), args)
            pred = Predictor.from_checkpoint(ck, target)
            mu = pred.mu(ids)
            # the fp8cache engine's KV under the mu told how its attention reads its cache
            mus = {e: pred.mu(ids, fp8_attention=fa) if e == "fp8cache" and fa is not None else mu for e in engines}
            codec = Codec.from_predictor(pred, CodecConfig())
            bits = {f"{dt}/{e}": coded_bits(codec, kvs[e], ids, mus[e], dt, args.fp8_toward_zero,
                                            engine_fa if e == "fp8cache" else None)
                    for e in engines for dt in DTYPES}
            rows.append({"rung": rung, "pin": ck.pin, "bits": bits})
            print(rung, {k: round(v, 3) for k, v in bits.items()}, file=sys.stderr, flush=True)
            if args.json:  # partial results survive an interrupted run
                args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    judge(rows, engines)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows, engines, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
