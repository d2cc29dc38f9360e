"""Why vLLM's FP8 cache compresses worse on AMX CPUs: its attention numerics, op by op
(issue 17; run in vLLM's environment, on a CPU with AMX):

    .venv-vllm/bin/python benchmarks/research/vllm_amx_attention.py [--tokens 256]

Seeded random queries, keys and values (SmolLM2's geometry: 9 query heads, 3 KV heads,
head_dim 64, blocks of 128) go through vLLM's own cache writer and attention op
(``ops.cpu_attn_reshape_and_cache``, ``ops.cpu_attention_with_kv_cache``) with each kernel
ISA (``vec``, ``amx``) and cache dtype (BF16, FP8 e4m3 at scale 1.0). Each output is compared
bit for bit (BF16) with three models computed here over the values the cache holds:

- ``fp32``: attention in FP32 (what speckv's ``fp8_attention`` predictor assumes);
- ``p_bf16``: the same, with softmax weights exp(s - rowmax) rounded to BF16 before P @ V and
  their sum taken unrounded;
- ``p_bf16_flush``: ``p_bf16`` with every product p * v below 2^-6 in magnitude dropped, and
  e4m3 subnormals read as zero. The hypothesis: the AMX FP8 path turns codes into BF16
  without rescaling (value * 2^-120) and AMX flushes denormal inputs and results, which drops
  any product below 2^-126 * 2^120.

Prints the share of output elements each model reproduces, per ISA and cache dtype, and for an FP8
cache the share speckv's replay of the amx kernel reproduces (``speckv.predictor.amx_fp8``: the
products on AMX tiles in the kernel's operand order, with its own softmax, and with torch's).

``--crafted``: hand-made inputs that show where the ``amx`` kernel flushes with an FP8 cache.
Values are e4m3-exact, so 0.125 - 0.1171875 = 2^-7 is a partial sum below the flush line.
- P @ V with all scores 0 (so every weight is 1): V values along the keys of one dim, read
  back from the last query row (times its key count).
- Q @ K with one nonzero key: q = 1 in every dim, and 0.125 / -0.1171875 at chosen dims of the
  key. A flushed partial sum shows as a weight of 0.5 instead of 0.5039.
"""
from __future__ import annotations

import argparse
import math

import torch
from vllm import _custom_ops as ops

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 128
FLUSH = 2.0 ** -6  # 2^-126 (FP32's smallest normal) in units of the unscaled dequant, 2^-120


def attention(q, k, v, isa: str, cache_dtype: str) -> torch.Tensor:
    """vLLM's CPU attention (causal prefill of one request) over K/V written by its own writer."""
    t = q.shape[0]
    nb = (t + BLOCK - 1) // BLOCK
    cache = torch.zeros(nb, KV_HEADS, BLOCK, 2 * DIM, dtype=torch.uint8 if cache_dtype != "auto" else torch.bfloat16)
    kc, vc = cache.view(nb, KV_HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(t), isa, 1.0, 1.0, cache_dtype)
    qsl, lens = torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(1, HEADS, KV_HEADS, DIM, lens, torch.bfloat16, qsl, True, -1, isa,
                                               False, None, cache_dtype)
    out = torch.empty(t, HEADS, DIM, dtype=torch.bfloat16)
    ops.cpu_attention_with_kv_cache(q, kc, vc, out, qsl, lens, 1 / math.sqrt(DIM), True, None, -1,
                                    torch.arange(nb, dtype=torch.int32)[None], 0.0, meta, None, None, 1.0, 1.0,
                                    cache_dtype)
    return out


def e4m3_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """The values vLLM's CPU writer stores at scale 1.0 (round toward zero)."""
    f = x.float()
    codes = f.to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(codes.view(torch.float8_e4m3fn).float().abs() > f.abs(), codes - 1, codes)
    return codes.view(torch.float8_e4m3fn).float()


def model(q, k, v, p_bf16: bool, flush: bool) -> torch.Tensor:
    """Causal attention over the cache's values k, v (tokens, kv_heads, dim) as the docstring's models."""
    t, group = q.shape[0], HEADS // KV_HEADS
    k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))  # (tokens, heads, dim)
    if flush:
        k, v = (torch.where(x.abs() < FLUSH, 0.0, x) for x in (k, v))
    s = torch.einsum("thd,uhd->htu", q.float(), k) / math.sqrt(DIM)  # (heads, tokens, keys)
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    p = torch.exp(s - s.max(-1, keepdim=True).values)
    total = p.sum(-1, keepdim=True)
    if p_bf16:
        p = p.to(torch.bfloat16).float()
    if flush:
        pv = p[..., None] * v.permute(1, 0, 2)[:, None]  # (heads, tokens, keys, dim)
        o = torch.where(pv.abs() < FLUSH, 0.0, pv).sum(-2)
    else:
        o = torch.einsum("htu,uhd->htd", p, v)
    return (o / total).permute(1, 0, 2).to(torch.bfloat16)


