"""Tests of the lossless codec (``speckv.coder.codec``): bit-exact round trips on
real and adversarial KV (BF16 and FP8), property tests over random geometry,
determinism, golden streams, and typed errors on every kind of corrupt input.

Every comparison is bit for bit (``np.array_equal`` on the uint16 / uint8
patterns). Every corrupt input must raise a ``SpeckvError`` and nothing else.
Apart from one real 64-token prompt (the session-wide embedded model), every
input is synthetic, and the codec is built from the shipped default checkpoint
without loading any model.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.coder import container as ct
from speckv.coder.codec import Codec, CodecConfig, Fp8KV, bf16_bits, digest, prompt_digest
from speckv.coder.container import ChecksumError, FormatError, TruncatedError
from speckv.coder.errors import (
    IntegrityError,
    MuMismatchError,
    PinMismatchError,
    PromptMismatchError,
    SpeckvError,
)
from speckv.coder.fp8 import e4m3_values, kv_to_fp8
from speckv.coder.model import BF16, E4M3, FP32, context, fp8_log2_sigma
from speckv.coder.predictor import default_checkpoint_dir, load_checkpoint
from speckv.coder.rans import LANES, RansDecodeError, rans_encode
from speckv.coder.tables import NOOP_TABLE

LAYERS, HEADS, DIM = 30, 3, 64  # geometry of the shipped default predictor
PER_TOKEN = LAYERS * 2 * HEADS * DIM  # 11520 scalars per token

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

PROPERTY = settings(max_examples=30, deadline=None, database=None)

# ------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(default_checkpoint_dir())


@pytest.fixture(scope="module")
def make_codec(ckpt):
    """``make_codec(elems_per_lane, layers_per_chunk, threads=2, pin=None)``, one
    Codec per configuration (a Codec keeps no per-stream state)."""
    cache: dict[tuple, Codec] = {}
    shared: dict[str, object] = {}

    def make(epl: int = 1024, lpc: int = 2, threads: int = 2, pin: str | None = None) -> Codec:
        key = (epl, lpc, threads, pin)
        if key not in cache:
            cfg = CodecConfig(elems_per_lane=epl, layers_per_chunk=lpc, threads=threads)
            codec = Codec(ckpt.tables, ckpt.calib.sigma_log2_q, pin or ckpt.pin, config=cfg)
            # NOTE: the codec's lazily built BF16 context table depends only on the
            # checkpoint's sigma; build it once for the module, not once per config
            if hasattr(codec, "_bf16_contexts") and hasattr(type(codec), "bf16_contexts"):
                if "bf16" not in shared:
                    shared["bf16"] = codec.bf16_contexts
                codec._bf16_contexts = shared["bf16"]
            cache[key] = codec
        return cache[key]

    return make


def shape(T: int) -> tuple[int, int, int, int, int]:
    return (LAYERS, 2, HEADS, T, DIM)


def ids_for(T: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 49152, T).astype(np.int64)


def bf16_tensor(bits: np.ndarray) -> torch.Tensor:
    """A torch.bfloat16 tensor holding exactly these uint16 bit patterns."""
    a = np.ascontiguousarray(bits, dtype=np.uint16)
    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)


def bf16_from_float(a: np.ndarray) -> np.ndarray:
    """Round float values to BF16 (nearest even, as torch does); uint16 patterns."""
    return bf16_bits(torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16))


def tile(values: np.ndarray, T: int, seed: int | None = 0) -> np.ndarray:
    """``values`` repeated (and shuffled, unless seed is None) into a KV shape."""
    n = PER_TOKEN * T
    out = np.resize(np.asarray(values), n)
    if seed is not None and n:
        out = out[np.random.default_rng(seed).permutation(n)]
    return out.reshape(shape(T))


def stream_bytes(records: list[bytes]) -> int:
    return sum(len(r) for r in records)


def round_trip_bf16(codec: Codec, x: np.ndarray, mu_bits: np.ndarray, ids: np.ndarray,
                    decoder: Codec | None = None) -> list[bytes]:
    """Encode (x as uint16 patterns), decode, compare bit for bit; the records."""
    mu = bf16_tensor(mu_bits)
    records = list(codec.encode(x, ids, mu))
    assert len(records) == 1 + -(-LAYERS // min(codec.config.layers_per_chunk, LAYERS))
    out = (decoder or codec).decode(records, ids, mu)
    assert isinstance(out, np.ndarray) and out.dtype == np.uint16 and out.shape == x.shape
    assert np.array_equal(out, x)
    return records


def round_trip_fp8(codec: Codec, codes: np.ndarray, scales: np.ndarray, mu_bits: np.ndarray,
                   ids: np.ndarray, decoder: Codec | None = None) -> list[bytes]:
    mu = bf16_tensor(mu_bits)
    kv = Fp8KV(np.ascontiguousarray(codes, np.uint8), np.ascontiguousarray(scales, np.float32))
    records = list(codec.encode(kv, ids, mu))
    out = (decoder or codec).decode(records, ids, mu)
    assert isinstance(out, Fp8KV)
    assert out.codes.dtype == np.uint8 and out.codes.shape == codes.shape
    assert np.array_equal(out.codes, codes)
    assert out.scales.dtype == np.float32 and out.scales.shape == (LAYERS, 2)
    assert np.array_equal(out.scales.view(np.uint32), kv.scales.view(np.uint32))
    return records


def recrc(rec: bytes | bytearray) -> bytes:
    """The record with its trailing crc32 recomputed over everything before it."""
    rec = bytearray(rec)
    rec[-4:] = struct.pack("<I", zlib.crc32(bytes(rec[:-4])))
    return bytes(rec)


def flip(rec: bytes, pos: int, mask: int = 0x01) -> bytes:
    b = bytearray(rec)
    b[pos] ^= mask
    return bytes(b)


def chunk_areas(header_rec: bytes, rec: bytes) -> dict[str, tuple[int, int]]:
    """Byte ranges [start, end) of one chunk record's fields (FORMAT.md)."""
    h, _ = ct.unpack_header(header_rec)
    c, _ = ct.unpack_chunk(rec, h)
    s = 68 + len(c.aux)
    w = s + 128 * c.n_blocks
    d = w + 4 * c.n_blocks
    b = d + 2 * c.words.size
    return {"fixed": (4, 68), "aux": (68, s), "states": (s, w), "word_counts": (w, d),
            "words": (d, b), "bits_len": (b, b + 8), "bits": (b + 8, len(rec) - 4)}


