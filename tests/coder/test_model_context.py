"""Tests of ``context`` of the integer probability model (``speckv.coder.model``): the
grid exponent, mu's bin and the table row, checked against independent references in
exact arithmetic (``model_helpers.py``) for BF16 and for FP8 (e4m3 x, fp32 mu in scale
units); ``fp8_log2_sigma`` and the ``table_row`` rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from model_helpers import PROPERTY, check_context, ref_table_row

from speckv.coder.model import BF16, E4M3, FP32, fp8_log2_sigma
from speckv.coder.tables import LAMBDA_MAX, LAMBDA_MIN, N_GAUSS, OFFSETS, CodingTables, table_row

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def tables(ckpt) -> CodingTables:  # ckpt: the shipped checkpoint (conftest.py)
    return ckpt.tables


# --------------------------------------------------------------- context


@PROPERTY
@given(st.integers(0, 2**32 - 1))
def test_context_bf16(tables, seed):
    rng = np.random.default_rng(seed)
    n = 300
    mu = rng.integers(0, 1 << 16, n).astype(np.uint16)
    # realistic mu: normals of moderate size, and values near binade tops
    mu[: n // 3] = (np.float32(rng.standard_normal(n // 3)).view(np.uint32) >> 16).astype(np.uint16)
    mu[n // 3: n // 2] = (mu[n // 3: n // 2] | np.uint16(0x7F)) - rng.integers(0, 4, n // 2 - n // 3).astype(np.uint16)
    L = rng.integers(-200, 70, n).astype(np.int64)
    L[: n // 2] = rng.integers(-88, -11, n // 2)  # the shipped checkpoint's range
    check_context(BF16, BF16, mu, L, tables)


def test_context_bf16_specials(tables):
    mu = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0,
                   0xFFFF, 0x3F80, 0x3FFF, 0xBFFF, 0x3FFE], np.uint16)
    for L in (-300, -88, -40, -12, 0, 40, 300):
        check_context(BF16, BF16, mu, np.full(len(mu), L, np.int64), tables)


@PROPERTY
@given(st.integers(0, 2**32 - 1))
def test_context_fp8(tables, seed):
    """FP8 path: x e4m3, mu an fp32 value in scale units, L shifted by the scale."""
    rng = np.random.default_rng(seed)
    n = 300
    vals = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 3, n)).astype(np.float32)
    vals[:10] = [0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, -448.0, 1e30, 2.0 ** -9, 2.0 ** -6]
    mu = vals.view(np.uint32)
    scales = (10.0 ** rng.uniform(-4, 1, n)).astype(np.float32)
    L = fp8_log2_sigma(rng.integers(-88, -11, n), scales.view(np.uint32))
    # the near-top rule reads mu's own mantissa, which is only its binade on
    # the e4m3 grid for |mu| >= 2^-6 (below, it may pick the coarser grid)
    in_grid = np.abs(vals) >= 2.0 ** E4M3.k_min
    check_context(E4M3, FP32, mu, L, tables, check_near=in_grid)


def test_fp8_log2_sigma():
    L = np.array([-88, -40, 0, 17], np.int64)
    for s in (1.0, 2.0, 0.5, 3.0, 1e-3, 448.0, 1.5, 1.75):
        got = fp8_log2_sigma(L, np.full(4, np.float32(s)).view(np.uint32))
        # log2(s) to within half a 1/8 octave (the model rounds the top 3 mantissa bits)
        assert np.all(np.abs((L - got) / 8 - math.log2(s)) <= 0.125 + 1e-9), s
    ones = fp8_log2_sigma(L, np.full(4, np.float32(1.0)).view(np.uint32))
    assert np.array_equal(ones, L)


def test_table_row_rule():
    lam = np.arange(LAMBDA_MIN - 20, LAMBDA_MAX + 20)
    for off in range(OFFSETS):
        t = table_row(lam, np.full(len(lam), off))
        assert t.tolist() == [ref_table_row(int(v), off) for v in lam]
        assert t.min() >= 0 and t.max() == N_GAUSS - 1
        assert np.all(np.diff(t) >= 0)  # wider sigma -> later row
