"""Causal attention in int8 for the W8A8 rungs with integer attention (``w8a8i``, ``w8a8i:k``).

SDPA in float32 is half of a W8A8 forward on a CPU (``benchmarks/RESULTS.md``); here both of
attention's products are int8 x int8 with exact int32 sums (AVX-512 VNNI), and every float step is
one IEEE float32 operation on one element, so the native kernel (``coder/kernels/spk_attn.h``) and
the torch reference below give the same bits. Per query head h (kv head h // group), token i, keys
j <= i::

    q8, qs = quantise(q_i); k8, ks = quantise(k_j); v8, vs = quantise(v_j)   int8 per token: amax / 127
    x_ij  = (float(q8_i . k8_j) * (qs_i * rsd)) * ks_j                      rsd = float32(log2(e) / sqrt(D))
    e_ij  = exp2_det(x_ij - max_j x_ij)                                     scores in log2 units
    den_i = sum_j round(e_ij * 2^DEN_BITS)                                  int64: exact in any order
    per block of KEY_BLOCK keys, unless its best x is SKIP below the row's (then nothing: 2^-22):
        w = e * vs, bm = max w, u = round(w * (255 / bm))                   uint8
        out_i += (bm / 255) * float(u . v8)                                 int32 sums, blocks in order
    o_i   = bf16(out_i / (float(den_i) * 2^-DEN_BITS))

V's per-token scale rides in the softmax weights (w = e * vs), so no scale spans tokens and a
token's output reads only the tokens before it. Quantising q, k and v this way costs +0.03-0.04
bits/scalar on tinyshakespeare against SDPA (w8a8i:4 against w8a8:4, same-kernel and eager KV).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from speckv.errors import CheckpointError

from .integer import native_with
from .target import COMPUTE_THREADS
from .w8a8 import quantise_rows

if TYPE_CHECKING:  # pragma: no cover
    import torch

# NOTE: the same constants as coder/kernels/spk_attn.h
KEY_BLOCK = 64
P_MAX = 255.0
DEN_BITS = 20
EXP_FLOOR = -126.0
SKIP = -22.0  # a key block whose best score is this far below the row's best contributes nothing
LOG2E = 1.4426950408889634
# 2^r = 1 + r P(r) on |r| <= 1/2, P of degree 4 fitted for relative error (1.6e-7 in float32)
EXP2_POLY = (0.0013239749241620302, 0.009672081097960472, 0.055507779121398926, 0.24022230505943298,
             0.6931470036506653)
THREADS = COMPUTE_THREADS  # the native kernel's threads


def exp2_det(x: "torch.Tensor") -> "torch.Tensor":
    """2^x of float32 x <= 0, the kernel's steps: n = round(x), r = x - n (exact), 1 + r P(r), times 2^n."""
    import torch

    f = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    x = torch.maximum(x, f(EXP_FLOOR))
    n = torch.round(x)
    r = x - n
    p = torch.full_like(r, EXP2_POLY[0])
    for k in EXP2_POLY[1:]:
        p = p * r + f(k)
    y = p * r + f(1.0)
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return y * two_n


def quantise(x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """float32 rows (..., D) -> (int8 codes as float32, per-row scale amax / 127): the W8A8 row
    quantisation's reference with unit factors, as the kernel runs it."""
    import torch

    q, xs = quantise_rows(x.reshape(-1, x.shape[-1]), torch.ones(x.shape[-1]), native=False)
    return q.float().view(x.shape), xs.view(x.shape[:-1])


def reference(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor") -> "torch.Tensor":
    """BF16 q (H, T, D), k and v (Hk, T, D) -> BF16 (T, H, D): the kernel's bits, in torch.
    NOTE: integer sums run as float32 products: each stays below 2^24, so they are exact."""
    import torch

    H, T, D = q.shape
    G = H // k.shape[0]
    q8, qs = quantise(q.float())
    k8, ks = quantise(k.float())
    v8, vs = quantise(v.float())
    rsd = torch.tensor(LOG2E / math.sqrt(D), dtype=torch.float32)
    nb = (T + KEY_BLOCK - 1) // KEY_BLOCK
    valid = torch.ones(T, T, dtype=torch.bool).tril()
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    for h in range(H):
        g = h // G
        S = q8[h] @ k8[g].t()  # (T, T) exact integers
        x = (S * (qs[h] * rsd)[:, None]) * ks[g][None, :]
        xm = torch.nn.functional.pad(torch.where(valid, x, torch.full_like(x, -math.inf)), (0, nb * KEY_BLOCK - T),
                                     value=-math.inf).view(T, nb, KEY_BLOCK)
        m = xm.amax((1, 2))
        live = (xm.amax(2) - m[:, None] >= torch.tensor(SKIP)).repeat_interleave(KEY_BLOCK, 1)[:, :T]
        e = torch.where(valid & live, exp2_det(x - m[:, None]), torch.zeros_like(x))
        den = torch.round(e * float(1 << DEN_BITS)).long().sum(1)
        w = torch.nn.functional.pad(e * vs[g][None, :], (0, nb * KEY_BLOCK - T)).view(T, nb, KEY_BLOCK)
        bm = w.amax(2)
        inv = torch.where(bm > 0, torch.tensor(P_MAX) / bm, torch.zeros_like(bm))
        u = torch.round(w * inv[..., None])  # (T, nb, KEY_BLOCK)
        vb = torch.nn.functional.pad(v8[g], (0, 0, 0, nb * KEY_BLOCK - T)).view(nb, KEY_BLOCK, D)
        acc = torch.bmm(u.transpose(0, 1), vb)  # (nb, T, D) exact integers
        bs = bm / torch.tensor(P_MAX)
        o = torch.zeros(T, D)
        for b in range(nb):  # NOTE: blocks in order, one rounding per step, as the kernel adds them
            o = o + bs[:, b, None] * acc[b]
        out[:, h] = (o / (den.float() * float(2.0 ** -DEN_BITS))[:, None]).to(torch.bfloat16)
    return out


def attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", scalar: bool = False,
              amx: bool = True) -> "torch.Tensor":
    """BF16 q (H, T, D), k and v (Hk, T, D) -> BF16 (T, H, D), natively (the rung needs the extension:
    the reference is for tests, far too slow for a sidecar). The kernel takes its fastest path here
    (AMX tiles, AVX-512 VNNI, AVX2), or the scalar loops (``scalar``), or any but AMX (``amx=False``):
    every path writes the reference's bits."""
    import torch

    nat = native_with("int8_attention")
    if nat is None:
        raise CheckpointError("the w8a8i rungs need speckv's native extension with int8_attention, not built here")
    H, T, D = q.shape
    qc, kc, vc = (t.to(torch.bfloat16).contiguous() for t in (q, k, v))
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    nat.int8_attention(qc.view(torch.int16).numpy(), kc.view(torch.int16).numpy(), vc.view(torch.int16).numpy(),
                           out.view(torch.int16).numpy(), H, kc.shape[0], T, D, THREADS, scalar, not amx)
    return out
