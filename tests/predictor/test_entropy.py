"""Ideal code length against a pure-Python float64 reference.

The reference shares no code with ``speckv.predictor.entropy``: a symbol's rounding
bucket comes from its neighbours, found by stepping the bit pattern (BF16 via
``struct``, e4m3 by its definition), the Gaussian mass from ``math.erfc``, and
the mixture with the add-one smoothed histogram is summed scalar by scalar.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from speckv.predictor.entropy import bf16_values, bucket_edges, ideal_bits, order0_bits, smoothed
from speckv.predictor.fp8 import e4m3_values

REL = 1e-9


def bits_close(got: float, want: float) -> bool:
    """Code lengths equal to REL, or to what double precision allows for them: a
    probability of 2^-bits is a difference of two CDF values near 1/2, each good to
    2^-53, so -log2 of it carries an absolute error up to about 2^(bits - 52) / ln 2
    (k == mu under a huge sigma: 28.3 bits, off by 5e-8 between two correct evaluations)."""
    return math.isclose(got, want, rel_tol=REL, abs_tol=4 * 2.0 ** (want - 52) / math.log(2))


@dataclass
class Calibration:
    """The fields of ``speckv.predictor.checkpoint.Calibration`` that ``ideal_bits`` reads."""

    sigma2: np.ndarray
    hist_bf16: np.ndarray
    hist_fp8: np.ndarray
    mixture: tuple[float, float, float]
    wide: float

# ------------------------------------------------------------------ reference


def bf16_value(code: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (code & 0xFFFF) << 16))[0]


def e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 7
    if e == 0xF and m == 7:
        return math.nan
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


FORMATS = {"bf16": (16, bf16_value), "fp8": (8, e4m3_value)}


def step(code: int, bits: int, up: bool) -> int:
    """The code of the next representable value above (or below) code's value."""
    sign = 1 << (bits - 1)
    if up:
        if code == sign:  # -0 -> +0
            return 0
        return code - 1 if code & sign else code + 1
    if code == 0:  # +0 -> -0
        return sign
    return code + 1 if code & sign else code - 1


def ref_bucket(code: int, fmt: str) -> tuple[float, float]:
    bits, value = FORMATS[fmt]
    v = value(code)
    if not math.isfinite(v):
        return math.nan, math.nan
    below, above = value(step(code, bits, False)), value(step(code, bits, True))
    lo = (below + v) / 2 if math.isfinite(below) else -math.inf
    hi = (v + above) / 2 if math.isfinite(above) else math.inf
    return lo, hi


def ref_gauss(lo: float, hi: float, mu: float, s: float) -> float:
    if math.isnan(lo) or not math.isfinite(mu):
        return 0.0
    zl, zh = (lo - mu) / s / math.sqrt(2), (hi - mu) / s / math.sqrt(2)
    if zl > 0:
        return max(0.5 * (math.erfc(zl) - math.erfc(zh)), 0.0)
    return max(0.5 * (math.erfc(-zh) - math.erfc(-zl)), 0.0)


def ref_bits(codes, mus, calib: Calibration, fmt: str, scales=None) -> list[float]:
    """Total ideal bits for K and V; codes (layers, 2, heads, tokens, dim) ints,
    mus the predicted values (float), scales (layers, 2) or None."""
    hist = calib.hist_bf16 if fmt == "bf16" else calib.hist_fp8
    total_h = sum(int(h) + 1 for h in hist)
    w0, w1, w2 = calib.mixture
    out = [0.0, 0.0]
    L, _, H, T, D = np.shape(codes)
    for layer in range(L):
        for j in range(2):
            s_unit = 1.0 if scales is None else float(scales[layer][j])
            for h in range(H):
                for d in range(D):
                    sigma = math.sqrt(float(calib.sigma2[layer, j, h, d])) / s_unit
                    for t in range(T):
                        c = int(codes[layer][j][h][t][d])
                        mu = float(mus[layer][j][h][t][d]) / s_unit
                        lo, hi = ref_bucket(c, fmt)
                        g = w0 * ref_gauss(lo, hi, mu, sigma) + w1 * ref_gauss(lo, hi, mu, sigma * calib.wide)
                        q = g + w2 * (int(hist[c]) + 1) / total_h
                        out[j] += -math.log2(q)
    return out


def bf16_from_codes(codes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(codes, np.uint16).view(np.int16).copy()).view(torch.bfloat16)


