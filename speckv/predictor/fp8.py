"""FP8 e4m3 quantisation: the FP8 KV variant and the predictor's FP8 weights.

KV (as vLLM ``kv_cache_dtype="fp8"``): one fp32 scale per (layer, kv),
``scale = amax|x| / E4M3_MAX`` over that slice's finite values, symbols
``e4m3(x / scale)`` rounded to nearest (ties to even). Weights: one fp32
scale per output channel (row). Non-finite inputs become the e4m3 NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


def _safe_scale(amax: "torch.Tensor") -> "torch.Tensor":
    """amax / E4M3_MAX, with 1.0 where amax is 0 or not finite (all-zero slices)."""
    import torch

    scale = (amax.float() / E4M3_MAX).to(torch.float32)
    ok = torch.isfinite(scale) & (scale > 0)
    return torch.where(ok, scale, torch.ones_like(scale))


def _finite_amax(x: "torch.Tensor", dims: tuple[int, ...]) -> "torch.Tensor":
    import torch

    xf = x.float().abs()
    xf = torch.where(torch.isfinite(xf), xf, torch.zeros_like(xf))
    return xf.amax(dim=dims) if xf.numel() else torch.zeros(
        [s for i, s in enumerate(x.shape) if i not in dims]
    )


def quantize_e4m3(x: "torch.Tensor", scale: "torch.Tensor", toward_zero: bool = False) -> "torch.Tensor":
    """e4m3 symbols (uint8) of ``x / scale``; ``scale`` broadcasts against x. Rounded to nearest
    even, or (``toward_zero``) toward zero, as vLLM's CPU cache writer rounds
    (benchmarks/research/vllm_fp8_rounding.py)."""
    import torch

    y = x.float() / scale
    y = torch.where(torch.isfinite(y), y, torch.full_like(y, float("nan")))
    # NOTE: torch rounds to nearest-even when casting to float8_e4m3fn; inputs are
    # within +-E4M3_MAX by construction of the scale, so nothing saturates.
    q = y.to(torch.float8_e4m3fn)
    if not toward_zero:
        return q.view(torch.uint8)
    out = q.view(torch.uint8).clone()
    over = q.float().abs() > y.abs()  # rounded away from zero: one code back (codes are monotone in |v|)
    out[over & ((out & 0x7F) > 0)] -= 1
    return out


def dequantize_e4m3(q: "torch.Tensor", scale: "torch.Tensor") -> "torch.Tensor":
    """FP32 values of e4m3 symbols times their scale."""
    import torch

    return q.view(torch.float8_e4m3fn).float() * scale


def kv_to_fp8(kv: "torch.Tensor", toward_zero: bool = False) -> tuple["torch.Tensor", "torch.Tensor"]:
    """BF16 KV (layers, 2, heads, tokens, dim) -> (uint8 symbols, fp32 scales (layers, 2)),
    rounded to nearest (or toward zero: vLLM's CPU cache writer)."""
    scale = _safe_scale(_finite_amax(kv, (2, 3, 4)))  # (layers, 2)
    return quantize_e4m3(kv, scale[:, :, None, None, None], toward_zero), scale


def weight_to_fp8(w: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Weight (out, in) -> (uint8 e4m3 symbols (out, in), fp32 per-row scales (out,))."""
    scale = _safe_scale(_finite_amax(w, (1,)))
    return quantize_e4m3(w, scale[:, None]), scale


def e4m3_values() -> np.ndarray:
    """float64 value of each of the 256 e4m3 symbols (NaN for 0x7f and 0xff)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    sub = (man / 8.0) * 2.0**-6
    vals = sign * np.where(exp == 0, sub, normal)
    vals[(codes & 0x7F) == 0x7F] = np.nan
    return vals