def crafted() -> None:
    """The ``--crafted`` probes of the module docstring (amx and vec, FP8 cache)."""
    small, minus = 0.125, -0.1171875  # their sum, 2^-7, is below the flush line (2^-6)
    print("P @ V, every weight 1: value sums per kernel (exact sum in brackets)")
    for vals in ([small, minus, 0.5, 0.0], [small, 0.0, minus, 0.5], [0.5, minus, -0.375, 0.0],
                 [small, minus] + [0.0] * 30 + [0.5, 0.0]):
        t = len(vals)
        q, k = torch.zeros(t, HEADS, DIM, dtype=torch.bfloat16), torch.zeros(t, KV_HEADS, DIM, dtype=torch.bfloat16)
        v = torch.zeros(t, KV_HEADS, DIM)
        v[:, :, 0] = torch.tensor(vals)[:, None]
        got = {isa: attention(q, k, v.to(torch.bfloat16), isa, "fp8_e4m3")[-1, 0, 0].item() * t
               for isa in ("amx", "vec")}
        shown = vals if t <= 4 else f"{vals[:2]} + 30 zeros + {vals[-2:]}"
        print(f"  {shown}: amx {got['amx']:.5f}, vec {got['vec']:.5f} [{sum(vals):.5f}]")
    print("one product per score (q in dim 0, key 0 = 4.0 there): weights of the last row, two keys")
    for qv in (1.1015625, 1.0625, 0.3, 2.7):
        q = torch.zeros(2, HEADS, DIM)
        q[:, :, 0] = qv
        k = torch.zeros(2, KV_HEADS, DIM)
        k[0, :, 0] = 4.0
        v = torch.zeros(2, KV_HEADS, DIM)
        v[0, :, 0] = v[1, :, 1] = 1.0
        args = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
        got = {isa: attention(*args, isa, "fp8_e4m3")[1, 0, :2].tolist() for isa in ("amx", "vec")}
        want = {name: model(*args, pb, False)[1, 0, :2].tolist() for name, pb in (("fp32", False), ("p_bf16", True))}
        print(f"  q {qv}: amx {got['amx']} (p_bf16 model {want['p_bf16']}), vec {got['vec']} (fp32 {want['fp32']})")
    print("Q @ K, q = 1: key dims (a, b) holding 0.125 and -0.1171875; the first key's weight")
    for label, pairs in (("(2i, 2i+1), 16 pairs", [(2 * i, 2 * i + 1) for i in range(16)]),
                         ("(4i, 4i+2), 16 pairs", [(4 * i, 4 * i + 2) for i in range(16)]),
                         ("(i, i+32), 16 pairs", [(i, i + 32) for i in range(16)])):
        q = torch.ones(2, HEADS, DIM, dtype=torch.bfloat16)
        k = torch.zeros(2, KV_HEADS, DIM)
        for a, b in pairs:
            k[0, :, a], k[0, :, b] = small, minus
        v = torch.zeros(2, KV_HEADS, DIM)
        v[0, :, 0] = v[1, :, 1] = 1.0
        w = {isa: attention(q, k.to(torch.bfloat16), v.to(torch.bfloat16), isa, "fp8_e4m3")[1, 0, 0].item()
             for isa in ("amx", "vec")}
        print(f"  {label}: amx {w['amx']:.5f}, vec {w['vec']:.5f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--crafted", action="store_true", help="the hand-made flush probes instead")
    args = ap.parse_args()
    torch._C._cpu._init_amx()  # NOTE: the process must ask the kernel for AMX tile state (vLLM's workers do)
    if args.crafted:
        crafted()
        return
    torch.manual_seed(0)
    t = args.tokens
    q = (torch.randn(t, HEADS, DIM) * 2).to(torch.bfloat16)
    k = (torch.randn(t, KV_HEADS, DIM) * 3).to(torch.bfloat16)
    v = torch.randn(t, KV_HEADS, DIM).to(torch.bfloat16)
    print(f"{t} tokens; share of output elements (BF16) each model reproduces bit for bit")
    print("isa | cache | fp32 | p_bf16 | p_bf16_flush | speckv amx replay | its reference")
    for isa in ("vec", "amx"):
        for cache in ("auto", "fp8_e4m3"):
            kk, vv = (k, v) if cache == "auto" else (e4m3_toward_zero(k), e4m3_toward_zero(v))
            out = attention(q, k, v, isa, cache)
            shares = [(out == model(q, kk, vv, pb, fl)).float().mean().item()
                      for pb, fl in ((False, False), (True, False), (True, True))]
            shares += [(out == r).float().mean().item() for r in replays(q, kk, vv)] if cache != "auto" else []
            print(f"{isa} | {'bf16' if cache == 'auto' else 'fp8'} | " + " | ".join(f"{s:.4f}" for s in shares))


def replays(q, k, v) -> list[torch.Tensor]:
    """speckv's replay of the amx kernel (``speckv.predictor.amx_fp8``: one native call, and its
    reference with torch's softmax) over the cache's values k, v (tokens, kv_heads, dim), scale 1."""
    from speckv.kv import Fp8Attention
    from speckv.predictor import amx_fp8

    fa = Fp8Attention((1.0,), (1.0,), toward_zero=True, amx=True)
    args = (q.float().transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), fa, 0, 1 / math.sqrt(DIM))
    return [amx_fp8.attention(*args), amx_fp8.reference(*args)]  # (tokens, heads, dim)


if __name__ == "__main__":
    main()
