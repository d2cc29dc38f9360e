"""Shared helpers of the probability-model tests (``test_model_*.py``): independent
references in exact arithmetic (``fractions.Fraction`` / Python ints on decoded float
values, never the bit tricks of the implementation) for ``bin_index``, the grid
exponent and ``table_row``, the checks built on them, and the symbolize ->
desymbolize round trip."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import settings

from speckv.coder.model import E4M3, FP32, MAX_BIN, bin_index, context, desymbolize, symbolize
from speckv.coder.tables import (
    GRID_BELOW_SIGMA,
    LAMBDA_MAX,
    LAMBDA_MIN,
    LAMBDA_OFFSET,
    N_GAUSS,
    NOOP_TABLE,
    OFFSETS,
    SIGMA_ONE,
    CodingTables,
)
from speckv.errors import IntegrityError
from speckv.predictor.fp8 import e4m3_values

PROPERTY = settings(max_examples=30, deadline=None, database=None)
NEAR_TOP_Q8 = 13  # the model's "within 3 sigma of the binade top": 2^(13/8) ~ 3.08 sigma


# ------------------------------------------------------- exact references


def exact_value(fmt, bits: int) -> Fraction | float:
    """Exact value of one bit pattern (a Fraction), or a float NaN / +-inf."""
    bits = int(bits)
    sign = -1 if bits >> (fmt.bits - 1) else 1
    if fmt is E4M3:
        v = E4M3_VALUES[bits]
        return v if math.isnan(v) else Fraction(v)  # float64 holds e4m3 exactly
    ebits = fmt.bits - 1 - fmt.mant
    e = (bits >> fmt.mant) & ((1 << ebits) - 1)
    m = bits & ((1 << fmt.mant) - 1)
    if e == (1 << ebits) - 1:
        return math.nan if m else sign * math.inf
    if e == 0:
        return sign * Fraction(m, 1 << fmt.mant) * Fraction(2) ** (1 - fmt.bias)
    return sign * Fraction((1 << fmt.mant) + m, 1 << fmt.mant) * Fraction(2) ** (e - fmt.bias)


E4M3_VALUES = e4m3_values()


def ref_bin(fmt, bits: int, k: int, shift: Fraction = Fraction(0)) -> tuple[int, int]:
    """(signed bin, offset in 1/8 of the bin from its lower end) by the documented
    rule: c = floor(|x| / 2^k + shift) (clamped to MAX_BIN) for +x, -1 - c for -x
    (sign bit); NaN sits at 0 of its sign's bin, +-Inf at the clamp."""
    neg = bool(int(bits) >> (fmt.bits - 1))
    x = exact_value(fmt, bits)
    if isinstance(x, float) and math.isnan(x):
        v = Fraction(0)
    elif isinstance(x, float):  # +-inf
        v = Fraction(MAX_BIN)
    else:
        v = min(abs(x) / Fraction(2) ** k, Fraction(MAX_BIN))
    v = min(v + shift, Fraction(MAX_BIN))
    mag = math.floor(v)
    frac = math.floor((v - mag) * OFFSETS)
    return (-1 - mag, OFFSETS - 1 - frac) if neg else (mag, frac)


def check_bins(fmt, xs: np.ndarray, ks: np.ndarray) -> None:
    c, off = bin_index(fmt, xs, ks, offsets=True)
    c2, none = bin_index(fmt, xs, ks)
    assert none is None and np.array_equal(c, c2)
    for x, k, ci, oi in zip(xs.tolist(), ks.tolist(), c.tolist(), off.tolist(), strict=True):
        assert (ci, oi) == ref_bin(fmt, x, k), (fmt.name, hex(x), k)


# ----------------------------------------------------- context references


