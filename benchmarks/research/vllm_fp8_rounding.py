"""How vLLM's CPU cache writer rounds BF16 K/V to FP8 e4m3 (run in vLLM's environment):

    .venv-vllm/bin/python benchmarks/research/vllm_fp8_rounding.py

It writes seeded random keys and values (scale 1.0) through ``ops.cpu_attn_reshape_and_cache``
(the ``vec`` kernel, the one the CPU backend picks here), reads the codes back with the
connector's learned paged layout, and compares them with torch's round-to-nearest e4m3 and
with round toward zero. Prints the share of codes each rounding explains.
"""
from __future__ import annotations

import torch
from vllm import _custom_ops as ops

from speckv.client.paged import PagedLayout

BLOCK, DIM, HEADS = 32, 64, 1


def write(k, v, kc, vc, slots) -> None:
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="fp8_e4m3")


def main() -> None:
    layout = PagedLayout.learn(write, BLOCK, DIM, torch.uint8)
    torch.manual_seed(0)
    x = (torch.randn(BLOCK, HEADS, DIM) * 3).to(torch.bfloat16)
    cache = torch.zeros(1, HEADS, BLOCK, 2 * DIM, dtype=torch.uint8)
    kc, vc = cache.view(1, HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
    write(x, x.clone(), kc, vc, torch.arange(BLOCK))
    got = layout.gather(cache, [0], 0, BLOCK)[0].flatten()  # the keys, (heads, tokens, dim)
    xf = x.permute(1, 0, 2).float().flatten()
    nearest = xf.to(torch.float8_e4m3fn)
    over = nearest.float().abs() > xf.abs()
    zero = nearest.view(torch.uint8).clone()
    zero[over & ((zero & 0x7F) > 0)] -= 1
    n = got.numel()
    print(f"{n} codes: round to nearest explains {(got == nearest.view(torch.uint8)).sum().item() / n:.3f}, "
          f"round toward zero {(got == zero).sum().item() / n:.3f}")


if __name__ == "__main__":
    main()