def assert_rejected(codec: Codec, records: list[bytes], ids: np.ndarray, mu,
                    expect: type[SpeckvError] | tuple = SpeckvError) -> SpeckvError:
    """decode must raise a SpeckvError (of ``expect``) and nothing else."""
    try:
        out = codec.decode(records, ids, mu)
    except SpeckvError as e:
        assert isinstance(e, expect), f"{type(e).__name__}: {e} (expected {expect})"
        return e
    raise AssertionError(f"corrupt stream decoded without error (shape {getattr(out, 'shape', None)})")


# ---------------------------------------------------------- real-model KV

REAL_TEXT = (
    "The history of the lighthouse is a history of light and of the people who kept it. "
    "Before electricity, keepers trimmed wicks through the night, polished lenses at dawn, "
    "and logged every ship that passed the point. Fresnel's lens, built from concentric "
    "rings of glass, bent the light of a single flame into a beam visible twenty miles out "
    "to sea, and within a few decades it had replaced the mirrors of almost every station "
    "along the coast. Today most lights are automated, yet the towers still stand."
)


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
    print(f"\nreal 64-token prompt, BF16: {bps:.3f} bits/scalar ({stream_bytes(records)} bytes)")
    assert bps < 8.0
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
    print(f"\nreal 64-token prompt, FP8: {bpe:.3f} bits/element ({stream_bytes(records)} bytes)")
    assert bpe < 8.0


def test_real_kv_odd_geometry_and_threads(make_codec, real_prefill):
    pre = real_prefill
    x, mu = bf16_bits(pre.kv), bf16_bits(pre.mu)
    ref = round_trip_bf16(make_codec(7, 4, threads=1), x, mu, pre.ids)
    again = round_trip_bf16(make_codec(7, 4, threads=3), x, mu, pre.ids)
    assert again == ref


# ------------------------------------------------------- adversarial BF16

