"""The native CPU coder (``speckv.coder._native``, wrapped by ``coder/native.py``)
against the numpy reference, which is the oracle, on the values it codes: every
stream is compared byte for byte (whole records with ``==``) and every decode bit for
bit (``np.array_equal`` on the uint16 / uint8 patterns, FP8 scales as uint32).

Checks the extension's constants and flat tables against the Python reference, then
random bit patterns, adversarial values (NaN payloads, +-Inf, subnormals, +-0, the
largest finite values, mu far from x and mu = x, FP8 scales of 0, Inf, NaN, subnormal
and negative) and realistic KV (mu plus small Gaussian noise), both dtypes, both
residual models.

A missing extension skips these tests on a developer's machine and fails them in
CI (SPECKV_REQUIRE_NATIVE, tests/require.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codec_helpers import (
    ADVERSARIAL,
    ALL_CODES,
    LAYERS,
    MU_MODES,
    SCALES,
    _near_mixture,
    bf16_from_float,
    bf16_tensor,
    fp8_mu,
    ids_for,
    mu_variant,
    shape,
    tile,
)
from hypothesis import given
from hypothesis import strategies as st
from native_helpers import (
    EPLS,
    FEW,
    LPCS,
    MODELS,
    SPECIAL_SCALE_BITS,
    as_mu,
    both_ways,
    fp8_kv,
    need_native,
)

from speckv.coder import container as ct
from speckv.coder import model, native, rans, tables
from speckv.coder.codec import Fp8KV
from speckv.coder.native import NativeCoder
from speckv.coder.residual import models_of
from speckv.predictor.fp8 import kv_to_fp8

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ---------------------------------------------------------------- constants


def test_constants_match_the_python_reference():
    need_native()
    want = {
        "PROB_BITS": rans.PROB_BITS, "LANES": rans.LANES, "WORD_BITS": rans.WORD_BITS, "RANS_L": rans.RANS_L,
        "X_MAX_SHIFT": rans.X_MAX_SHIFT, "SIGMA_FRAC_BITS": tables.SIGMA_FRAC_BITS,
        "GRID_BELOW_SIGMA": tables.GRID_BELOW_SIGMA, "LAMBDA_MIN": tables.LAMBDA_MIN,
        "LAMBDA_MAX": tables.LAMBDA_MAX, "OFFSET_BITS": tables.OFFSET_BITS,
        "LAMBDA_OFFSET": tables.LAMBDA_OFFSET, "N_GAUSS": tables.N_GAUSS, "NOOP_TABLE": tables.NOOP_TABLE,
        "MAX_BIN": model.MAX_BIN, "NEAR_TOP_Q8": model.NEAR_TOP_Q8,
        "SHIFT_MAX": tables.SHIFT_MAX,
    }
    assert native.constants() == want
    assert ct.LANES == rans.LANES  # the container's block geometry is the coder's


def test_flat_tables_cover_every_row(ckpt):
    """The tables handed to the extension: one row per Gaussian plus the no-op row."""
    need_native()
    nat = NativeCoder(1)
    for m in models_of(ckpt).values():
        flat = nat.flat(m.tables)
        assert flat is nat.flat(m.tables)  # built once per CodingTables
        assert len(flat.offset) == len(flat.size) == len(flat.radius) == tables.NOOP_TABLE + 1
        assert int(flat.size.sum()) == len(flat.cum) == len(flat.freq)
        assert np.array_equal(flat.offset, m.tables.gauss.offset)


# ------------------------------------------------------ random bit patterns


@FEW
@given(T=st.integers(0, 2), epl=st.one_of(st.sampled_from(EPLS), st.integers(1, 80)),
       lpc=st.one_of(st.sampled_from(LPCS), st.integers(1, 31)), mdl=st.sampled_from(MODELS),
       seed=st.integers(0, 2**32 - 1), as_torch=st.booleans())
def test_random_bit_patterns_bf16(codecs, T, epl, lpc, mdl, seed, as_torch):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 1 << 16, shape(T)).astype(np.uint16)
    mu = rng.integers(0, 1 << 16, shape(T)).astype(np.uint16)
    if rng.random() < 0.5:  # mu = x on a random half
        same = rng.random(x.shape) < 0.5
        mu[same] = x[same]
    both_ways(codecs, x, ids_for(T, seed % 997), as_mu(mu, as_torch), epl, lpc, mdl)


@FEW
@given(T=st.integers(0, 2), epl=st.one_of(st.sampled_from(EPLS), st.integers(1, 80)),
       lpc=st.one_of(st.sampled_from(LPCS), st.integers(1, 31)), mdl=st.sampled_from(MODELS),
       seed=st.integers(0, 2**32 - 1), as_torch=st.booleans())
def test_random_bit_patterns_fp8(codecs, T, epl, lpc, mdl, seed, as_torch):
    """Random codes (NaN codes included), random mu patterns, scales as random fp32 bit
    patterns mixed with special ones."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, shape(T)).astype(np.uint8)
    scale_bits = rng.integers(0, 1 << 32, (LAYERS, 2), dtype=np.uint64).astype(np.uint32)
    special = rng.random((LAYERS, 2)) < 0.4
    scale_bits[special] = rng.choice(np.array(SPECIAL_SCALE_BITS, np.uint32), int(special.sum()))
    mu = rng.integers(0, 1 << 16, shape(T)).astype(np.uint16)
    both_ways(codecs, fp8_kv(codes, scale_bits), ids_for(T, seed % 997), as_mu(mu, as_torch), epl, lpc, mdl)


