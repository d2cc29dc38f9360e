"""Tests of the lossless codec (``speckv.coder.codec``): bit-exact round trips on
real and adversarial KV (BF16 and FP8), property tests over random geometry,
determinism, and typed errors on every kind of corrupt input (golden streams:
``test_codec_golden.py``).

Every comparison is bit for bit (``np.array_equal`` on the uint16 / uint8
patterns). Every corrupt input must raise a ``SpeckvError`` and nothing else.
Apart from one real 64-token prompt (the session-wide embedded model), every
input is synthetic, and the codec is built from the shipped default checkpoint
without loading any model.
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
    PER_TOKEN,
    PROPERTY,
    SCALES,
    _near_mixture,
    _sample_bf16,
    bf16_from_float,
    bf16_tensor,
    fp8_mu,
    ids_for,
    mu_variant,
    round_trip_bf16,
    round_trip_fp8,
    shape,
    stream_bytes,
    tile,
)
from hypothesis import given
from hypothesis import strategies as st

from speckv.coder import container as ct
from speckv.coder.codec import CodecConfig, Fp8KV, bf16_bits
from speckv.predictor.fp8 import kv_to_fp8

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ---------------------------------------------------------- real-model KV

REAL_TEXT = (
    "The history of the lighthouse is a history of light and of the people who kept it. "
    "Before electricity, keepers trimmed wicks through the night, polished lenses at dawn, "
    "and logged every ship that passed the point. Fresnel's lens, built from concentric "
    "rings of glass, bent the light of a single flame into a beam visible twenty miles out "
    "to sea, and within a few decades it had replaced the mirrors of almost every station "
    "along the coast. Today most lights are automated, yet the towers still stand."
)


# wire bits per scalar of REAL_TEXT's first 64 tokens under the shipped checkpoint's
# default codec (make_codec()), measured with
#   .venv/bin/python -m pytest -q -p no:cacheprovider tests/coder/test_codec.py -k real_kv -s
# (479404 and 182560 bytes under the shipped w8a8x:4 checkpoint, 14-bit K/V activations); held within 2%
# (tests/coder/test_compression.py: 512 tokens)
REAL_BF16_BITS = 5.201866319444444
REAL_FP8_BITS = 1.9809027777777777


@pytest.fixture(scope="module")
def real_prefill(embedded_session):
    ids = embedded_session.target.tokenize(REAL_TEXT)[:64]
    assert len(ids) == 64
    pre = embedded_session.prefill(ids)
    assert tuple(pre.kv.shape) == shape(64) and pre.kv.dtype == torch.bfloat16
    assert tuple(pre.mu.shape) == shape(64) and pre.mu.dtype == torch.bfloat16
    return pre


def test_real_kv_bf16_round_trip(make_codec, real_prefill, record_property):
    pre, codec = real_prefill, make_codec()
    records = list(codec.encode(pre.kv, pre.ids, pre.mu))  # torch bf16 input
    out = codec.decode(records, pre.ids, pre.mu)
    assert out.dtype == np.uint16 and np.array_equal(out, bf16_bits(pre.kv))
    bps = 8 * stream_bytes(records) / pre.kv.numel()
    record_property("bf16_bits_per_scalar", round(bps, 4))
    print(f"\nreal 64-token prompt, BF16: {bps!r} bits/scalar ({stream_bytes(records)} bytes)")
    assert bps == pytest.approx(REAL_BF16_BITS, rel=0.02)
    # the same KV given as uint16 bit patterns codes to the same bytes
    assert list(codec.encode(bf16_bits(pre.kv), pre.ids, pre.mu)) == records


def test_real_kv_fp8_round_trip(make_codec, real_prefill, record_property):
    pre, codec = real_prefill, make_codec()
    q, s = kv_to_fp8(pre.kv)
    kv = Fp8KV(q.numpy(), s.numpy())
    records = list(codec.encode(kv, pre.ids, pre.mu))
    out = codec.decode(records, pre.ids, pre.mu)
    assert isinstance(out, Fp8KV)
    assert np.array_equal(out.codes, kv.codes)
    assert np.array_equal(out.scales.view(np.uint32), kv.scales.view(np.uint32))
    bpe = 8 * stream_bytes(records) / q.numel()
    record_property("fp8_bits_per_element", round(bpe, 4))
    print(f"\nreal 64-token prompt, FP8: {bpe!r} bits/element ({stream_bytes(records)} bytes)")
    assert bpe == pytest.approx(REAL_FP8_BITS, rel=0.02)


def test_real_kv_odd_geometry_and_threads(make_codec, real_prefill):
    pre = real_prefill
    x, mu = bf16_bits(pre.kv), bf16_bits(pre.mu)
    ref = round_trip_bf16(make_codec(7, 4, threads=1), x, mu, pre.ids)
    again = round_trip_bf16(make_codec(7, 4, threads=3), x, mu, pre.ids)
    assert again == ref


@pytest.mark.parametrize("T", [0, 1, 3])
@pytest.mark.parametrize("mode", MU_MODES)
def test_adversarial_specials_bf16(make_codec, T, mode):
    """NaN payloads, +-Inf, +-0, every subnormal, max/min finite, under every mu;
    elems_per_lane=7, layers_per_chunk=4: chunks of odd sizes, partial blocks."""
    x = tile(ADVERSARIAL, T, seed=T)
    round_trip_bf16(make_codec(7, 4), x, mu_variant(x, mode), ids_for(T))


@pytest.mark.parametrize("mode", MU_MODES)
def test_uniform_random_patterns_bf16(make_codec, mode):
    x = np.random.default_rng(5).integers(0, 1 << 16, shape(3)).astype(np.uint16)
    round_trip_bf16(make_codec(7, 4), x, mu_variant(x, mode), ids_for(3))


@pytest.mark.parametrize("value", [0x0000, 0x8000, 0x3F80, 0x7F7F, 0xFF7F, 0x0001, 0x7FC0, 0xFF80])
@pytest.mark.parametrize("mode", ["true", "zero", "random", "nan"])
def test_all_equal_tensors_bf16(make_codec, value, mode):
    x = np.full(shape(3), value, np.uint16)
    round_trip_bf16(make_codec(7, 4), x, mu_variant(x, mode), ids_for(3))


@pytest.mark.parametrize("mu_value", [0x7FC0, 0xFFFF, 0x7F80, 0xFF80])
def test_nonfinite_mu_everywhere_bf16(make_codec, mu_value):
    """mu = NaN / Inf everywhere: every element escapes; x is anything."""
    rng = np.random.default_rng(2)
    x = np.concatenate([ADVERSARIAL, rng.integers(0, 1 << 16, 4000).astype(np.uint16)])
    x = tile(x, 2)
    round_trip_bf16(make_codec(7, 4), x, np.full(x.shape, mu_value, np.uint16), ids_for(2))


@pytest.mark.parametrize("mu_value", [0x0000, 0x8000])
def test_zero_mu_huge_x_bf16(make_codec, mu_value):
    x = tile(np.array([0x7F7F, 0xFF7F, 0x7F00, 0x7E80, 0xFE01, 0x6000, 0x5F80], np.uint16), 2)
    round_trip_bf16(make_codec(7, 4), x, np.full(x.shape, mu_value, np.uint16), ids_for(2))


@pytest.mark.parametrize("T", [0, 1, 17])
@pytest.mark.parametrize("epl,lpc", [(7, 4), (1, 30), (1024, 2), (3, 7), (64, 1), (5, 29), (2, 31)])
def test_geometries_bf16(make_codec, T, epl, lpc):
    """Element counts that are not a multiple of the block; chunks of unequal sizes;
    layers_per_chunk above the layer count."""
    rng = np.random.default_rng(T * 100 + epl)
    mu = bf16_from_float(rng.standard_normal(shape(T)).astype(np.float32))
    x = bf16_from_float((mu.astype(np.uint32) << 16).view(np.float32)
                        + 0.02 * rng.standard_normal(shape(T)).astype(np.float32))
    x.reshape(-1)[: len(ADVERSARIAL)] = ADVERSARIAL[: x.size]
    round_trip_bf16(make_codec(epl, lpc), x, mu, ids_for(T))


def test_zero_tokens_stream_layout(make_codec):
    codec = make_codec(7, 4)
    x = np.zeros(shape(0), np.uint16)
    records = round_trip_bf16(codec, x, x, ids_for(0))
    assert len(records) == 1 + 8
    h, _ = ct.unpack_header(records[0])
    for i, r in enumerate(records[1:]):
        c, used = ct.unpack_chunk(r, h)
        assert used == len(r) and c.index == i and c.n_blocks == 0 and c.steps == 0 and not c.bits


EXHAUSTIVE_T = -(-65536 // PER_TOKEN)  # 6 tokens: 69120 >= 65536 scalars


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("mode", ["true", "ulp", "negated", "zero", "one", "random", "shifted", "nan"])
def test_exhaustive_all_65536_patterns_bf16(make_codec, mode, shuffle):
    """Every BF16 bit pattern as x (padded with repeats) against several mu."""
    x = tile(np.arange(1 << 16, dtype=np.uint16), EXHAUSTIVE_T, seed=7 if shuffle else None)
    assert np.unique(x).size == 1 << 16
    round_trip_bf16(make_codec(7, 4), x, mu_variant(x, mode), ids_for(EXHAUSTIVE_T))


def test_exhaustive_patterns_against_every_mu(make_codec):
    """Each of the 65536 patterns as x against each of 65536 patterns as mu, in
    65536 aligned pairs per pass, x rotated by a different stride each pass."""
    base = np.arange(1 << 16, dtype=np.uint16)
    for stride in (1, 255, 4099, 32768):
        x = tile(np.roll(base, stride), EXHAUSTIVE_T, seed=None)
        mu = tile(base, EXHAUSTIVE_T, seed=None)
        round_trip_bf16(make_codec(7, 4), x, mu, ids_for(EXHAUSTIVE_T))


@pytest.mark.parametrize("mode", ["true", "near", "random", "zero", "nan"])
@pytest.mark.parametrize("scale", list(SCALES))
def test_fp8_all_codes(make_codec, scale, mode):
    """All 256 codes (NaN codes 0x7F / 0xFF included) under each scale and mu."""
    codes = tile(ALL_CODES, 1)
    scales = SCALES[scale]
    round_trip_fp8(make_codec(7, 4), codes, scales, fp8_mu(codes, scales, mode), ids_for(1))


@pytest.mark.parametrize("T", [0, 1, 3])
def test_fp8_nan_codes_only(make_codec, T):
    codes = tile(np.array([0x7F, 0xFF], np.uint8), T)
    scales = SCALES["one"]
    for mode in ("true", "zero", "random"):
        round_trip_fp8(make_codec(7, 4), codes, scales, fp8_mu(codes, scales, mode), ids_for(T))


@pytest.mark.parametrize("T", [0, 1, 17])
def test_fp8_zero_kv(make_codec, T):
    """An all-zero KV, through kv_to_fp8 (scale 1.0 on all-zero slices)."""
    kv = torch.zeros(shape(T), dtype=torch.bfloat16)
    q, s = kv_to_fp8(kv)
    assert np.all(s.numpy() == 1.0)
    for mu in (np.zeros(shape(T), np.uint16), fp8_mu(q.numpy(), s.numpy(), "random")):
        round_trip_fp8(make_codec(7, 4), q.numpy(), s.numpy(), mu, ids_for(T))


@pytest.mark.parametrize("scale_value", [0.0, -1.0, float("nan"), float("inf"), 1e-45, 1e-40,
                                         3.4e38, -1e-30])
def test_fp8_degenerate_scales(make_codec, scale_value):
    """Scales kv_to_fp8 never makes (zero, negative, NaN, Inf, subnormal) still code
    losslessly: the scale travels with the stream, the model just predicts worse."""
    codes = tile(ALL_CODES, 1)
    scales = np.full((LAYERS, 2), scale_value, np.float32)
    scales[::3, 1] = 1.0
    for mode in ("near", "random"):
        round_trip_fp8(make_codec(7, 4), codes, scales, fp8_mu(codes, np.ones_like(scales), mode),
                       ids_for(1))


def test_fp8_from_kv_to_fp8_of_adversarial_bf16(make_codec):
    x = tile(ADVERSARIAL, 3)
    q, s = kv_to_fp8(bf16_tensor(x))
    round_trip_fp8(make_codec(7, 4), q.numpy(), s.numpy(), x, ids_for(3))


# ------------------------------------------------------- property tests



geometry = dict(T=st.integers(0, 5), epl=st.integers(1, 64), lpc=st.integers(1, 30),
                threads=st.integers(1, 3), seed=st.integers(0, 2**32 - 1),
                p_random=st.sampled_from([0.0, 0.01, 0.2, 1.0]))


@PROPERTY
@given(**geometry)
def test_property_bf16_round_trip(make_codec, T, epl, lpc, threads, seed, p_random):
    rng = np.random.default_rng(seed)
    mu_f = (rng.standard_normal(shape(T)) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32)
    mu = bf16_from_float(mu_f)
    x = _near_mixture(rng, (mu.astype(np.uint32) << 16).view(np.float32), p_random)
    if rng.random() < 0.3 and x.size:  # sprinkle specials and special mu values
        pos = rng.integers(0, x.size, 50)
        x.reshape(-1)[pos] = rng.choice(ADVERSARIAL, 50)
        mu.reshape(-1)[rng.integers(0, x.size, 50)] = rng.choice(ADVERSARIAL, 50)
    decoder = make_codec(int(rng.integers(1, 65)), int(rng.integers(1, 31)), threads=2)
    round_trip_bf16(make_codec(epl, lpc, threads), x, mu, ids_for(T, seed % 1000), decoder)


@PROPERTY
@given(**geometry)
def test_property_fp8_round_trip(make_codec, T, epl, lpc, threads, seed, p_random):
    rng = np.random.default_rng(seed)
    scales = (10.0 ** rng.uniform(-4, 1, (LAYERS, 2))).astype(np.float32)
    kv_f = (rng.standard_normal(shape(T)) * scales[:, :, None, None, None] * 100).astype(np.float32)
    q, s = kv_to_fp8(torch.from_numpy(kv_f).to(torch.bfloat16))
    codes, scales = q.numpy().copy(), s.numpy()
    wild = rng.random(codes.shape) < p_random
    codes[wild] = rng.integers(0, 256, int(wild.sum())).astype(np.uint8)
    mu = fp8_mu(codes, scales, "near", seed=seed % 1000)
    mu[rng.random(mu.shape) < p_random / 4] = 0x7FC0
    decoder = make_codec(int(rng.integers(1, 65)), int(rng.integers(1, 31)), threads=1)
    round_trip_fp8(make_codec(epl, lpc, threads), codes, scales, mu, ids_for(T, seed % 1000), decoder)


# ---------------------------------------------------------- determinism



def test_encoding_is_deterministic(make_codec):
    x, mu = _sample_bf16()
    ids = ids_for(3)
    first = list(make_codec(7, 4).encode(x, ids, bf16_tensor(mu)))
    assert list(make_codec(7, 4).encode(x, ids, bf16_tensor(mu))) == first
    # the thread count splits the work, never the bytes
    for threads in (1, 3, 8):
        assert list(make_codec(7, 4, threads).encode(x, ids, bf16_tensor(mu))) == first
    # the same values as a torch tensor or a numpy array of patterns
    assert list(make_codec(7, 4).encode(bf16_tensor(x), ids, bf16_tensor(mu))) == first


def test_fp8_encoding_is_deterministic(make_codec):
    codes = tile(ALL_CODES, 2)
    mu = fp8_mu(codes, SCALES["mixed"], "near")
    kv = Fp8KV(codes, SCALES["mixed"])
    first = list(make_codec(5, 3).encode(kv, ids_for(2), bf16_tensor(mu)))
    for threads in (1, 4):
        assert list(make_codec(5, 3, threads).encode(kv, ids_for(2), bf16_tensor(mu))) == first


def test_decoder_config_does_not_matter(make_codec):
    """The stream carries its geometry: a decoder with any CodecConfig decodes it."""
    x, mu = _sample_bf16()
    ids = ids_for(3)
    for enc_cfg in [(7, 4), (1024, 2), (1, 30)]:
        enc = make_codec(*enc_cfg)
        for dec_cfg in [(1, 1, 1), (64, 30, 2), (1024, 2, 3)]:
            round_trip_bf16(enc, x, mu, ids, decoder=make_codec(*dec_cfg))


def test_geometry_changes_the_bytes_not_the_result(make_codec):
    x, mu = _sample_bf16()
    a = round_trip_bf16(make_codec(7, 4), x, mu, ids_for(3))
    b = round_trip_bf16(make_codec(8, 4), x, mu, ids_for(3))
    assert a != b


def test_codec_config_validation():
    for kw in [dict(elems_per_lane=0), dict(elems_per_lane=(1 << 16) + 1), dict(layers_per_chunk=0),
               dict(layers_per_chunk=1 << 16), dict(threads=0), dict(threads=65)]:
        with pytest.raises(ValueError):
            CodecConfig(**kw)