NAN_PAYLOADS = [0x7FC0, 0x7F81, 0x7FFF, 0x7FA5, 0xFFFF, 0xFF81, 0xFFC0, 0xFFA5]
SPECIALS = NAN_PAYLOADS + [
    0x7F80, 0xFF80,  # +-Inf
    0x0000, 0x8000,  # +-0
    0x7F7F, 0xFF7F,  # max / min finite
    0x0080, 0x8080,  # smallest normals
    0x3F80, 0xBF80, 0x3F7F, 0x4000, 0x7F00, 0x0100,  # +-1, binade edges
]
SUBNORMALS = list(range(0x0001, 0x0080)) + list(range(0x8001, 0x8080))
ADVERSARIAL = np.array(SPECIALS + SUBNORMALS, np.uint16)


def mu_variant(x: np.ndarray, mode: str, seed: int = 1) -> np.ndarray:
    """A mu (uint16 patterns) for x: the truth, near it, or wildly wrong."""
    rng = np.random.default_rng(seed)
    if mode == "true":
        return x.copy()
    if mode == "ulp":  # neighbouring pattern (crosses binades / into NaN at the edges)
        return x ^ np.uint16(1)
    if mode == "shifted":  # +-3% in value, rounded to bf16
        xf = (x.astype(np.uint32) << 16).view(np.float32)
        return bf16_from_float(xf * np.where(rng.random(x.shape) < 0.5, 1.03, 0.97).astype(np.float32))
    if mode == "random":
        return rng.integers(0, 1 << 16, x.shape).astype(np.uint16)
    if mode == "negated":
        return x ^ np.uint16(0x8000)
    const = {"nan": 0x7FC0, "nan_payload": 0xFF81, "inf": 0x7F80, "-inf": 0xFF80, "zero": 0x0000,
             "negzero": 0x8000, "one": 0x3F80, "max": 0x7F7F, "tiny": 0x0001}
    return np.full(x.shape, const[mode], np.uint16)


MU_MODES = ["true", "ulp", "shifted", "random", "negated", "nan", "nan_payload", "inf", "-inf",
            "zero", "negzero", "one", "max", "tiny"]


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


# ------------------------------------------------------------------- FP8

ALL_CODES = np.arange(256, dtype=np.uint8)
E4M3_VALUES = e4m3_values()  # float64 value of each code (NaN for 0x7F / 0xFF)


def fp8_mu(codes: np.ndarray, scales: np.ndarray, mode: str, seed: int = 3) -> np.ndarray:
    """mu (bf16 patterns) for FP8 codes: dequantised, perturbed, zero, random or NaN."""
    rng = np.random.default_rng(seed)
    deq = (E4M3_VALUES[codes] * scales.astype(np.float64)[:, :, None, None, None]).astype(np.float32)
    if mode == "true":
        return bf16_from_float(deq)
    if mode == "near":
        return bf16_from_float(deq * (1 + 0.05 * rng.standard_normal(codes.shape)).astype(np.float32))
    if mode == "random":
        return rng.integers(0, 1 << 16, codes.shape).astype(np.uint16)
    if mode == "zero":
        return np.zeros(codes.shape, np.uint16)
    if mode == "nan":
        return np.full(codes.shape, 0x7FC0, np.uint16)
    raise ValueError(mode)


SCALES = {
    "one": np.ones((LAYERS, 2), np.float32),
    "tiny": np.full((LAYERS, 2), 1e-30, np.float32),
    "huge": np.full((LAYERS, 2), 1e30, np.float32),
    "mixed": np.array([[1e-30, 1e30], [1.0, 3.0e-3], [448.0, 1 / 448]] * 10, np.float32),
}


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


def _near_mixture(rng: np.random.Generator, mu_f: np.ndarray, p_random: float) -> np.ndarray:
    """x as BF16 patterns: mu + small noise, with a fraction of random 16-bit patterns."""
    noise = rng.standard_normal(mu_f.shape).astype(np.float32)
    rel = np.float32(10.0 ** rng.uniform(-4, -0.5))
    x = bf16_from_float(mu_f + noise * (np.abs(mu_f) * rel + np.float32(10.0 ** rng.uniform(-6, -1))))
    wild = rng.random(mu_f.shape) < p_random
    x[wild] = rng.integers(0, 1 << 16, int(wild.sum())).astype(np.uint16)
    return x


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


