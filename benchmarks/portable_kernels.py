"""The portable rung's fused native kernels against the paths they replace, on the embedded model.

Three figures, each the median of ``--repeats`` alternating runs, each pair's results compared bit
for bit (``equal``):

- ``forward``: the whole rung on ``--tokens`` tokens of tinyshakespeare, fused kernels (the
  default) against the per-stage native code with torch's int8 products (``integer.FUSED`` off);
- ``linear``: one layer's gate_up linear with its norm (the layer's real weights, the real hidden
  state entering it), the fused kernel (plain packed layout, no SiLU) against the unfused path;
- ``attention``: that layer's real q, k, v, the one-call kernel on 1 and on 2 threads against the
  tiled torch products with the native exp stage.

    .venv/bin/python benchmarks/portable_kernels.py --tokens 2048 --layer 5 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

TEXT = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "tinyshakespeare.txt"


def timed(fn: Callable[[], Any], flags: dict[str, Any]) -> tuple[float, Any]:
    from speckv.predictor import integer as ix

    old = {k: getattr(ix, k) for k in flags}
    for k, v in flags.items():
        setattr(ix, k, v)
    try:
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out
    finally:
        for k, v in old.items():
            setattr(ix, k, v)


def compare(fns: dict[str, tuple[Callable[[], Any], dict[str, Any]]], repeats: int) -> dict[str, Any]:
    """Median seconds of each (fn, integer flags), run alternately; whether all results are equal."""
    import torch

    times: dict[str, list[float]] = {k: [] for k in fns}
    outs: dict[str, Any] = {}
    for _ in range(repeats):
        for name, (fn, flags) in fns.items():
            t, outs[name] = timed(fn, flags)
            times[name].append(t)
    first = next(iter(outs.values()))
    equal = all(torch.equal(o.view(torch.int16) if o.dtype == torch.bfloat16 else o,
                            first.view(torch.int16) if first.dtype == torch.bfloat16 else first)
                for o in outs.values())
    return {"s": {k: round(statistics.median(v), 4) for k, v in times.items()}, "equal": equal}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layer", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from speckv.predictor import integer as ix
    from speckv.predictor import portable
    from speckv.predictor.ladder import Rung
    from speckv.predictor.predict import rung_state
    from speckv.predictor.target import load_target

    if not ix.fused_hardware():
        print("this CPU has no AVX-512 VNNI: the fused kernels do not run here", file=sys.stderr)
        return 2
    target = load_target()
    model = portable.build_portable_model(target.config, rung_state(target.state, Rung("portable"), target.config))
    ids = target.tokenize(Path(a.text).read_text(encoding="utf-8", errors="replace"), a.tokens)
    seen: dict[str, Any] = {}
    real_attention, real_norm_linear = portable.attention, ix.norm_linear
    calls = {"attention": 0, "norm_linear": 0}

    def spy_attention(q, k, v, table, exact=False, *rest):  # type: ignore[no-untyped-def]
        if calls["attention"] == a.layer:
            seen["qkv"] = (q.clone(), k.clone(), v.contiguous().clone(), table)
        calls["attention"] += 1
        return real_attention(q, k, v, table, exact, *rest)

    def spy_norm_linear(x, *args, **kw):  # type: ignore[no-untyped-def]
        if calls["norm_linear"] == 2 * a.layer + 1:  # the layer's second: post-attention norm, gate_up
            seen["h"] = x.clone()
        calls["norm_linear"] += 1
        return real_norm_linear(x, *args, **kw)

    portable.attention, ix.norm_linear = spy_attention, spy_norm_linear
    try:
        portable.portable_kv(model, ids)
    finally:
        portable.attention, ix.norm_linear = real_attention, real_norm_linear
    p = f"model.layers.{a.layer}."
    w, ws = model.get(p + "gate_up.w8"), model.get(p + "gate_up.ws")
    norm = model.get(p + "post_attention_layernorm.weight")
    packed, eps, h = ix.wide_pack(w), float(target.config.rms_norm_eps), seen["h"]
    q, k, v, table = seen["qkv"]
    report = {
        "tokens": int(len(ids)), "layer": a.layer, "repeats": a.repeats,
        "forward": compare({"fused": (lambda: portable.portable_kv(model, ids), {}),
                            "unfused": (lambda: portable.portable_kv(model, ids), {"FUSED": False})}, a.repeats),
        "linear": compare({"fused": (lambda: ix.norm_linear(h, norm, eps, None, ws, False, packed), {}),
                           "unfused": (lambda: ix.norm_linear(h, norm, eps, w, ws), {})}, a.repeats),
        "attention": compare({"fused, 2 threads": (lambda: portable.attention(q, k, v, table), {}),
                              "fused, 1 thread": (lambda: portable.attention(q, k, v, table), {"FUSED_THREADS": 1}),
                              "tiled": (lambda: portable.attention(q, k, v, table), {"FUSED": False})}, a.repeats),
    }
    print(json.dumps(report) if a.json else json.dumps(report, indent=2))
    return 0 if all(report[k]["equal"] for k in ("forward", "linear", "attention")) else 1


if __name__ == "__main__":
    sys.exit(main())