# ------------------------------------------------------ adversarial values


@pytest.mark.parametrize("mdl", MODELS)
@pytest.mark.parametrize("mode", MU_MODES)
def test_adversarial_bf16(codecs, mode, mdl):
    """NaN payloads, +-Inf, +-0, every subnormal, +-largest finite, binade edges, under
    every mu (mu = x, one ulp off, +-3%, random, negated, NaN, Inf, 0, max, tiny)."""
    x = tile(ADVERSARIAL, 1, seed=3)
    both_ways(codecs, x, ids_for(1), as_mu(mu_variant(x, mode), mode != "random"), 7, 4, mdl)


@pytest.mark.parametrize("mdl", MODELS)
def test_exhaustive_patterns_bf16(codecs, mdl):
    """Every BF16 pattern as x, against mu = x, mu one ulp away and a rotated mu."""
    T = -(-65536 // (LAYERS * 2 * 3 * 64))
    base = tile(np.arange(1 << 16, dtype=np.uint16), T, seed=None)
    for mu in (base, base ^ np.uint16(1), tile(np.roll(np.arange(1 << 16, dtype=np.uint16), 4099), T, seed=None)):
        both_ways(codecs, base, ids_for(T), mu, 64, 30, mdl)


@pytest.mark.parametrize("value", [0x0000, 0x8000, 0x7F7F, 0xFF7F, 0x0001, 0x7FC0, 0xFF80])
@pytest.mark.parametrize("mu_value", [0x0000, 0x7F7F, 0x7FC0, 0xFF80, 0x0001])
def test_constant_tensors_bf16(codecs, value, mu_value):
    x = np.full(shape(1), value, np.uint16)
    both_ways(codecs, x, ids_for(1), np.full(x.shape, mu_value, np.uint16), 3, 7, "tuned")


@pytest.mark.parametrize("mdl", MODELS)
@pytest.mark.parametrize("scale_bits", SPECIAL_SCALE_BITS, ids=[f"{b:08x}" for b in SPECIAL_SCALE_BITS])
def test_fp8_special_scales(codecs, scale_bits, mdl):
    """Every code under a special scale (every other (layer, kv) at 1.0), with mu near the
    dequantised value, random, NaN and the BF16 specials."""
    codes = tile(ALL_CODES, 1)
    scales = np.full((LAYERS, 2), scale_bits, np.uint32)
    scales[::3, 1] = 0x3F800000
    kv = fp8_kv(codes, scales)
    for mode in ("near", "random", "nan"):
        both_ways(codecs, kv, ids_for(1), fp8_mu(codes, np.ones((LAYERS, 2), np.float32), mode), 7, 4, mdl)
    both_ways(codecs, kv, ids_for(1), tile(ADVERSARIAL, 1, seed=5), 7, 4, mdl)


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("mode", ["true", "near", "random", "zero", "nan"])
def test_fp8_all_codes_named_scales(codecs, scale, mode):
    codes = tile(ALL_CODES, 1, seed=9)
    scales = SCALES[scale]
    both_ways(codecs, Fp8KV(codes, scales), ids_for(1), fp8_mu(codes, scales, mode), 5, 7, "tuned")


@FEW
@given(seed=st.integers(0, 2**32 - 1), mdl=st.sampled_from(MODELS), epl=st.sampled_from(EPLS),
       lpc=st.sampled_from(LPCS))
def test_adversarial_mixtures(codecs, seed, mdl, epl, lpc):
    """BF16 specials sprinkled in x and mu, FP8 codes under a mixture of special scales."""
    rng = np.random.default_rng(seed)
    T = int(rng.integers(1, 3))
    x = tile(ADVERSARIAL, T, seed=seed % 1000)
    mu = np.where(rng.random(x.shape) < 0.3, x, rng.choice(ADVERSARIAL, x.shape)).astype(np.uint16)
    both_ways(codecs, x, ids_for(T), mu, epl, lpc, mdl)
    codes = tile(ALL_CODES, T, seed=seed % 1000)
    scales = rng.choice(np.array(SPECIAL_SCALE_BITS, np.uint32), (LAYERS, 2))
    both_ways(codecs, fp8_kv(codes, scales), ids_for(T), mu, epl, lpc, mdl)


# --------------------------------------------------------- realistic KV


@FEW
@given(T=st.integers(1, 3), mdl=st.sampled_from(MODELS), epl=st.sampled_from(EPLS), lpc=st.sampled_from(LPCS),
       log_scale=st.floats(-3, 2), log_rel=st.floats(-4, -0.5), seed=st.integers(0, 2**32 - 1))
def test_realistic_bf16(codecs, T, mdl, epl, lpc, log_scale, log_rel, seed):
    """x = mu + small Gaussian noise (relative and absolute), 1% random patterns."""
    rng = np.random.default_rng(seed)
    mu_f = (rng.standard_normal(shape(T)) * 10.0 ** log_scale).astype(np.float32)
    mu = bf16_from_float(mu_f)
    mu_x = (mu.astype(np.uint32) << 16).view(np.float32)
    noise = rng.standard_normal(shape(T)).astype(np.float32) * np.float32(10.0 ** log_rel)
    x = bf16_from_float(mu_x + noise * np.abs(mu_x))
    both_ways(codecs, x, ids_for(T, seed % 997), as_mu(mu, bool(seed & 1)), epl, lpc, mdl)
    x2 = _near_mixture(rng, mu_x, 0.01)
    both_ways(codecs, x2, ids_for(T, seed % 997), bf16_tensor(mu), epl, lpc, mdl)


@FEW
@given(T=st.integers(1, 3), mdl=st.sampled_from(MODELS), epl=st.sampled_from(EPLS), lpc=st.sampled_from(LPCS),
       seed=st.integers(0, 2**32 - 1))
def test_realistic_fp8(codecs, T, mdl, epl, lpc, seed):
    """kv_to_fp8 of a Gaussian KV; mu the BF16 KV plus 5% noise."""
    rng = np.random.default_rng(seed)
    sc = (10.0 ** rng.uniform(-4, 1, (LAYERS, 2))).astype(np.float32)
    kv_f = (rng.standard_normal(shape(T)) * sc[:, :, None, None, None] * 100).astype(np.float32)
    kv = torch.from_numpy(kv_f).to(torch.bfloat16)
    q, s = kv_to_fp8(kv)
    mu = bf16_from_float(kv.float().numpy() * (1 + 0.05 * rng.standard_normal(shape(T))).astype(np.float32))
    both_ways(codecs, Fp8KV(q.numpy().copy(), s.numpy().copy()), ids_for(T, seed % 997), mu, epl, lpc, mdl)