def ref_k(fx, fm, mu_bits: int, L: int) -> int | None:
    """The grid exponent from exact values: max(floor(L/8) - 4, ulp(mu) [+1 near the
    binade top]), clamped to x's format; None where mu is non-finite."""
    mu = exact_value(fm, mu_bits)
    if isinstance(mu, float):
        return None
    a = abs(mu)
    e = math.floor(math.log2(a)) if a else -10**6
    if a and Fraction(2) ** e > a:  # log2 rounding guard
        e -= 1
    if a and Fraction(2) ** (e + 1) <= a:
        e += 1
    e_unb = max(e, fx.k_min)  # mu's binade on x's scale (subnormals: the lowest)
    ulp = e_unb - fx.mant
    # distance from mu (truncated to x's precision) to its binade's top (for
    # subnormals on x's scale: the top of the subnormal range, 2^k_min)
    trunc = math.floor(a / Fraction(2) ** ulp) * Fraction(2) ** ulp
    top = Fraction(2) ** (e_unb + 1) if a >= Fraction(2) ** fx.k_min else Fraction(2) ** fx.k_min
    dist = top - trunc
    near = dist ** 8 < Fraction(2) ** (L + NEAR_TOP_Q8)  # dist < 2^((L + 13) / 8)
    k_s = (L // SIGMA_ONE) - GRID_BELOW_SIGMA
    return min(max(max(k_s, ulp + int(near)), fx.k_min), fx.k_max)


def ref_table_row(lam: int, off: int) -> int:
    lam = min(max(lam, LAMBDA_MIN), LAMBDA_MAX)
    if lam < LAMBDA_OFFSET:
        return (lam - LAMBDA_MIN) * OFFSETS + off
    return (LAMBDA_OFFSET - LAMBDA_MIN) * OFFSETS + (lam - LAMBDA_OFFSET)


def check_context(fx, fm, mu: np.ndarray, L: np.ndarray, tables: CodingTables,
                  check_near: np.ndarray | None = None) -> None:
    ctx = context(fx, fm, mu, L)
    k, t = ctx.k.astype(np.int64), ctx.t.astype(np.int64)
    finite = np.array([not isinstance(exact_value(fm, m), float) for m in mu.tolist()])
    assert np.array_equal(ctx.mu_ok, finite)
    # the grid stays within x's format
    assert np.all((k >= fx.k_min) & (k <= fx.k_max))
    # bins at most sigma/16 wide (2^k <= 2^(L/8 - 4)) unless clamped by mu's ULP
    # or by the format's smallest grid
    k_s = (L.astype(np.int64) // SIGMA_ONE) - GRID_BELOW_SIGMA
    assert np.all((k <= k_s) | ~finite | (k == fx.k_min)
                  | (k <= _ulp_exp(fx, fm, mu) + 1))
    # ... and never finer than sigma/16 allows, nor than mu's ULP (values near mu own whole bins)
    assert np.all((k >= np.minimum(k_s, fx.k_max)) | (k == fx.k_min))
    assert np.all((k >= np.minimum(_ulp_exp(fx, fm, mu), fx.k_max)) | ~finite)
    # t: a Gaussian row of the family (never the padding no-op), as the table_row rule says
    assert np.all((t >= 0) & (t < N_GAUSS)) and not np.any(t == NOOP_TABLE)
    assert np.all(tables.radius[t] >= 1)
    lam = L.astype(np.int64) - SIGMA_ONE * k
    # mu sits on the grid shifted by half a value's bucket: 2^-(nb+1) for the 2^nb
    # values per bin of mu's own binade (0 where its values span several bins)
    ulp = np.where(finite, _ulp_exp(fx, fm, mu), (1 << (fm.bits - 1 - fm.mant)) - 1 - fm.bias - fx.mant)
    for i in range(len(mu)):
        nb = int(k[i]) - int(ulp[i])
        shift = Fraction(1, 2 ** (min(nb, 24) + 1)) if nb >= 0 else Fraction(0)
        c_ref, off_ref = ref_bin(fm, int(mu[i]), int(k[i]), shift)
        assert int(ctx.c_mu[i]) == c_ref
        assert int(t[i]) == ref_table_row(int(lam[i]), off_ref)
        if finite[i] and (check_near is None or check_near[i]):
            assert int(k[i]) == ref_k(fx, fm, int(mu[i]), int(L[i])), (hex(int(mu[i])), int(L[i]))


def _ulp_exp(fx, fm, mu: np.ndarray) -> np.ndarray:
    """Exponent of x's ULP at mu's binade (float reference via frexp)."""
    v = np.abs(_as_float64(fm, mu))
    with np.errstate(divide="ignore", invalid="ignore"):
        _, e = np.frexp(np.where(np.isfinite(v), v, 0.0))
    e = np.where(v > 0, e - 1, fx.k_min)
    return np.maximum(e, fx.k_min) - fx.mant


def _as_float64(fmt, bits: np.ndarray) -> np.ndarray:
    if fmt is E4M3:
        return E4M3_VALUES[bits]
    if fmt is FP32:
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ------------------------------------------------- symbolize / desymbolize


def _round_trip(fx, fm, tables, x: np.ndarray, mu: np.ndarray, L: np.ndarray) -> None:
    ctx = context(fx, fm, mu, L)
    sym = symbolize(fx, tables, ctx, x)
    radius = tables.radius[ctx.t]
    assert np.all((sym.j >= 0) & (sym.j <= 2 * radius + 1))
    # non-finite x or mu always escape
    bad = ~fx.finite(x) | ~fm.finite(mu)
    assert np.all(sym.j[bad] == 2 * radius[bad] + 1)
    out = desymbolize(fx, tables, ctx, sym.j, sym.bits)
    assert np.array_equal(np.asarray(out).astype(np.int64), x.astype(np.int64))
    # the raw sections must be exactly as long as the symbols say
    with pytest.raises(IntegrityError):
        desymbolize(fx, tables, ctx, sym.j, sym.bits + b"\x00")
    if sym.bits:
        with pytest.raises(IntegrityError):
            desymbolize(fx, tables, ctx, sym.j, sym.bits[:-1])


def _bf16_near(rng, mu: np.ndarray) -> np.ndarray:
    f = (mu.astype(np.uint32) << 16).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        g = f * (1 + rng.standard_normal(len(mu)).astype(np.float32) * np.float32(0.01))
    return (g.view(np.uint32) >> 16).astype(np.uint16)
