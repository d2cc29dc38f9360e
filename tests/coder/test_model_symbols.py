"""Tests of ``symbolize`` -> ``desymbolize`` of the integer probability model
(``speckv.coder.model``): the identity on every bit pattern (BF16 and e4m3), raw
sections exactly as long as the symbols say, non-finite x or mu always escaped, and a
non-escape for non-finite mu rejected."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from model_helpers import E4M3_VALUES, PROPERTY, _bf16_near, _round_trip

from speckv.coder.model import BF16, E4M3, FP32, context, desymbolize, fp8_log2_sigma
from speckv.coder.tables import CodingTables
from speckv.errors import SpeckvError

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def tables(ckpt) -> CodingTables:  # ckpt: the shipped checkpoint (conftest.py)
    return ckpt.tables


# ------------------------------------------------- symbolize / desymbolize


@PROPERTY
@given(st.integers(0, 2**32 - 1))
def test_symbolize_round_trip_bf16(tables, seed):
    rng = np.random.default_rng(seed)
    n = 4000
    mu = rng.integers(0, 1 << 16, n).astype(np.uint16)
    mu[: n // 2] = (np.float32(rng.standard_normal(n // 2)).view(np.uint32) >> 16).astype(np.uint16)
    x = rng.integers(0, 1 << 16, n).astype(np.uint16)
    near = rng.random(n) < 0.7
    x[near] = _bf16_near(rng, mu)[near]
    same = rng.random(n) < 0.1
    x[same] = mu[same]
    L = rng.integers(-120, 50, n).astype(np.int64)
    _round_trip(BF16, BF16, tables, x, mu, L)


@pytest.mark.parametrize("mu_value", [0x0000, 0x8000, 0x3F80, 0xBF80, 0x0001, 0x7F7F, 0xFF7F, 0x7F80,
                                      0x7FC0, 0xFFFF, 0x3FFF])
@pytest.mark.parametrize("L", [-200, -88, -40, -12, 30])
def test_symbolize_round_trip_bf16_every_pattern(tables, mu_value, L):
    x = np.arange(1 << 16, dtype=np.uint16)
    _round_trip(BF16, BF16, tables, x, np.full(len(x), mu_value, np.uint16), np.full(len(x), L, np.int64))


def test_symbolize_round_trip_bf16_x_equals_mu(tables):
    x = np.arange(1 << 16, dtype=np.uint16)
    for L in (-88, -30, 0):
        _round_trip(BF16, BF16, tables, x, x.copy(), np.full(len(x), L, np.int64))


@PROPERTY
@given(st.integers(0, 2**32 - 1))
def test_symbolize_round_trip_fp8(tables, seed):
    rng = np.random.default_rng(seed)
    n = 3000
    x = rng.integers(0, 256, n).astype(np.uint8)
    xv = E4M3_VALUES[x]
    with np.errstate(invalid="ignore"):
        mu_f = (xv * (1 + 0.1 * rng.standard_normal(n))).astype(np.float32)
    wild = rng.random(n) < 0.2
    mu_f[wild] = (rng.standard_normal(int(wild.sum())) * 10.0 ** rng.uniform(-8, 8)).astype(np.float32)
    mu_f[rng.random(n) < 0.02] = np.nan
    mu = mu_f.view(np.uint32)
    scales = (10.0 ** rng.uniform(-4, 1, n)).astype(np.float32)
    L = fp8_log2_sigma(rng.integers(-88, -11, n), scales.view(np.uint32))
    _round_trip(E4M3, FP32, tables, x, mu, L)


def test_symbolize_round_trip_fp8_every_code(tables):
    x = np.tile(np.arange(256, dtype=np.uint8), 20)
    for mu_v in (0.0, -0.0, 1.0, -3.5, 448.0, 1e6, -1e30, 2.0 ** -9, 1e-20, np.inf, np.nan):
        for L in (-120, -40, 0, 40):
            mu = np.full(len(x), mu_v, np.float32).view(np.uint32)
            _round_trip(E4M3, FP32, tables, x, mu, np.full(len(x), L, np.int64))


def test_desymbolize_rejects_non_escape_for_nonfinite_mu(tables):
    mu = np.full(64, 0x7FC0, np.uint16)
    ctx = context(BF16, BF16, mu, np.full(64, -40, np.int64))
    radius = tables.radius[ctx.t]
    for j in (radius, 0 * radius, 2 * radius):
        with pytest.raises(SpeckvError):
            desymbolize(BF16, tables, ctx, j, b"\x00" * 200)
