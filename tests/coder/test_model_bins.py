"""Tests of ``bin_index`` of the integer probability model (``speckv.coder.model``),
checked against an independent reference in exact arithmetic (``fractions.Fraction``
on decoded float values, never the bit tricks of the implementation; the references:
``model_helpers.py``) for BF16, E4M3 and FP32."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from model_helpers import PROPERTY, check_bins, ref_bin

from speckv.coder.model import BF16, E4M3, FP32, MAX_BIN, bin_index

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------------------- bin_index


@PROPERTY
@given(st.integers(0, 2**32 - 1))
def test_bin_index_bf16_random(seed):
    rng = np.random.default_rng(seed)
    xs = rng.integers(0, 1 << 16, 400).astype(np.uint16)
    ks = rng.integers(BF16.k_min, BF16.k_max + 1, 400).astype(np.int32)
    # also grids near each value's own binade, where bins and offsets are busy
    e = ((xs.astype(np.int32) >> 7) & 0xFF) - 127
    near = np.clip(e - rng.integers(-2, 12, 400), BF16.k_min, BF16.k_max).astype(np.int32)
    check_bins(BF16, np.concatenate([xs, xs]), np.concatenate([ks, near]))


def test_bin_index_bf16_specials():
    specials = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7F7F, 0xFF7F,
                0x0080, 0x8080, 0x3F80, 0xBF80]
    subnormals = list(range(0x0001, 0x0080)) + list(range(0x8001, 0x8080))
    xs = np.array(specials + subnormals, np.uint16)
    for k in (BF16.k_min, -125, -120, -100, -20, 0, 7, 100, BF16.k_max, 126):
        check_bins(BF16, xs, np.full(len(xs), k, np.int32))


def test_bin_index_bf16_offsets_in_eighths():
    """x = (8m + o) / 8 * 2^k exactly: bin m (or -1-m), offset o (or 7-o); one ULP
    below each boundary falls in the previous eighth."""
    rng = np.random.default_rng(0)
    for k in rng.integers(BF16.k_min + 3, 110, 25).tolist() + [BF16.k_min + 3, 110]:
        m = np.repeat(np.arange(32), 8)
        o = np.tile(np.arange(8), 32)
        n = 8 * m + o  # < 256: exact in bf16 with the grid exponent k - 3
        vals = (n.astype(np.float64) * 2.0 ** (k - 3)).astype(np.float32)
        bits = (vals.view(np.uint32) >> 16).astype(np.uint16)
        assert np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), vals)
        ks = np.full(len(bits), k, np.int32)
        c, off = bin_index(BF16, bits, ks, offsets=True)
        assert np.array_equal(c, m) and np.array_equal(off, o)
        c, off = bin_index(BF16, bits | np.uint16(0x8000), ks, offsets=True)
        assert np.array_equal(c, -1 - m) and np.array_equal(off, 7 - o)
        # the pattern just below each positive value (one ULP down)
        below = bits[1:] - np.uint16(1)
        c, off = bin_index(BF16, below, ks[1:], offsets=True)
        want_c = np.where(o[1:] == 0, m[1:] - 1, m[1:])
        want_o = np.where(o[1:] == 0, 7, o[1:] - 1)
        assert np.array_equal(c, want_c) and np.array_equal(off, want_o)


def test_bin_index_bf16_exhaustive_on_a_few_grids():
    xs = np.arange(1 << 16, dtype=np.uint16)
    for k in (BF16.k_min, -10, 0, BF16.k_max):
        c, off = bin_index(BF16, xs, np.full(len(xs), k, np.int32), offsets=True)
        sample = np.random.default_rng(k + 500).choice(len(xs), 3000, replace=False)
        for i in sample.tolist():
            assert (int(c[i]), int(off[i])) == ref_bin(BF16, i, k), (hex(i), k)
        # bins are monotone in the value and never beyond the clamp
        assert np.abs(c).max() <= MAX_BIN + 1
        pos = xs[:0x7F81]  # +0 .. +Inf in increasing order
        assert np.all(np.diff(c[pos]) >= 0)


def test_bin_index_e4m3_exhaustive():
    codes = np.arange(256, dtype=np.uint8)
    for k in range(-12, 12):
        check_bins(E4M3, codes, np.full(256, k, np.int32))


@PROPERTY
@given(st.integers(0, 2**32 - 1))
def test_bin_index_fp32_random(seed):
    rng = np.random.default_rng(seed)
    xs = rng.integers(0, 1 << 32, 300, dtype=np.uint64).astype(np.uint32)
    # realistic mu / scale values too
    vals = (rng.standard_normal(300) * 10.0 ** rng.uniform(-6, 4, 300)).astype(np.float32)
    xs = np.concatenate([xs, vals.view(np.uint32)])
    ks = rng.integers(-126, 121, len(xs)).astype(np.int32)
    check_bins(FP32, xs, ks)
