"""Ideal code length of a KV cache under the method's mixture (float64 reference).

``q(x) = w0 N(x; mu, s^2) + w1 N(x; mu, (wide s)^2) + w2 p_emp(x)``, with each
Gaussian integrated over the exact rounding bucket of the symbol x (BF16, or
e4m3 times its per-(layer, kv) scale), ``p_emp`` the calibrated empirical symbol
distribution (add-one smoothed, so every symbol has mass). The ideal code length
is ``sum(-log2 q(x)) / count``: the figure the integer coder must approach.
This is a measurement in float64, never used at coding time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .fp8 import e4m3_values

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .store import Calibration


def sm_ordinal(codes: np.ndarray, bits: int) -> np.ndarray:
    """Sign-magnitude float codes -> integers ordered like their values (-0 just below +0)."""
    sign = 1 << (bits - 1)
    codes = codes.astype(np.int64)
    return np.where(codes & sign, (sign - 1) - (codes & (sign - 1)), codes | sign)


def bucket_edges(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Rounding bucket [lo, hi] of every code of a float format, by value order.

    ``values[c]`` is the float64 value of code c (inf/NaN allowed: their buckets
    are empty, lo = hi = NaN). The extreme finite codes reach +-inf.
    """
    codes = np.arange(len(values))
    finite = np.isfinite(values)
    order = codes[finite][np.argsort(sm_ordinal(codes[finite], bits), kind="stable")]
    v = values[order]
    mids = (v[:-1] + v[1:]) / 2.0
    lo = np.full(len(values), np.nan)
    hi = np.full(len(values), np.nan)
    lo[order] = np.concatenate([[-np.inf], mids])
    hi[order] = np.concatenate([mids, [np.inf]])
    return lo, hi


def bf16_values() -> np.ndarray:
    """float64 value of each of the 65536 BF16 codes."""
    codes = np.arange(65536, dtype=np.uint32)
    with np.errstate(invalid="ignore"):  # NaN payloads widen to float64 NaN
        return (codes << 16).view(np.float32).astype(np.float64)


def smoothed(hist: np.ndarray) -> np.ndarray:
    """Add-one smoothed probabilities of a symbol histogram."""
    h = hist.astype(np.float64) + 1.0
    return h / h.sum()


def gauss_mass(lo: "torch.Tensor", hi: "torch.Tensor", mu: "torch.Tensor", s: "torch.Tensor") -> "torch.Tensor":
    """P(lo < X < hi) for X ~ N(mu, s^2), float64, accurate in both tails; 0 where undefined."""
    import torch

    zl, zh = (lo - mu) / (s * math.sqrt(2.0)), (hi - mu) / (s * math.sqrt(2.0))
    upper = zl > 0  # NOTE: take the difference on the near tail to avoid 1 - 1 cancellation
    # NOTE: Phi(-z) = erfc(z / sqrt 2) / 2; torch.special.ndtr loses the far tail
    # (ndtr(-8) is 2% off and ndtr(-9) is 0 in float64), erfc keeps it.
    erfc = torch.special.erfc
    p = 0.5 * torch.where(upper, erfc(zl) - erfc(zh), erfc(-zh) - erfc(-zl))
    return torch.nan_to_num(p, nan=0.0).clamp_min(0.0)


@dataclass
class IdealBits:
    """Total ideal bits and scalar counts, split by K and V."""

    bits: np.ndarray  # (2,) float64: K, V
    count: np.ndarray  # (2,) int64

    @property
    def per_scalar(self) -> float:
        return float(self.bits.sum() / max(self.count.sum(), 1))

    def part(self, kv: int) -> float:
        return float(self.bits[kv] / max(self.count[kv], 1))


def layer_bits(codes: "torch.Tensor", mu: "torch.Tensor", sigma: "torch.Tensor", lo: "torch.Tensor",
               hi: "torch.Tensor", p_emp: "torch.Tensor", mixture: tuple[float, float, float],
               wide: float) -> "torch.Tensor":
    """Ideal bits (float64) for one layer: codes (2, heads, tokens, dim) int64 symbol
    codes, mu float64 same shape (in the symbols' units), sigma (2, heads, 1, dim)."""
    import torch

    low, high = lo[codes], hi[codes]
    finite_mu = torch.isfinite(mu)
    m = torch.where(finite_mu, mu, torch.zeros_like(mu))
    g = mixture[0] * gauss_mass(low, high, m, sigma) + mixture[1] * gauss_mass(low, high, m, sigma * wide)
    g = torch.where(finite_mu, g, torch.zeros_like(g))
    q = g + mixture[2] * p_emp[codes]
    return -torch.log2(q).sum(dim=(1, 2, 3))  # (2,)


def ideal_bits(kv: "torch.Tensor", mu: "torch.Tensor", calib: "Calibration", dtype: str = "bf16",
               fp8_scale: "torch.Tensor | None" = None) -> IdealBits:
    """Ideal code length of ``kv`` (BF16 tensor, or uint8 e4m3 codes with their
    (layers, 2) fp32 scales) under the calibrated mixture around ``mu`` (BF16)."""
    import torch

    if dtype == "bf16":
        values, bits, hist = bf16_values(), 16, calib.hist_bf16
        codes = kv.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
        scale = torch.ones((kv.shape[0], 2), dtype=torch.float64)
    else:
        values, bits, hist = e4m3_values(), 8, calib.hist_fp8
        codes = kv.to(torch.int64)
        assert fp8_scale is not None  # e4m3 codes come with their scales
        scale = fp8_scale.to(torch.float64)
    lo_np, hi_np = bucket_edges(values, bits)
    lo, hi, p_emp = (torch.from_numpy(a) for a in (lo_np, hi_np, smoothed(hist)))
    sigma = torch.from_numpy(np.sqrt(calib.sigma2))  # (layers, 2, heads, dim)
    total = np.zeros(2)
    for layer in range(kv.shape[0]):
        s = scale[layer][:, None, None, None]  # (2, 1, 1, 1)
        m = mu[layer].to(torch.float64) / s
        sig = sigma[layer][:, :, None, :] / s
        total += layer_bits(codes[layer], m, sig, lo, hi, p_emp, calib.mixture, calib.wide).numpy()
    per_kv = int(np.prod(kv.shape[2:]))
    return IdealBits(bits=total, count=np.array([per_kv * kv.shape[0]] * 2, dtype=np.int64))


def order0_bits(codes: np.ndarray, n_symbols: int) -> float:
    """Empirical order-0 entropy (bits/symbol) of an integer code array."""
    if codes.size == 0:
        return 0.0
    h = np.bincount(codes.ravel().astype(np.int64), minlength=n_symbols).astype(np.float64)
    p = h[h > 0] / codes.size
    return float(-(p * np.log2(p)).sum())