def make_calib(layers, heads, dim, rng, mixture=(0.95, 0.03, 0.02), wide=3.0, sigma2=None):
    if sigma2 is None:
        sigma2 = rng.uniform(1e-4, 1.0, size=(layers, 2, heads, dim))
    return Calibration(sigma2=np.asarray(sigma2, np.float64),
                       hist_bf16=rng.integers(0, 1000, size=65536).astype(np.int64),
                       hist_fp8=rng.integers(0, 5000, size=256).astype(np.int64),
                       mixture=mixture, wide=wide)


# ------------------------------------------------------------------ the reference's own sanity


def test_reference_value_tables_agree():
    """Sanity of the pure-Python value functions against torch's own decoding."""
    for c in range(0, 65536, 97):
        want = torch.tensor([c], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double().item()
        got = bf16_value(c)
        assert (math.isnan(got) and math.isnan(want)) or got == want
    t8 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    for c in range(256):
        want, got = t8[c].item(), e4m3_value(c)
        assert (math.isnan(got) and math.isnan(want)) or got == want, c


# ------------------------------------------------------------------ ideal_bits, bf16


def special_bf16_example():
    """layers=2, heads=1, tokens=3, dim=4 with every awkward kind of value."""
    kv_vals = [
        0.0, -0.0, 2.0**-133, -(2.0**-130),  # +-0, bf16 subnormals
        math.inf, -math.inf, math.nan, 3.3895313892515355e38,  # +-inf, NaN, largest finite bf16
        -3.3895313892515355e38, 1000.0, -750.0, 1.0,  # far from mu
        0.5, -0.125, 0.0078125, 1e-3,
        2.5, -2.5, 0.3, 7.0,
        1e-20, -1e-20, 65504.0, 12.0,
    ]
    mu_vals = [
        0.0, 0.0, 0.0, 1e-38,
        1.0, -1.0, 0.0, 3.3895313892515355e38,
        -1.0, 0.0, 0.1, 1.0,
        0.49, -0.12, 0.0, math.inf,  # a non-finite mu: its Gaussian parts vanish
        2.4, -2.6, math.nan, 6.9,
        0.0, 0.0, 65000.0, 12.5,
    ]
    kv = torch.tensor(kv_vals + [v * 0.5 for v in kv_vals], dtype=torch.float32)
    mu = torch.tensor(mu_vals + [v * 0.5 for v in mu_vals], dtype=torch.float32)
    kv = kv.to(torch.bfloat16).reshape(2, 2, 1, 3, 4)
    mu = mu.to(torch.bfloat16).reshape(2, 2, 1, 3, 4)
    return kv, mu


def kv_codes(kv: torch.Tensor) -> np.ndarray:
    return kv.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.int64)


@pytest.mark.parametrize("mixture,wide", [((0.95, 0.03, 0.02), 3.0), ((0.6, 0.3, 0.1), 5.0)])
def test_ideal_bits_bf16_matches_reference(mixture, wide):
    rng = np.random.default_rng(1)
    kv, mu = special_bf16_example()
    assert kv_codes(kv)[0, 0, 0, 0, :].tolist()[:2] == [0x0000, 0x8000]
    assert kv_codes(kv)[0, 0, 0, 1, 3] == 0x7F7F  # the largest finite bf16 survived the cast
    sigma2 = rng.uniform(1e-4, 1.0, size=(2, 2, 1, 4))
    sigma2[1, 0, 0, 2] = 1e-12  # the calibration floor
    calib = make_calib(2, 1, 4, rng, mixture, wide, sigma2)
    got = ideal_bits(kv, mu, calib, "bf16")
    want = ref_bits(kv_codes(kv), mu.double().numpy(), calib, "bf16")
    assert got.count.tolist() == [24, 24]
    for j in range(2):
        assert bits_close(got.bits[j], want[j]), (j, got.bits[j], want[j])
    assert math.isclose(got.per_scalar, sum(want) / 48, rel_tol=REL)
    assert math.isclose(got.part(0), want[0] / 24, rel_tol=REL)
    assert math.isclose(got.part(1), want[1] / 24, rel_tol=REL)


@settings(max_examples=150, deadline=None, database=None)
@given(k=st.integers(0, 0xFFFF), v=st.integers(0, 0xFFFF), mk=st.integers(0, 0xFFFF),
       mv=st.integers(0, 0xFFFF), s2=st.floats(1e-12, 1e6), s2v=st.floats(1e-12, 1e6))
@example(k=12272, v=0, mk=12272, mv=0, s2=58605.0, s2v=1.0)  # x == mu under a huge sigma: 28.3 bits
def test_ideal_bits_bf16_single_scalars(k, v, mk, mv, s2, s2v):
    rng = np.random.default_rng(k)
    calib = make_calib(1, 1, 1, rng, sigma2=[[[[s2]], [[s2v]]]])
    kv = bf16_from_codes(np.array([k, v]).reshape(1, 2, 1, 1, 1))
    mu = bf16_from_codes(np.array([mk, mv]).reshape(1, 2, 1, 1, 1))
    got = ideal_bits(kv, mu, calib, "bf16")
    want = ref_bits(kv_codes(kv), mu.double().numpy(), calib, "bf16")
    for j in range(2):
        assert bits_close(got.bits[j], want[j]), (j, got.bits[j], want[j])


