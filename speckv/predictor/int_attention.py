"""Causal attention in integers (the portable rung), tiled by query blocks.

Per kv head (its query heads share it, GQA)::

    k8 = round(k * 64 / sk_c)        int8, one scale per channel over the prompt (K's outliers are
                                     channels, KIVI); q absorbs it: q' = q * (sk_c / 64)
    q8 = round(q' * 127 / amax_row)  int8 per (token, head); dq = amax_row / 127
    S  = q8 @ k8^T                   int32, exact: the score is S * dq / (2^SCORE_SHIFT sqrt(D))
    e  = EXP[floor(f32(S_max - S) * Mf)]    Mf = f32(dq * 2^(EXP_STEP_BITS - SCORE_SHIFT) / sqrt(D)): one float32
                                     product per score (S_max - S < 2^24 is exact in float32)
    out = round((sum_j e_j v8_j * sv_c / 127) / sum_j e_j)   e = hi * 64 + lo (0..63 each)

Every second operand stays within +-64 (``integer.B_MAX``): k8 for the scores, the
numerators' halves for (P @ V)^T = V^T @ P^T.

Memory is (block rows, tokens) per step, so long prompts fit. Where the extension
is built and the CPU has AVX-512 VNNI the whole attention is one native call
(``_native.int_attention``); else the exp stage alone runs natively
(``_native.int_softmax``); the same integers either way.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from . import integer
from .integer import (
    B_MAX,
    EXP_LEN,
    EXP_SPLIT,
    EXP_STEP_BITS,
    MAX_TOKENS,
    Q_MAX,
    SCORE_SHIFT,
    IntegerRangeError,
    div,
    int_mm,
    quantise,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

BLOCK = 128  # query tokens per tile


def channel_quantise(x: "torch.Tensor", qmax: float) -> tuple["torch.Tensor", "torch.Tensor"]:
    """int64 (tokens, dim) -> (int8 per-channel symbols in +-qmax, float64 per-channel scale)."""
    q, amax = quantise(x.t(), qmax)
    return q.t().contiguous(), div(amax, qmax)


def exp_weights(S: "torch.Tensor", pos: "torch.Tensor", mf: "torch.Tensor",
                table: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """Softmax numerators of int32 scores ``S`` (rows, keys) for rows at positions ``pos``
    (keys > pos masked): (hi int8, lo int8, int64 row sums), numerator = hi * 2^EXP_SPLIT + lo."""
    import torch

    keys = torch.arange(S.shape[1], device=S.device)
    valid = keys[None, :] <= pos[:, None]
    smax = torch.where(valid, S, torch.full_like(S, torch.iinfo(torch.int32).min)).amax(dim=1)
    x = (smax[:, None] - S).float() * mf[:, None]  # NOTE: one float32 product, as the native stage
    idx = x.clamp(max=float(EXP_LEN)).long()  # x >= 0 on valid keys: truncation is floor
    idx = torch.where(valid, idx, torch.full_like(idx, EXP_LEN))
    e = torch.cat([table.long(), table.new_zeros(1, dtype=torch.int64)])[idx]
    lo_mask = (1 << EXP_SPLIT) - 1
    return (e >> EXP_SPLIT).to(torch.int8), (e & lo_mask).to(torch.int8), e.sum(dim=1)


def _native_exp() -> Any:
    if not integer.NATIVE:
        return None
    try:
        from speckv.coder import _native
    except ImportError:
        return None
    return getattr(_native, "int_softmax", None)


def _native_fused() -> Any:
    """The whole attention in one native call (``_native.int_attention``, coder/kernels/spk_iattn.h:
    VNNI scores and P @ V, the same integers), where built and the CPU has AVX-512 VNNI (else
    its scalar loops would be slower than the tiled torch products below)."""
    nat = integer.native_with("int_attention")
    if nat is None or not (nat.wide_vnni() or integer.FUSED_SCALAR):
        return None
    return nat.int_attention


def _exp_stage(S: "torch.Tensor", pos: "torch.Tensor", mf: "torch.Tensor", table: "torch.Tensor",
               native: bool, buf: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """(int8 (2 rows, keys): the hi rows then the lo rows, int64 row sums); the native stage
    writes into ``buf`` (a reused flat int8 buffer)."""
    import torch

    fn = _native_exp() if native and S.device.type == "cpu" else None
    if fn is None:
        hi, lo, sums = exp_weights(S, pos, mf, table)
        return torch.cat([hi, lo]), sums
    rows, keys = S.shape
    hl = buf[: 2 * rows * keys].view(2 * rows, keys)
    sums = torch.empty(rows, dtype=torch.int64)
    fn(S.contiguous().numpy(), pos.contiguous().numpy(), mf.contiguous().numpy(), table.contiguous().numpy(),
       hl[:rows].numpy(), hl[rows:].numpy(), sums.numpy(), EXP_SPLIT, integer.NATIVE_THREADS)
    return hl, sums


def attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", table: "torch.Tensor",
              exact: bool = False, block: int = BLOCK) -> "torch.Tensor":
    """int64 q (tokens, heads, dim), k and v (tokens, kv_heads, dim) -> int64 (tokens, heads, dim).
    ``exact``: the reference (int64 products, the torch exp stage)."""
    import torch

    T, H, D = q.shape
    if T > MAX_TOKENS:
        raise IntegerRangeError(f"{T} tokens: the integer attention's int32 sums hold {MAX_TOKENS}")
    fused = None if exact or q.device.type != "cpu" or not (integer.NATIVE and integer.FUSED) else _native_fused()
    if fused is not None:
        out = torch.empty_like(q)
        fused(q.contiguous().numpy(), k.contiguous().numpy(), v.contiguous().numpy(), table.contiguous().numpy(),
              out.numpy(), T, H, k.shape[1], D, integer.FUSED_THREADS, integer.FUSED_SCALAR)
        return out
    G = H // k.shape[1]
    out = torch.empty_like(q)
    cpu = not exact and q.device.type == "cpu"
    rows_max = min(block, T) * G
    s_buf = torch.empty(rows_max * T, dtype=torch.int32) if cpu else None  # reused by every block
    hl_buf = torch.empty(2 * rows_max * T, dtype=torch.int8) if cpu else q.new_empty(0, dtype=torch.int8)
    for g in range(k.shape[1]):
        k8, ks = channel_quantise(k[:, g], float(B_MAX))  # k8: the scores' second operand
        v8, vs = channel_quantise(v[:, g], Q_MAX)
        vt = v8.t().contiguous()  # (dim, tokens): the first operand of (P @ V)^T
        q8, amax = quantise(q[:, g * G:(g + 1) * G].double() * ks)  # (T, G, D), (T, G)
        # the score is S * dq / (2^SCORE_SHIFT sqrt(D)); * 2^n is exact, each division one rounding
        mf = div(div(amax, Q_MAX) * 2.0 ** (EXP_STEP_BITS - SCORE_SHIFT), math.sqrt(D)).to(torch.float32)
        for b in range(0, T, block):
            e_ = min(b + block, T)
            rows = q8[b:e_].reshape(-1, D)  # row r = (token b + r // G, head r % G)
            pos = torch.arange(b, e_, device=q.device).repeat_interleave(G)
            S = int_mm(rows, k8[:e_], exact, None if s_buf is None else s_buf[: rows.shape[0] * e_].view(-1, e_))
            hl, sums = _exp_stage(S, pos, mf[b:e_].reshape(-1), table, not exact, hl_buf)
            prod = int_mm(vt[:, :e_], hl, exact)  # (dim, 2 rows): V^T @ [hi; lo]^T in one product
            R = hl.shape[0] // 2
            acc = (prod[:, :R].long() << EXP_SPLIT) + prod[:, R:]
            o = torch.round((acc.t().double() * vs) / sums.double()[:, None]).to(torch.int64)
            out[b:e_, g * G:(g + 1) * G] = o.view(e_ - b, G, D)
    return out