def _sample_bf16(T: int = 3, seed: int = 11) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    mu_f = rng.standard_normal(shape(T)).astype(np.float32)
    mu = bf16_from_float(mu_f)
    return _near_mixture(rng, mu_f, 0.01), mu


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


# --------------------------------------------------------- golden vectors


def _golden_bf16_a() -> tuple[np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(20260508)
    mu_f = (0.5 * rng.standard_normal(shape(1))).astype(np.float32)
    x = bf16_from_float(mu_f + (0.01 * rng.standard_normal(shape(1))).astype(np.float32))
    return x, bf16_from_float(mu_f), 1


def _golden_bf16_b() -> tuple[np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(7)
    x = tile(ADVERSARIAL, 2, seed=7)
    mu = rng.integers(0, 1 << 16, shape(2)).astype(np.uint16)
    mu.reshape(-1)[::3] = x.reshape(-1)[::3]
    return x, mu, 2


def _golden_fp8() -> tuple[Fp8KV, np.ndarray, int]:
    rng = np.random.default_rng(99)
    kv = torch.from_numpy((2.0 * rng.standard_normal(shape(2))).astype(np.float32)).to(torch.bfloat16)
    q, s = kv_to_fp8(kv)
    codes = q.numpy().copy()
    codes.reshape(-1)[:256] = ALL_CODES
    mu = bf16_from_float(kv.float().numpy() * (1 + 0.05 * rng.standard_normal(shape(2))).astype(np.float32))
    return Fp8KV(codes, s.numpy()), mu, 2


# (name, input, (elems_per_lane, layers_per_chunk), sha256 of the stream, its length)
# NOTE: these pin the byte format AND the probability model / tables. If a change
# to either is intended, update them (and say so); otherwise a failure is a bug.
GOLDEN = [
    ("bf16_a", _golden_bf16_a, (4, 8),
     "01920847a3824ed826123b5b437ff3e0fd2db17c9173e210b1e2f4533ca7fcaa", 20132),
    ("bf16_b", _golden_bf16_b, (5, 30),
     "bd62b6c87b7c8e85ca9cc49a8a0607343ead148ddd98f3b0be91ccad922e78c1", 270499),
    ("fp8", _golden_fp8, (3, 16),
     "f96a90e7beacb717efec67ee656465604c61cd4da1e8b2c81bc786074867b60c", 33706),
]


@pytest.mark.parametrize("name,build,cfg,sha,length", GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_streams(make_codec, name, build, cfg, sha, length):
    kv, mu, T = build()
    codec = make_codec(*cfg)
    ids = np.arange(100, 100 + T, dtype=np.int64)
    records = list(codec.encode(kv, ids, bf16_tensor(mu)))
    stream = b"".join(records)
    out = codec.decode(records, ids, bf16_tensor(mu))
    if isinstance(kv, Fp8KV):
        assert np.array_equal(out.codes, kv.codes)
    else:
        assert np.array_equal(out, kv)
    assert (hashlib.sha256(stream).hexdigest(), len(stream)) == (sha, length)


# ------------------------------------------------------------------ errors


@pytest.fixture(scope="module")
def small_stream(make_codec):
    """(codec, records, ids, mu) of a small BF16 stream: 3 chunks of 10 layers."""
    codec = make_codec(16, 10)
    x, mu = _sample_bf16(T=1, seed=4)
    x.reshape(-1)[: len(ADVERSARIAL)] = ADVERSARIAL  # escapes, zero-bin and normal elements
    ids = ids_for(1)
    records = round_trip_bf16(codec, x, mu, ids)
    return codec, records, ids, bf16_tensor(mu)


@pytest.fixture(scope="module")
def fp8_stream(make_codec):
    codec = make_codec(16, 15)
    codes = tile(ALL_CODES, 1)
    scales = SCALES["mixed"]
    mu = fp8_mu(codes, scales, "near")
    ids = ids_for(1)
    records = round_trip_fp8(codec, codes, scales, mu, ids)
    return codec, records, ids, bf16_tensor(mu)


def test_every_header_byte_flip_is_rejected(small_stream):
    codec, records, ids, mu = small_stream
    for pos in range(len(records[0])):
        for mask in (0x01, 0x80):
            assert_rejected(codec, [flip(records[0], pos, mask)] + records[1:], ids, mu,
                            (FormatError, TruncatedError))


def test_every_header_field_change_with_valid_crc_is_rejected(small_stream):
    codec, records, ids, mu = small_stream
    for pos in range(len(records[0]) - 4):
        for mask in (0x01, 0x40):
            bad = recrc(flip(records[0], pos, mask))
            assert_rejected(codec, [bad] + records[1:], ids, mu)


@pytest.mark.parametrize("which", ["bf16", "fp8"])
def test_byte_flips_in_chunks_fail_the_crc(small_stream, fp8_stream, which):
    codec, records, ids, mu = small_stream if which == "bf16" else fp8_stream
    for i in range(1, len(records)):
        rec = records[i]
        positions = sorted(set(range(0, len(rec), 3)) | set(range(len(rec) - 12, len(rec))))
        for pos in positions:
            bad = list(records)
            bad[i] = flip(rec, pos, 1 << (pos % 8))
            assert_rejected(codec, bad, ids, mu, FormatError)


def _positions(lo: int, hi: int, n: int) -> list[int]:
    if hi <= lo:
        return []
    return sorted(set(np.linspace(lo, hi - 1, min(n, hi - lo)).astype(int).tolist()))


@pytest.mark.parametrize("which", ["bf16", "fp8"])
@pytest.mark.parametrize("area", ["fixed", "aux", "states", "word_counts", "words", "bits_len", "bits"])
def test_bit_flips_with_valid_crc_are_rejected(small_stream, fp8_stream, which, area):
    """A corrupted chunk whose crc32 was recomputed: the codec's own checks
    (rANS final states, bit sections, raw digest, mu fingerprint) must catch it."""
    codec, records, ids, mu = small_stream if which == "bf16" else fp8_stream
    expect = (IntegrityError, RansDecodeError, FormatError, MuMismatchError)
    n_tried = 0
    for i in range(1, len(records)):
        lo, hi = chunk_areas(records[0], records[i])[area]
        for k, pos in enumerate(_positions(lo, hi, 40)):
            bad = list(records)
            bad[i] = recrc(flip(records[i], pos, 1 << ((pos + k) % 8)))
            assert_rejected(codec, bad, ids, mu, expect)
            n_tried += 1
    assert n_tried or area == "aux" and which == "bf16"


def test_dropped_last_record(small_stream):
    codec, records, ids, mu = small_stream
    assert_rejected(codec, records[:-1], ids, mu, IntegrityError)
    assert_rejected(codec, records[:1], ids, mu, IntegrityError)


def test_empty_stream(small_stream):
    codec, records, ids, mu = small_stream
    assert_rejected(codec, [], ids, mu)
    assert_rejected(codec, iter([]), ids, mu)


@pytest.mark.parametrize("cut", [0, 1, 3, 4, 11, 12, 79, 80, -5, -4, -1])
def test_record_cut_short(small_stream, cut):
    codec, records, ids, mu = small_stream
    for i in range(len(records)):
        bad = list(records)
        bad[i] = records[i][:cut]
        assert_rejected(codec, bad, ids, mu, (TruncatedError, FormatError))


def test_extra_trailing_record(small_stream):
    codec, records, ids, mu = small_stream
    assert_rejected(codec, records + [records[-1]], ids, mu, IntegrityError)  # duplicate
    assert_rejected(codec, records + [records[1]], ids, mu, IntegrityError)
    assert_rejected(codec, records + [b"garbage!" * 20], ids, mu, FormatError)
    assert_rejected(codec, records + [b""], ids, mu, TruncatedError)
    assert_rejected(codec, records + [records[0]], ids, mu, FormatError)  # a second header


def test_trailing_bytes_inside_a_record(small_stream):
    """A record followed by extra bytes (e.g. two records glued together) is not a
    valid record: FORMAT.md forbids anything after the last chunk record."""
    codec, records, ids, mu = small_stream
    for i in range(len(records)):
        for extra in (b"\0", b"junk", records[-1]):
            bad = list(records)
            bad[i] = records[i] + extra
            assert_rejected(codec, bad, ids, mu, FormatError)
    # the whole stream passed as one record
    assert_rejected(codec, [b"".join(records)], ids, mu)


def test_garbage_bytes(small_stream):
    codec, records, ids, mu = small_stream
    rng = np.random.default_rng(0)
    for n in (1, 4, 50, 110, 111, 500, 5000):
        junk = rng.integers(0, 256, n).astype(np.uint8).tobytes()
        assert_rejected(codec, [junk] + records[1:], ids, mu, FormatError)
        assert_rejected(codec, records[:1] + [junk] + records[2:], ids, mu, FormatError)
        # valid magic, garbage after it
        assert_rejected(codec, [b"SPKV" + junk] + records[1:], ids, mu, FormatError)
        assert_rejected(codec, records[:1] + [b"SPKC" + junk] + records[2:], ids, mu, FormatError)


def test_chunks_reordered(small_stream):
    codec, records, ids, mu = small_stream
    h, c = records[0], records[1:]
    for order in ([1, 0, 2], [0, 2, 1], [2, 1, 0], [0, 0, 2], [0, 1, 1]):
        assert_rejected(codec, [h] + [c[k] for k in order], ids, mu, IntegrityError)
    assert_rejected(codec, [c[0], h] + c[1:], ids, mu, FormatError)  # header not first


def test_wrong_pin(small_stream, make_codec, ckpt):
    codec, records, ids, mu = small_stream
    for pin in ("00" * 32, hashlib.sha256(b"another predictor").hexdigest(),
                ckpt.pin[:-1] + ("0" if ckpt.pin[-1] != "0" else "1")):
        other = make_codec(16, 10, pin=pin)
        assert_rejected(other, records, ids, mu, PinMismatchError)
        # and a stream written under another pin is refused by the real one
        x = codec.decode(records, ids, mu)
        assert_rejected(codec, list(other.encode(x, ids, mu)), ids, mu, PinMismatchError)


def test_mu_mismatch(small_stream):
    codec, records, ids, mu = small_stream
    bits = bf16_bits(mu).copy()
    for pos in (0, 5000, bits.size - 1):  # first, middle and last chunk
        other = bits.copy()
        other.reshape(-1)[pos] ^= 1  # one ULP in one scalar
        e = assert_rejected(codec, records, ids, bf16_tensor(other), MuMismatchError)
        assert "chunk" in str(e)


def test_mu_mismatch_fp8(fp8_stream):
    codec, records, ids, mu = fp8_stream
    other = bf16_bits(mu).copy()
    other.reshape(-1)[1234] ^= 1
    assert_rejected(codec, records, ids, bf16_tensor(other), MuMismatchError)


def test_wrong_prompt(small_stream):
    codec, records, ids, mu = small_stream
    assert_rejected(codec, records, ids + 1, mu, PromptMismatchError)
    assert_rejected(codec, records, np.concatenate([ids, ids]), mu, PromptMismatchError)
    assert_rejected(codec, records, ids[:0], mu, PromptMismatchError)
    assert_rejected(codec, records, ids.astype(np.int32) + 7, mu, PromptMismatchError)
    # the digest is of the int64 values, whatever the caller's dtype
    assert prompt_digest(ids.astype(np.int32)) == prompt_digest(ids)


def test_stream_dtype_swapped(small_stream, fp8_stream):
    """A BF16 header claiming FP8 (and vice versa), crc recomputed."""
    for codec, records, ids, mu in (small_stream, fp8_stream):
        hdr = bytearray(records[0])
        hdr[8] = 3 - hdr[8]
        assert_rejected(codec, [recrc(hdr)] + records[1:], ids, mu)


# ----------------------------------------------- crafted malicious streams


def _craft(codec: Codec, fmt, mu_bits: np.ndarray, ids: np.ndarray, choose, bits: bytes = b"",
           scales: np.ndarray | None = None) -> list[bytes]:
    """A well-framed stream (valid crcs, right mu fingerprint) whose rANS symbols
    are ``choose(radius, rng)`` rather than the encoder's, with raw ``bits``."""
    T = mu_bits.shape[3]
    h = ct.StreamHeader(dtype=ct.DTYPE_BF16 if fmt is BF16 else ct.DTYPE_FP8, model=1,
                        pin=bytes.fromhex(codec.pin), shape=shape(T), prompt_digest=prompt_digest(ids),
                        elems_per_lane=codec.config.elems_per_lane,
                        layers_per_chunk=min(codec.config.layers_per_chunk, LAYERS))
    lg = codec.log2_sigma
    if fmt is BF16:
        mu_c, fm = mu_bits, BF16
    else:
        y = (mu_bits.astype(np.uint32) << 16).view(np.float32) / scales[:, :, None, None, None]
        mu_c, fm = y.view(np.uint32), FP32
        lg = fp8_log2_sigma(lg, scales.view(np.uint32)[:, :, None, None])
    g, rng = codec.tables.gauss, np.random.default_rng(0)
    records = [ct.pack_header(h)]
    for i in range(h.n_chunks):
        start, count = h.chunk_layers(i)
        sl = slice(start, start + count)
        m = mu_c[sl]
        ctx = context(fmt, fm, m.ravel(), np.broadcast_to(lg[sl][:, :, :, None, :], m.shape).ravel())
        radius = codec.tables.radius[ctx.t]
        j = np.asarray(choose(radius, rng), np.int64)
        n = h.chunk_elements(i)
        size = h.chunk_blocks(i) * h.elems_per_lane * LANES
        idx = np.full(size, g.offset[NOOP_TABLE], np.int64)
        idx[:n] = g.offset[ctx.t] + j
        grid = (h.chunk_blocks(i), h.elems_per_lane, LANES)
        rb = rans_encode(g.cum[idx].reshape(grid), g.freq[idx].reshape(grid))
        aux = b"" if scales is None else scales[sl].astype("<f4").tobytes()
        records.append(ct.pack_chunk(ct.Chunk(
            index=i, layer_start=start, layer_count=count, steps=h.elems_per_lane if n else 0,
            mu_fingerprint=digest(m.tobytes()), raw_digest=bytes(16), aux=aux, states=rb.states,
            word_counts=rb.word_counts, words=rb.words, bits=bits)))
    return records


CHOICES = {
    "centre": lambda r, rng: r,  # d = 0: mu's own bin
    "low_edge": lambda r, rng: 0 * r,  # d = -R
    "high_edge": lambda r, rng: 2 * r,  # d = +R
    "escape": lambda r, rng: 2 * r + 1,
    "random": lambda r, rng: rng.integers(0, 2 * r + 2),
}


@pytest.mark.parametrize("choice", list(CHOICES))
@pytest.mark.parametrize("mu_value", [0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F7F, 0xFF7F, 0x0000, 0x8000,
                                      0x0001, 0x3F80])
@pytest.mark.parametrize("bits", [b"", b"\xff" * 64, bytes(range(256)) * 40])
def test_crafted_symbols_bf16(make_codec, choice, mu_value, bits):
    """Symbols no encoder emits (non-escapes for non-finite mu, bins past the
    largest finite value, raw sections of the wrong size) must be typed errors."""
    codec = make_codec(8, 16)
    T = 1
    ids = ids_for(T)
    mu = np.full(shape(T), mu_value, np.uint16)
    records = _craft(codec, BF16, mu, ids, CHOICES[choice], bits)
    assert_rejected(codec, records, ids, bf16_tensor(mu))


@pytest.mark.parametrize("choice", list(CHOICES))
@pytest.mark.parametrize("mu_value", [1e6, -1e6, 0.0, 3.0e38, float("inf"), float("nan")])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e30])
def test_crafted_symbols_fp8(make_codec, choice, mu_value, scale):
    codec = make_codec(8, 16)
    T = 1
    ids = ids_for(T)
    mu = bf16_from_float(np.full(shape(T), mu_value, np.float32))
    scales = np.full((LAYERS, 2), scale, np.float32)
    for bits in (b"", b"\x55" * 3000):
        records = _craft(codec, E4M3, mu, ids, CHOICES[choice], bits, scales)
        assert_rejected(codec, records, ids, bf16_tensor(mu))