def test_ideal_bits_exact_prediction_is_cheap_and_far_is_expensive():
    rng = np.random.default_rng(2)
    calib = make_calib(1, 1, 2, rng, sigma2=np.full((1, 2, 1, 2), 1e-6))
    mu = torch.tensor([1.0, 2.0, 1.0, 2.0], dtype=torch.bfloat16).reshape(1, 2, 1, 1, 2)
    close = ideal_bits(mu.clone(), mu, calib, "bf16").per_scalar
    far = ideal_bits(mu * 1000, mu, calib, "bf16").per_scalar
    assert close < 0.1  # the Gaussian holds almost all its mass in the right bucket
    assert far > 10  # only the empirical component pays for it


@settings(max_examples=200, deadline=None, database=None)
@given(z=st.floats(-30, 30), width=st.floats(1e-6, 5.0), s=st.floats(1e-3, 1e3))
def test_gauss_mass_tails(z, width, s):
    """Both tails stay accurate (relative): no 1 - 1 cancellation far above mu."""
    from speckv.predictor.entropy import gauss_mass

    mu = 0.25
    lo, hi = mu + z * s, mu + (z + width) * s
    got = gauss_mass(*(torch.tensor([x], dtype=torch.float64) for x in (lo, hi, mu, s))).item()
    want = ref_gauss(lo, hi, mu, s)
    if want < 1e-290:  # deep underflow: only require a tiny answer
        assert got < 1e-280
    else:
        assert math.isclose(got, want, rel_tol=1e-6), (got, want)


def test_ideal_bits_upper_tail_without_empirical_floor():
    """With (almost) no empirical component, a value 12 sigma above mu costs
    what the Gaussian tail says, not the ~1000 bits of a cancelled difference."""
    rng = np.random.default_rng(6)
    calib = make_calib(1, 1, 1, rng, mixture=(0.5, 0.5, 1e-300), wide=1.0,
                       sigma2=np.full((1, 2, 1, 1), 1.0))
    kv = torch.tensor([12.0, -12.0], dtype=torch.bfloat16).reshape(1, 2, 1, 1, 1)
    mu = torch.zeros_like(kv)
    got = ideal_bits(kv, mu, calib, "bf16")
    want = ref_bits(kv_codes(kv), mu.double().numpy(), calib, "bf16")
    for j in range(2):
        assert bits_close(got.bits[j], want[j]), (j, got.bits[j], want[j])
    assert 100 < got.bits[0] < 120  # -log2 of a ~1e-33 bucket mass


# ------------------------------------------------------------------ ideal_bits, fp8


def test_ideal_bits_fp8_matches_reference():
    rng = np.random.default_rng(3)
    codes = np.array([
        0x00, 0x80, 0x01, 0x81, 0x7E, 0xFE,  # zeros, smallest subnormals, +-448
        0x7F, 0xFF, 0x38, 0xB8, 0x50, 0x07,  # NaNs, +-1, 4, largest subnormal
    ], dtype=np.uint8).reshape(1, 2, 1, 2, 3)
    q = torch.from_numpy(codes.copy())
    scale = torch.tensor([[0.01, 2.5]], dtype=torch.float32)
    mu_vals = [0.0, -0.0, 0.0, 0.01, 4.48, -4.0,  # in KV units: codes' values * scale
               0.0, 1.0, 2.5, -2.0, math.inf, 0.03]
    mu = torch.tensor(mu_vals, dtype=torch.float32).to(torch.bfloat16).reshape(1, 2, 1, 2, 3)
    calib = make_calib(1, 1, 3, rng, mixture=(0.9, 0.06, 0.04), wide=4.0)
    got = ideal_bits(q, mu, calib, "fp8", scale)
    want = ref_bits(codes.astype(np.int64), mu.double().numpy(), calib, "fp8",
                    scales=scale.double().numpy())
    assert got.count.tolist() == [6, 6]
    for j in range(2):
        assert bits_close(got.bits[j], want[j]), (j, got.bits[j], want[j])


@settings(max_examples=100, deadline=None, database=None)
@given(codes=st.lists(st.integers(0, 255), min_size=8, max_size=8),
       mus=st.lists(st.floats(-500, 500, width=32), min_size=8, max_size=8),
       scales=st.lists(st.floats(2.0**-13, 16.0, width=32), min_size=4, max_size=4))
