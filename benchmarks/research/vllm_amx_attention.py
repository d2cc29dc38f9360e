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

Prints the share of output elements each model reproduces, per ISA and cache dtype.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    torch._C._cpu._init_amx()  # NOTE: the process must ask the kernel for AMX tile state (vLLM's workers do)
    torch.manual_seed(0)
    t = args.tokens
    q = (torch.randn(t, HEADS, DIM) * 2).to(torch.bfloat16)
    k = (torch.randn(t, KV_HEADS, DIM) * 3).to(torch.bfloat16)
    v = torch.randn(t, KV_HEADS, DIM).to(torch.bfloat16)
    print(f"{t} tokens; share of output elements (BF16) each model reproduces bit for bit")
    print("isa | cache | fp32 | p_bf16 | p_bf16_flush")
    for isa in ("vec", "amx"):
        for cache in ("auto", "fp8_e4m3"):
            kk, vv = (k, v) if cache == "auto" else (e4m3_toward_zero(k), e4m3_toward_zero(v))
            out = attention(q, k, v, isa, cache)
            shares = [(out == model(q, kk, vv, pb, fl)).float().mean().item()
                      for pb, fl in ((False, False), (True, False), (True, True))]
            print(f"{isa} | {'bf16' if cache == 'auto' else 'fp8'} | " + " | ".join(f"{s:.3f}" for s in shares))


if __name__ == "__main__":
    main()
