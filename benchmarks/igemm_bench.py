"""The W8A8 rungs' int8 products on this CPU: torch's ``_int_mm``, the native product and FP32 GEMM.

For each linear shape of the embedded SmolLM2-135M at ``--tokens`` rows (fused q/k/v, o, fused
gate/up, down), median seconds of ``--repeats`` and GMAC/s of: ``torch._int_mm`` (oneDNN; a
reference loop on CPUs without VNNI), the native product ``spk_igemm.h`` (what
``speckv.predictor.products.int_mm`` runs where the CPU has no VNNI), and ``torch.mm`` in FP32
on the same shapes, its operands converted to float32 once before timing (the FP8 copy's
emulated product, whose weights are float32 already) as the peer. Every product is checked
against the int64 reference first (exact: the same integers). Also prints which route ``int_mm``
takes here (``"route"``) and the CPU's int8 flags.

The whole W8A8 linear as a pass runs it (``w8a8.linear``: product and dequantisation; float32
out for qkv and gate_up, BF16 with the residual add for o and down): ``linear_two_pass``
(``int_mm``, then the native dequantisation) and, where AMX int8 is granted, ``linear_amx``
(``spk_w8a8_amx.h``: both in one pass), checked bit for bit against each other first.

    .venv/bin/python benchmarks/igemm_bench.py --tokens 2048 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from attention_bench import median_ms  # benchmarks/ (the script's own folder)

HIDDEN, INTER, KV = 576, 1536, 192  # SmolLM2-135M: hidden, MLP width, kv heads * head_dim
SHAPES = {"qkv": (HIDDEN + 2 * KV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER)}  # (out, in)


def median_s(fn: Callable[[], Any], repeats: int) -> float:
    return median_ms(fn, repeats) / 1e3


def shape_row(tokens: int, n: int, k: int, threads: int, repeats: int, nat: Any, g: Any) -> dict[str, Any]:
    """One linear's products (checked against int64 first): seconds and GMAC/s per route."""
    import torch

    a = torch.randint(-127, 128, (tokens, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    ref = torch.mm(a.long(), w.long().t()).to(torch.int32)
    out = torch.empty((tokens, n), dtype=torch.int32)
    af, wf = a.float(), w.float()  # NOTE: converted once, outside the timer: the peer is the GEMM alone
    runs: dict[str, Callable[[], Any]] = {"torch_int_mm": lambda: torch._int_mm(a, w.t()),
                                          "fp32_mm": lambda: torch.mm(af, wf.t())}
    assert torch.equal(torch._int_mm(a, w.t()), ref)
    if nat is not None:
        runs["native"] = lambda: nat.igemm(a.numpy(), w.numpy(), out.numpy(), tokens, n, k, threads, False)
        runs["native"]()
        assert torch.equal(out, ref)
    runs.update(linear_runs(a, w, g))
    row = {}
    for key, fn in runs.items():
        sec = median_s(fn, repeats)
        row[key] = {"s": sec, "gmac_s": tokens * n * k / sec / 1e9}
    return row


def linear_runs(a: Any, w: Any, g: Any) -> dict[str, Callable[[], Any]]:
    """``w8a8.linear`` of int8 rows ``a`` by weights ``w``: the two-pass route and, where it runs here,
    the AMX one (their bits compared first). BF16 out with a residual where the pass adds one (n = hidden)."""
    import torch

    from speckv.predictor import w8a8

    xs, ws = torch.rand(a.shape[0], generator=g) * 1e-2, torch.rand(w.shape[0], generator=g) * 1e-2
    add = torch.randn(a.shape[0], w.shape[0], generator=g).to(torch.bfloat16) if w.shape[0] == HIDDEN else None

    def route(amx: bool) -> Callable[[], Any]:
        scratch: dict = {}  # NOTE: buffers reused across calls, as a pass reuses them (fresh ones page-fault)

        def run() -> Any:
            w8a8.NATIVE_AMX = amx
            try:
                return w8a8.linear(a, xs, w, ws, add=add, scratch=scratch, name="y")
            finally:
                w8a8.NATIVE_AMX = True
        return run

    runs = {"linear_two_pass": route(False)}
    if w8a8._amx_fits(w8a8._native(), a.shape[1], w.shape[0]):
        bits = lambda t: t.contiguous().view(torch.int16).clone()  # noqa: E731
        assert torch.equal(bits(route(True)()), bits(route(False)()))
        runs["linear_amx"] = route(True)
    return runs


def measure(tokens: int, threads: int, repeats: int) -> dict[str, Any]:
    import torch

    from speckv.predictor import products

    nat = products.native_with("igemm")
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    rows = {name: shape_row(tokens, n, k, threads, repeats, nat, g) for name, (n, k) in SHAPES.items()}
    total = {key: sum(r[key]["s"] for r in rows.values()) for key in next(iter(rows.values()))}
    return {"tokens": tokens, "threads": threads, "shapes": rows, "total_s": total,
            "native_vs_torch_int_mm": total["torch_int_mm"] / total["native"] if "native" in total else None,
            "linear_amx_vs_two_pass": total["linear_two_pass"] / total["linear_amx"] if "linear_amx" in total else None,
            "native_vs_fp32": total["fp32_mm"] / total["native"] if "native" in total else None,
            "route": "native" if products._native_int_mm() is not None else "torch",
            "cpu_int8_flags": sorted(products._cpu_flags() & {"avx2", "avx512_vnni", "avx_vnni", "amx_int8"})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = measure(args.tokens, args.threads, args.repeats)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{args.tokens} rows, {args.threads} threads, route {res['route']}, flags {res['cpu_int8_flags']}")
    for name, row in res["shapes"].items():
        cells = (f"{k} {v['s'] * 1e3:7.1f} ms ({v['gmac_s']:5.1f} GMAC/s)" for k, v in row.items())
        print(f"  {name:8s} " + "  ".join(cells))
    print(f"  one layer: native {res['native_vs_torch_int_mm']:.1f}x torch._int_mm, "
          f"{res['native_vs_fp32']:.2f}x FP32 mm")
    if res["linear_amx_vs_two_pass"] is not None:
        print(f"  one layer's linears: AMX {res['linear_amx_vs_two_pass']:.2f}x the two-pass route")
    return 0


if __name__ == "__main__":
    sys.exit(main())