def test_ideal_bits_fp8_random(codes, mus, scales):
    rng = np.random.default_rng(codes[0])
    c = np.array(codes, np.uint8).reshape(2, 2, 1, 2, 1)
    mu = torch.tensor(mus, dtype=torch.float32).to(torch.bfloat16).reshape(2, 2, 1, 2, 1)
    scale = torch.tensor(scales, dtype=torch.float32).reshape(2, 2)
    calib = make_calib(2, 1, 1, rng)
    got = ideal_bits(torch.from_numpy(c.copy()), mu, calib, "fp8", scale)
    want = ref_bits(c.astype(np.int64), mu.double().numpy(), calib, "fp8", scales=scale.double().numpy())
    for j in range(2):
        assert bits_close(got.bits[j], want[j]), (j, got.bits[j], want[j])


# ------------------------------------------------------------------ bucket edges


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_bucket_edges_tile_the_real_line(fmt):
    bits = FORMATS[fmt][0]
    values = bf16_values() if fmt == "bf16" else e4m3_values()
    lo, hi = bucket_edges(values, bits)
    finite = np.isfinite(values)
    # non-finite codes have empty (NaN) buckets
    assert np.isnan(lo[~finite]).all() and np.isnan(hi[~finite]).all()
    assert not np.isnan(lo[finite]).any() and not np.isnan(hi[finite]).any()
    order = np.flatnonzero(finite)[np.argsort(lo[finite], kind="stable")]
    lo_s, hi_s, v = lo[order], hi[order], values[order]
    assert lo_s[0] == -np.inf and hi_s[-1] == np.inf
    assert np.array_equal(hi_s[:-1], lo_s[1:])  # no gaps, no overlaps
    assert (lo_s < hi_s).all()
    assert ((lo_s <= v) & (v <= hi_s)).all()
    assert len(np.unique(lo_s)) == len(lo_s)  # every finite code (incl. -0 and +0) has its own bucket


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_bucket_edges_match_stepped_neighbours(fmt):
    bits, value = FORMATS[fmt]
    values = bf16_values() if fmt == "bf16" else e4m3_values()
    lo, hi = bucket_edges(values, bits)
    codes = range(1 << bits) if fmt == "fp8" else list(range(0, 65536, 251)) + [
        0x0000, 0x8000, 0x0001, 0x8001, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x3F80, 0x007F, 0x0080]
    for c in codes:
        want_lo, want_hi = ref_bucket(c, fmt)
        if math.isnan(want_lo):
            assert math.isnan(lo[c]) and math.isnan(hi[c]), c
        else:
            assert (lo[c], hi[c]) == (want_lo, want_hi), (hex(c), lo[c], hi[c], want_lo, want_hi)


def test_bf16_buckets_are_rounding_buckets():
    """A float strictly inside a code's bucket rounds (to nearest) to that code."""
    values = bf16_values()
    lo, hi = bucket_edges(values, 16)
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 65536, size=4000)
    codes = codes[np.isfinite(lo[codes]) & np.isfinite(hi[codes])]
    u = rng.uniform(0.05, 0.95, size=len(codes))
    x = lo[codes] + (hi[codes] - lo[codes]) * u
    got = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    # exact zero inputs lose the sign of -0's bucket; they cannot occur strictly inside it
    assert np.array_equal(got.astype(np.int64), codes)


# ------------------------------------------------------------------ order-0 entropy and smoothing


def test_order0_bits_known_distributions():
    codes = np.array([0, 0, 0, 0, 1, 1, 2, 3])  # p = 1/2, 1/4, 1/8, 1/8
    assert math.isclose(order0_bits(codes, 4), 1.75, rel_tol=1e-12)
    assert math.isclose(order0_bits(np.random.default_rng(5).permutation(codes), 300), 1.75, rel_tol=1e-12)
    assert math.isclose(order0_bits(np.arange(256, dtype=np.uint8).repeat(3), 256), 8.0, rel_tol=1e-12)
    assert order0_bits(np.full(10, 7), 16) == 0.0
    assert order0_bits(np.array([], dtype=np.int64), 16) == 0.0
    u16 = np.array([0xFFFF, 0x8000, 0xFFFF, 0x8000], dtype=np.uint16)  # high codes of a uint16 array
    assert math.isclose(order0_bits(u16, 65536), 1.0, rel_tol=1e-12)


def test_smoothed_is_add_one():
    p = smoothed(np.array([0, 1, 2, 5]))
    assert np.array_equal(p, np.array([1, 2, 3, 6]) / 12.0)
