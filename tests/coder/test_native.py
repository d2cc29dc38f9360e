"""The native CPU coder (``speckv.coder._native``, wrapped by ``coder/native.py``)
against the numpy reference, which is the oracle: every stream is compared byte for
byte (whole records with ``==``), every decode bit for bit (``np.array_equal`` on
the uint16 / uint8 patterns, FP8 scales as uint32), and every corrupt stream must
meet the same fate on both (the same exception type, or identical arrays).

Inputs: random bit patterns, adversarial values (NaN payloads, +-Inf, subnormals,
+-0, the largest finite values, mu far from x and mu = x, FP8 scales of 0, Inf,
NaN, subnormal and negative), realistic KV (mu plus small Gaussian noise), both
dtypes, both residual models, odd geometries (0 and 1 token, 1-layer chunks,
partial last blocks, elems_per_lane 1..1024) and thread counts 1, 2, 3; then the
streaming APIs, random corruption, backend selection and the extension's own
input validation.

A missing extension skips these tests on a developer's machine and fails them in
CI (SPECKV_REQUIRE_NATIVE, tests/require.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace

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
    chunk_areas,
    fp8_mu,
    ids_for,
    mu_variant,
    recrc,
    shape,
    tile,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from require import missing

from speckv.coder import backends, model, native, rans, tables
from speckv.coder import codec as codec_module
from speckv.coder import container as ct
from speckv.coder.codec import Codec, CodecConfig, Fp8KV
from speckv.coder.model import BF16, E4M3
from speckv.coder.native import NativeCoder, NativeUnavailable
from speckv.coder.residual import models_of
from speckv.errors import IntegrityError, RansDecodeError, SpeckvError
from speckv.predictor.fp8 import kv_to_fp8

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# hypothesis: few examples (each one runs the numpy reference), no deadline, no database
FEW = settings(max_examples=20, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

EPLS = (1, 3, 64, 1024)  # elems_per_lane: 32-element blocks .. one block larger than any chunk here
LPCS = (1, 7, 30)  # layers_per_chunk: 1-layer chunks, a short last chunk, one chunk
MODELS = ("seed", "tuned")

# fp32 scales kv_to_fp8 never makes, as bit patterns (the stream carries them verbatim)
SPECIAL_SCALE_BITS = [
    0x00000000, 0x80000000,  # +-0
    0x7F800000, 0xFF800000,  # +-Inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF,  # NaNs (quiet, signalling, payloads)
    0x00000001, 0x00000100, 0x007FFFFF, 0x80000001,  # subnormals
    0x00800000,  # smallest normal
    0x7F7FFFFF, 0xFF7FFFFF,  # +-largest finite
    0x3F800000, 0xBF800000, 0x43E00000,  # 1, -1, 448
    0x3B124925,  # ~1/448
]


def _need_native() -> None:
    if not native.available():
        missing("NATIVE", f"the native coder is not built ({native.IMPORT_ERROR})")


@pytest.fixture(scope="module")
def codecs(ckpt):
    """``codecs(coder, epl, lpc, threads, model)``: one cached Codec per configuration."""
    _need_native()
    cache: dict[tuple, Codec] = {}

    def make(coder: str, epl: int = 7, lpc: int = 4, threads: int = 2, model: str = "tuned") -> Codec:
        key = (coder, epl, lpc, threads, model)
        if key not in cache:
            cfg = CodecConfig(elems_per_lane=epl, layers_per_chunk=lpc, threads=threads, coder=coder, model=model)
            cache[key] = Codec.from_checkpoint(ckpt, cfg)
            assert (cache[key].backend is None) == (coder == "numpy")
        return cache[key]

    return make


# ------------------------------------------------------------------ helpers


def _describe_diff(ref: list[bytes], got: list[bytes]) -> str:
    """Where two streams first differ: record, byte offset and (chunk records) field."""
    if len(ref) != len(got):
        return f"{len(got)} records, the reference has {len(ref)}"
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        if a == b:
            continue
        n = min(len(a), len(b))
        pos = next((k for k in range(n) if a[k] != b[k]), n)
        where = "header"
        if i:
            try:
                areas = chunk_areas(ref[0], a)
                where = next((name for name, (lo, hi) in areas.items() if lo <= pos < hi), "crc")
            except SpeckvError:
                where = "?"
        return (f"record {i} ({where}) first differs at byte {pos} of {len(a)} (native: {len(b)} bytes): "
                f"numpy {a[pos:pos + 8].hex()} native {b[pos:pos + 8].hex()}")
    return "equal"


def assert_same_records(ref: list[bytes], got: list[bytes]) -> None:
    assert got == ref, _describe_diff(ref, got)


def assert_same_kv(a, b) -> None:
    """Bit-for-bit equality of two decoded KV caches (arrays or Fp8KV)."""
    assert type(a) is type(b)
    if isinstance(a, Fp8KV):
        assert a.codes.dtype == b.codes.dtype == np.uint8
        assert np.array_equal(a.codes, b.codes)
        assert np.array_equal(np.ascontiguousarray(a.scales, np.float32).view(np.uint32),
                              np.ascontiguousarray(b.scales, np.float32).view(np.uint32))
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)


def _as_mu(mu_bits: np.ndarray, as_torch: bool):
    """mu as the caller may give it: a torch bfloat16 tensor or numpy uint16 patterns."""
    return bf16_tensor(mu_bits) if as_torch else np.ascontiguousarray(mu_bits, np.uint16)


def both_ways(codecs, kv, ids, mu, epl=7, lpc=4, model="tuned", threads=(2,)) -> list[bytes]:
    """Encode on numpy (threads=2) and on native (each of ``threads``): identical records;
    each backend decodes the other's stream (and its own) to exactly ``kv``."""
    ref_codec = codecs("numpy", epl, lpc, 2, model)
    ref = list(ref_codec.encode(kv, ids, mu))
    nat_codec = None
    for t in threads:
        nat_codec = codecs("native", epl, lpc, t, model)
        assert_same_records(ref, list(nat_codec.encode(kv, ids, mu)))
    assert nat_codec is not None
    want = kv if isinstance(kv, Fp8KV) else np.ascontiguousarray(kv).view(np.uint16)
    if isinstance(want, Fp8KV):
        want = Fp8KV(np.ascontiguousarray(want.codes, np.uint8), np.ascontiguousarray(want.scales, np.float32))
    # native decodes numpy's stream and numpy decodes native's (the same bytes, checked above)
    out_nat = nat_codec.decode(ref, ids, mu)
    out_np = ref_codec.decode(ref, ids, mu)
    assert_same_kv(out_nat, out_np)
    assert_same_kv(out_nat, want)
    return ref


def _fp8(codes: np.ndarray, scale_bits: np.ndarray) -> Fp8KV:
    return Fp8KV(np.ascontiguousarray(codes, np.uint8),
                 np.ascontiguousarray(scale_bits, np.uint32).view(np.float32))


# ---------------------------------------------------------------- constants


def test_constants_match_the_python_reference():
    _need_native()
    want = {
        "PROB_BITS": rans.PROB_BITS, "LANES": rans.LANES, "WORD_BITS": rans.WORD_BITS, "RANS_L": rans.RANS_L,
        "X_MAX_SHIFT": rans.X_MAX_SHIFT, "SIGMA_FRAC_BITS": tables.SIGMA_FRAC_BITS,
        "GRID_BELOW_SIGMA": tables.GRID_BELOW_SIGMA, "LAMBDA_MIN": tables.LAMBDA_MIN,
        "LAMBDA_MAX": tables.LAMBDA_MAX, "OFFSET_BITS": tables.OFFSET_BITS,
        "LAMBDA_OFFSET": tables.LAMBDA_OFFSET, "N_GAUSS": tables.N_GAUSS, "NOOP_TABLE": tables.NOOP_TABLE,
        "MAX_BIN": model.MAX_BIN, "NEAR_TOP_Q8": model.NEAR_TOP_Q8,
    }
    assert native.constants() == want
    assert ct.LANES == rans.LANES  # the container's block geometry is the coder's


def test_flat_tables_cover_every_row(ckpt):
    """The tables handed to the extension: one row per Gaussian plus the no-op row."""
    _need_native()
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
    both_ways(codecs, x, ids_for(T, seed % 997), _as_mu(mu, as_torch), epl, lpc, mdl)


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
    both_ways(codecs, _fp8(codes, scale_bits), ids_for(T, seed % 997), _as_mu(mu, as_torch), epl, lpc, mdl)


# ------------------------------------------------------ adversarial values


@pytest.mark.parametrize("mdl", MODELS)
@pytest.mark.parametrize("mode", MU_MODES)
def test_adversarial_bf16(codecs, mode, mdl):
    """NaN payloads, +-Inf, +-0, every subnormal, +-largest finite, binade edges, under
    every mu (mu = x, one ulp off, +-3%, random, negated, NaN, Inf, 0, max, tiny)."""
    x = tile(ADVERSARIAL, 1, seed=3)
    both_ways(codecs, x, ids_for(1), _as_mu(mu_variant(x, mode), mode != "random"), 7, 4, mdl)


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
    kv = _fp8(codes, scales)
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
    both_ways(codecs, _fp8(codes, scales), ids_for(T), mu, epl, lpc, mdl)


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
    both_ways(codecs, x, ids_for(T, seed % 997), _as_mu(mu, bool(seed & 1)), epl, lpc, mdl)
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


# ------------------------------------------------------------ geometries


def _realistic_pair(T: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    mu = bf16_from_float(rng.standard_normal(shape(T)).astype(np.float32))
    x = bf16_from_float((mu.astype(np.uint32) << 16).view(np.float32)
                        + 0.02 * rng.standard_normal(shape(T)).astype(np.float32))
    x.reshape(-1)[: min(len(ADVERSARIAL), x.size)] = ADVERSARIAL[: x.size]
    return x, mu


@pytest.mark.parametrize("lpc", LPCS)
@pytest.mark.parametrize("epl", EPLS)
def test_geometries(codecs, epl, lpc):
    """One token (384 elements per layer: partial last blocks for every epl but 1 and 3),
    1-layer chunks, a short last chunk, a single chunk; both dtypes, both models."""
    x, mu = _realistic_pair(1, epl * 31 + lpc)
    both_ways(codecs, x, ids_for(1), mu, epl, lpc, "tuned")
    both_ways(codecs, x, ids_for(1), mu, epl, lpc, "seed")
    codes = tile(ALL_CODES, 1, seed=epl)
    both_ways(codecs, Fp8KV(codes, SCALES["mixed"]), ids_for(1), fp8_mu(codes, SCALES["mixed"], "near"),
              epl, lpc, "tuned" if epl % 2 else "seed")


@pytest.mark.parametrize("T", [0, 1, 5])
@pytest.mark.parametrize("epl,lpc", [(1, 1), (5, 29), (33, 31), (2000, 2)])
def test_token_counts_and_partial_blocks(codecs, T, epl, lpc):
    """No tokens (chunks without blocks), 1 token, and 5 tokens (1920 elements a layer),
    with blocks of 32, 160, 1056 and 64000 elements."""
    x, mu = _realistic_pair(T, T * 7 + epl)
    recs = both_ways(codecs, x, ids_for(T), mu, epl, lpc, "tuned")
    h, _ = ct.unpack_header(recs[0])
    for i, r in enumerate(recs[1:]):
        c, _ = ct.unpack_chunk(r, h)
        assert c.n_blocks == h.chunk_blocks(i) == (0 if T == 0 else -(-h.chunk_elements(i) // (32 * epl)))
    codes = tile(ALL_CODES, T, seed=T)
    both_ways(codecs, Fp8KV(codes, SCALES["one"]), ids_for(T), fp8_mu(codes, SCALES["one"], "near"),
              epl, lpc, "seed")


def test_threads_do_not_change_the_bytes(codecs):
    """Thread counts 1, 2 and 3 on both backends: one stream."""
    x, mu = _realistic_pair(3, 17)
    codes = tile(ALL_CODES, 3, seed=17)
    kv8 = Fp8KV(codes, SCALES["mixed"])
    for epl, lpc in ((3, 7), (64, 1), (1024, 30)):
        for kv, m in ((x, mu), (kv8, fp8_mu(codes, SCALES["mixed"], "near"))):
            ref = both_ways(codecs, kv, ids_for(3), m, epl, lpc, "tuned", threads=(1, 2, 3))
            for t in (1, 3):
                assert_same_records(ref, list(codecs("numpy", epl, lpc, t).encode(kv, ids_for(3), m)))
                out = codecs("native", epl, lpc, t).decode(ref, ids_for(3), m)
                assert_same_kv(out, codecs("numpy", epl, lpc, t).decode(ref, ids_for(3), m))


def test_decoder_geometry_is_the_streams(codecs):
    """A native decoder configured with other elems_per_lane / layers_per_chunk / model /
    threads decodes a numpy stream (the stream carries its geometry and model id)."""
    x, mu = _realistic_pair(2, 4)
    ids = ids_for(2)
    for enc in ((3, 7, "seed"), (1024, 1, "tuned")):
        recs = list(codecs("numpy", enc[0], enc[1], 2, enc[2]).encode(x, ids, mu))
        for dec in ((1, 30, 1, "tuned"), (64, 2, 3, "seed")):
            out = codecs("native", *dec).decode(recs, ids, mu)
            assert out.dtype == np.uint16 and np.array_equal(out, x)


# ------------------------------------------------------------ streaming


def _runs(n: int) -> list[range]:
    """Ways to cut chunks 0..n-1 into consecutive runs: all at once, one by one, pairs."""
    cuts = [[range(0, n)], [range(i, i + 1) for i in range(n)], [range(i, min(i + 2, n)) for i in range(0, n, 2)]]
    return [r for cut in cuts for r in cut]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("lpc", LPCS + (4,))
def test_streaming_apis(codecs, dtype, lpc):
    """encode_chunks / encode_chunk write the whole stream's records on both backends;
    decode_run / decode_chunk of either backend's chunks give the layers back."""
    T, epl = 2, 7
    x, mu = _realistic_pair(T, lpc)
    ids = ids_for(T)
    codes = tile(ALL_CODES, T, seed=lpc)
    scales = SCALES["mixed"]
    arr, kv = (x, x) if dtype == "bf16" else (codes, Fp8KV(codes, scales))
    whole = both_ways(codecs, kv, ids, mu, epl, lpc, "tuned")
    cn, cv = codecs("numpy", epl, lpc), codecs("native", epl, lpc)
    h = cn.stream_header(dtype == "bf16", arr.shape, ids)
    assert ct.pack_header(h) == ct.pack_header(cv.stream_header(dtype == "bf16", arr.shape, ids)) == whole[0]
    chunks = {}
    for idx in _runs(h.n_chunks):
        s = h.chunk_layers(idx[0])[0]
        e = sum(h.chunk_layers(idx[-1]))
        sc = scales[s:e] if dtype == "fp8" else None
        ref = [ct.pack_chunk(c) for c in cn.encode_chunks(h, idx, arr[s:e], mu, sc)]
        got = cv.encode_chunks(h, idx, arr[s:e], mu, sc)
        assert_same_records([whole[0]] + ref, [whole[0]] + [ct.pack_chunk(c) for c in got])
        assert ref == whole[1 + idx[0]:1 + idx[-1] + 1]
        for c in got:
            chunks[c.index] = c
        if len(idx) == 1:
            one = cv.encode_chunk(h, idx[0], arr[s:e], mu, sc)
            assert ct.pack_chunk(one) == ref[0]
    dt = np.uint16 if dtype == "bf16" else np.uint8
    for idx in _runs(h.n_chunks):
        s = h.chunk_layers(idx[0])[0]
        e = sum(h.chunk_layers(idx[-1]))
        run = [chunks[i] for i in idx]
        a = cn.decode_run(h, run, mu)
        b = cv.decode_run(h, run, bf16_tensor(mu))
        assert a.dtype == b.dtype == dt and np.array_equal(a, b) and np.array_equal(b, arr[s:e])
        if len(idx) == 1:
            one = cv.decode_chunk(h, run[0], mu)
            assert one.dtype == dt and np.array_equal(one, arr[s:e])


@pytest.mark.parametrize("mdl", MODELS)
def test_streaming_one_layer_one_token(codecs, mdl):
    """A stream of 1-layer chunks of 1 token, each coded and decoded alone on both."""
    x, mu = _realistic_pair(1, 8)
    ids = ids_for(1)
    cn, cv = codecs("numpy", 1024, 1, 1, mdl), codecs("native", 1024, 1, 1, mdl)
    h = cn.stream_header(True, x.shape, ids)
    assert h.n_chunks == LAYERS
    for i in (0, 13, LAYERS - 1):
        a, b = cn.encode_chunk(h, i, x[i:i + 1], mu), cv.encode_chunk(h, i, x[i:i + 1], mu)
        assert ct.pack_chunk(a) == ct.pack_chunk(b)
        assert np.array_equal(cv.decode_chunk(h, a, mu), x[i:i + 1])
        assert np.array_equal(cn.decode_chunk(h, b, mu), x[i:i + 1])


# ------------------------------------------------------------ corruption


def _outcome(codec: Codec, records: list[bytes], ids: np.ndarray, mu):
    """("ok", kv) or (exception type, message) of a whole-stream decode."""
    try:
        return "ok", codec.decode(records, ids, mu)
    except SpeckvError as e:
        return type(e), str(e)


def _raw_outcome(codec: Codec, records: list[bytes], ids: np.ndarray, mu):
    """The backend's decode of the chunks BEFORE the raw-digest check: ("ok", arrays)
    or (exception type, message). A corrupt stream that decodes without a symbol error
    must give the same (wrong) values on both backends, not merely fail its checksum."""
    try:
        h, _ = ct.unpack_header(records[0])
        chunks = [ct.unpack_chunk(r, h)[0] for r in records[1:]]
        if [c.index for c in chunks] != list(range(h.n_chunks)):
            return "indices", [c.index for c in chunks]  # decode_chunks' own check, before any backend
        fmt = BF16 if h.dtype == ct.DTYPE_BF16 else E4M3
        scales = codec_module._scales(chunks) if fmt is E4M3 else None
        plan = codec._plan(None, ids, mu, fmt, scales, model_id=h.model)
        return "ok", [np.asarray(b).astype(np.int64).ravel() for b in codec._decode_batch(plan, h, chunks)]
    except SpeckvError as e:
        return type(e), str(e)


def _same_fate(a, b) -> None:
    kind_a, val_a = a
    kind_b, val_b = b
    assert kind_a == kind_b, f"numpy: {kind_a} {val_a if kind_a != 'ok' else ''}; native: {kind_b} " \
                             f"{val_b if kind_b != 'ok' else ''}"
    if kind_a == "ok":
        if isinstance(val_a, list):
            assert len(val_a) == len(val_b)
            for p, q in zip(val_a, val_b, strict=True):
                assert np.array_equal(p, q)
        else:
            assert_same_kv(val_a, val_b)
    elif kind_a is not RansDecodeError:
        # value checks: the native message is numpy's, prefixed with the chunk
        # (rANS errors name blocks differently: numpy counts across the batch)
        assert val_b == val_a or val_b.endswith(": " + val_a), (val_a, val_b)


@pytest.fixture(scope="module")
def corrupt_base(codecs):
    """Valid streams to corrupt, BF16 (3 chunks) and FP8 (2 chunks) under each residual
    model, with escapes, zero bins and normal elements."""
    x, mu = _realistic_pair(1, 4)
    codes = tile(ALL_CODES, 1, seed=2)
    kv8, mu8 = Fp8KV(codes, SCALES["mixed"]), fp8_mu(codes, SCALES["mixed"], "near")
    out = {}
    for mdl in MODELS:
        for name, kv, m, lpc in (("bf16", x, mu, 10), ("fp8", kv8, mu8, 15)):
            recs = both_ways(codecs, kv, ids_for(1), m, 16, lpc, mdl)
            out[f"{name}-{mdl}"] = (recs, bf16_tensor(m), mdl, lpc)
    return _Quiet(out)


class _Quiet(dict):
    """A dict that hypothesis reports in a few characters (not megabytes of records)."""

    def __repr__(self) -> str:
        return f"<streams {sorted(self)}>"


def _mutate_chunk(c: ct.Chunk, kind: str, a: int, b: int) -> ct.Chunk:
    """A structurally valid chunk (its record packs and parses) with one part changed."""
    rng = np.random.default_rng(a * 7919 + b)
    if kind == "bits_cut":
        return replace(c, bits=c.bits[: max(len(c.bits) - 1 - a % 64, 0)])
    if kind == "bits_grow":
        return replace(c, bits=c.bits + bytes([b & 0xFF]) * (1 + a % 9))
    if kind == "bits_byte":
        if not c.bits:
            return c
        bits = bytearray(c.bits)
        bits[a % len(bits)] ^= 1 + b % 255
        return replace(c, bits=bytes(bits))
    if kind == "word_drop":  # one word less (its block's count too)
        nz = np.flatnonzero(c.word_counts)
        if not len(nz):
            return c
        blk = int(nz[a % len(nz)])
        start = int(c.word_counts[:blk].sum())
        pos = start + b % int(c.word_counts[blk])
        counts = c.word_counts.copy()
        counts[blk] -= 1
        return replace(c, word_counts=counts, words=np.delete(c.words, pos))
    if kind == "word_add":
        blk = a % c.n_blocks
        pos = int(c.word_counts[: blk + 1].sum()) - b % (int(c.word_counts[blk]) + 1)
        counts = c.word_counts.copy()
        counts[blk] += 1
        return replace(c, word_counts=counts, words=np.insert(c.words, pos, np.uint16(rng.integers(0, 1 << 16))))
    if kind == "word_move":  # a word's worth of count from one block to the next
        if c.n_blocks < 2:
            return c
        blk = a % (c.n_blocks - 1)
        counts = c.word_counts.astype(np.int64)
        if counts[blk] == 0:
            return c
        counts[blk] -= 1
        counts[blk + 1] += 1
        return replace(c, word_counts=counts.astype(np.uint32))
    if kind == "state":  # any value, below RANS_L included
        states = c.states.copy()
        states.reshape(-1)[a % states.size] = np.uint32(rng.integers(0, 1 << 32, dtype=np.uint64))
        return replace(c, states=states)
    if kind == "state_swap":
        states = c.states.copy().reshape(-1)
        i, j = a % states.size, b % states.size
        states[i], states[j] = states[j], states[i]
        return replace(c, states=states.reshape(c.states.shape))
    raise ValueError(kind)


CORRUPT = ["bf16-tuned", "fp8-seed", "bf16-seed", "fp8-tuned"]  # corrupt_base's streams
MUTATIONS = ["bits_cut", "bits_grow", "bits_byte", "word_drop", "word_add", "word_move", "state", "state_swap"]


def _check_corrupt(codecs, base, which: str, records: list[bytes]) -> None:
    _, mu, mdl, lpc = base[which]
    ids = ids_for(1)
    cn, cv = codecs("numpy", 16, lpc, 2, mdl), codecs("native", 16, lpc, 2, mdl)
    _same_fate(_outcome(cn, records, ids, mu), _outcome(cv, records, ids, mu))
    raw = _raw_outcome(cn, records, ids, mu)
    _same_fate(raw, _raw_outcome(cv, records, ids, mu))
    if currently_in_test_context():  # --hypothesis-show-statistics: what the corruptions hit
        event(f"before the checksum: {raw[0] if isinstance(raw[0], str) else raw[0].__name__}")
    cv1 = codecs("native", 16, lpc, 1, mdl)  # the thread count never changes the verdict
    _same_fate(_raw_outcome(cn, records, ids, mu), _raw_outcome(cv1, records, ids, mu))


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(CORRUPT), data=st.data())
def test_random_byte_flips_with_valid_crc(codecs, corrupt_base, which, data):
    """1-3 bytes of chunk records changed anywhere (framing, states, counts, words, bits),
    crc recomputed: both backends raise the same error type or decode identically."""
    recs = list(corrupt_base[which][0])
    for _ in range(data.draw(st.integers(1, 3), label="flips")):
        i = data.draw(st.integers(1, len(recs) - 1), label="chunk")
        areas = chunk_areas(recs[0], corrupt_base[which][0][i])
        # mostly the coded data: the bits (value checks, wrong values that decode), the words and states
        weighted = ["bits"] * 4 + ["words"] * 2 + ["states"] * 2 + ["word_counts", "fixed", "bits_len", "aux"]
        area = data.draw(st.sampled_from([k for k in weighted if areas[k][1] > areas[k][0]]), label="area")
        lo, hi = areas[area]
        pos = data.draw(st.integers(lo, hi - 1), label="pos")
        mask = data.draw(st.integers(1, 255), label="mask")
        rec = bytearray(recs[i])
        if pos < len(rec) - 4:
            rec[pos] ^= mask
        recs[i] = recrc(rec)
    _check_corrupt(codecs, corrupt_base, which, recs)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(CORRUPT), kind=st.sampled_from(MUTATIONS), data=st.data())
def test_structural_corruption(codecs, corrupt_base, which, kind, data):
    """Cut / grown bit sections, dropped / added / moved rANS words, changed and swapped
    states, repacked into parseable records."""
    recs = list(corrupt_base[which][0])
    h, _ = ct.unpack_header(recs[0])
    i = data.draw(st.integers(1, len(recs) - 1), label="chunk")
    c, _ = ct.unpack_chunk(recs[i], h)
    a = data.draw(st.integers(0, 1 << 20), label="a")
    b = data.draw(st.integers(0, 1 << 20), label="b")
    recs[i] = ct.pack_chunk(_mutate_chunk(c, kind, a, b))
    _check_corrupt(codecs, corrupt_base, which, recs)


@pytest.mark.parametrize("which", CORRUPT)
def test_truncated_records(codecs, corrupt_base, which):
    """Records cut short (container errors, the same on both) and the stream cut short."""
    recs = corrupt_base[which][0]
    for i in range(len(recs)):
        for cut in (0, 1, 12, 80, len(recs[i]) // 2, len(recs[i]) - 1):
            bad = list(recs)
            bad[i] = recs[i][:cut]
            _check_corrupt(codecs, corrupt_base, which, bad)
            bad[i] = recrc(recs[i][:cut]) if cut >= 4 else bad[i]
            _check_corrupt(codecs, corrupt_base, which, bad)
    _check_corrupt(codecs, corrupt_base, which, recs[:-1])


def test_every_word_of_a_block_zeroed(codecs, corrupt_base):
    """A whole block's words zeroed: a rANS error on both."""
    recs = corrupt_base["bf16-tuned"][0]
    h, _ = ct.unpack_header(recs[0])
    c, _ = ct.unpack_chunk(recs[1], h)
    words = c.words.copy()
    words[: int(c.word_counts[0])] = 0
    bad = list(recs)
    bad[1] = ct.pack_chunk(replace(c, words=words))
    _check_corrupt(codecs, corrupt_base, "bf16-tuned", bad)
    cv = codecs("native", 16, 10, 2, "tuned")
    with pytest.raises(RansDecodeError):
        cv.decode(bad, ids_for(1), corrupt_base["bf16-tuned"][1])


# ------------------------------------------------------------ selection


def test_select_native_when_built():
    _need_native()
    b = backends.select_backend("native", 2)
    assert isinstance(b, NativeCoder) and b.threads == 2 and b.name == "native"
    assert backends.backend_name(b) == "native"
    assert backends.select_backend("numpy", 1) is None
    assert backends.backend_name(None) == "numpy"


def test_select_numpy_and_unknown():
    assert backends.select_backend("numpy", 1) is None
    assert backends.select_backend("numpy", 7) is None
    for bad in ("", "NATIVE", "gpu", "c++", None):
        with pytest.raises(ValueError, match="coder must be one of"):
            backends.select_backend(bad, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="coder must be one of"):
        CodecConfig(coder="native2")
    assert CodecConfig().coder == "auto"
    assert backends.CODERS == ("auto", "native", "numpy", "cuda")


def test_missing_extension_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(native, "_native", None)
    monkeypatch.setattr(native, "IMPORT_ERROR", "No module named 'speckv.coder._native'")
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.delenv("SPECKV_REQUIRE_NATIVE", raising=False)
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    assert not native.available()
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        assert backends.select_backend("native", 1) is None
        assert backends.select_backend("native", 2) is None  # warned once, not per call
        assert backends.select_backend("auto", 1) is None
    warnings = [r for r in caplog.records if r.name == backends.__name__ and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "native coder was not built" in warnings[0].getMessage()
    assert "No module named" in warnings[0].getMessage()
    with pytest.raises(NativeUnavailable):
        NativeCoder(1)
    with pytest.raises(NativeUnavailable):
        native.constants()


def test_missing_extension_codec_is_numpy(monkeypatch, ckpt):
    """A codec asked for the native coder without the extension encodes with numpy."""
    monkeypatch.setattr(native, "_native", None)
    monkeypatch.setattr(backends, "_warned", {"native"})  # no log line needed here
    monkeypatch.delenv("SPECKV_REQUIRE_NATIVE", raising=False)
    codec = Codec.from_checkpoint(ckpt, CodecConfig(coder="native", elems_per_lane=7, layers_per_chunk=4))
    assert codec.backend is None
    x, mu = _realistic_pair(1, 1)
    out = codec.decode(list(codec.encode(x, ids_for(1), mu)), ids_for(1), mu)
    assert np.array_equal(out, x)


@pytest.mark.parametrize("coder", ["native", "auto"])
def test_required_extension_missing_is_an_error(monkeypatch, coder):
    monkeypatch.setattr(native, "_native", None)
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setenv("SPECKV_REQUIRE_NATIVE", "1")
    with pytest.raises(NativeUnavailable, match="SPECKV_REQUIRE_NATIVE"):
        backends.select_backend(coder, 1)
    assert backends.select_backend("numpy", 1) is None  # the reference is always there


def test_cuda_without_a_device_falls_back_to_native(monkeypatch, caplog):
    _need_native()
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    monkeypatch.setattr(backends, "_warned", set())
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        b = backends.select_backend("cuda", 3)
        backends.select_backend("cuda", 3)
    assert isinstance(b, NativeCoder) and b.threads == 3
    msgs = [r.getMessage() for r in caplog.records if r.name == backends.__name__]
    assert len(msgs) == 1 and "--coder cuda" in msgs[0]
    auto = backends.select_backend("auto", 2)  # no device: the native coder, silently
    assert isinstance(auto, NativeCoder) and auto.threads == 2
    assert len([r for r in caplog.records if r.name == backends.__name__]) == 1


# ------------------------------------------------------ input validation


def _all_value_errors(calls) -> None:
    """Each call raises a plain ValueError (a wrong buffer, not a corrupt stream)."""
    for name, call in calls.items():
        with pytest.raises(ValueError) as ei:
            call()
            pytest.fail(f"{name}: accepted")
        assert not isinstance(ei.value, SpeckvError), f"{name}: {type(ei.value).__name__}: {ei.value}"


@pytest.fixture(scope="module")
def nat_case(ckpt):
    """(NativeCoder, CodingTables, log2_sigma, x, prepared mu) of a 1-token BF16 stream."""
    _need_native()
    nat = NativeCoder(2)
    m = models_of(ckpt)[1]  # the seed model: mu as predicted
    x, mu = _realistic_pair(1, 6)
    mu2 = nat.prepare_mu(mu, None, None, None)
    assert np.array_equal(mu2, mu)  # the seed model leaves BF16 mu as it is
    return nat, m.tables, m.log2_sigma, x, mu2


def test_encode_rejects_wrong_buffers(nat_case):
    nat, tab, lg, x, mu = nat_case
    counts = [4] * 7 + [2]
    parts = nat.encode(x, mu, lg, counts, 7, tab)
    assert len(parts) == 8
    bad_calls = {
        "mu one token short": lambda: nat.encode(x, mu[:, :, :, :0], lg, counts, 7, tab),
        "mu one layer short": lambda: nat.encode(x, mu[:-1], lg, counts, 7, tab),
        "mu as uint32": lambda: nat.encode(x, mu.astype(np.uint32), lg, counts, 7, tab),
        "mu as uint8": lambda: nat.encode(x, mu.astype(np.uint8), lg, counts, 7, tab),
        "x as float32": lambda: nat.encode(x.astype(np.float32), mu, lg, counts, 7, tab),
        "x as uint8 (fp8 needs u32 mu)": lambda: nat.encode(x.astype(np.uint8), mu, lg, counts, 7, tab),
        "sigma one layer short": lambda: nat.encode(x, mu, lg[:-1], counts, 7, tab),
        "layers past x": lambda: nat.encode(x, mu, lg, counts + [1], 7, tab),
        "layers short of x": lambda: nat.encode(x, mu, lg, counts[:-1], 7, tab),
        "a zero layer count": lambda: nat.encode(x, mu, lg, [0] + counts, 7, tab),
        "a negative layer count": lambda: nat.encode(x, mu, lg, [-1, 31], 7, tab),
        "elems_per_lane 0": lambda: nat.encode(x, mu, lg, counts, 0, tab),
        "elems_per_lane 65537": lambda: nat.encode(x, mu, lg, counts, 65537, tab),
    }
    _all_value_errors(bad_calls)
    with pytest.raises(ValueError, match="log2 sigma out of range"):
        nat.encode(x, mu, np.full(lg.shape, 1 << 40, np.int64), counts, 7, tab)
    # the coder still works after every rejected call
    again = nat.encode(x, mu, lg, counts, 7, tab)
    assert [(p.bits, p.blocks.words.tobytes(), p.blocks.states.tobytes()) for p in again] == \
        [(p.bits, p.blocks.words.tobytes(), p.blocks.states.tobytes()) for p in parts]


def test_extension_rejects_bad_tables_and_geometry(nat_case):
    nat, tab, lg, x, mu = nat_case
    from speckv.coder import _native  # type: ignore[attr-defined]

    flat = nat.flat(tab)
    L = np.ascontiguousarray(lg, np.int32)
    ok = (False, x, mu, L, 3, 1, 64, 7, [30])
    assert len(_native.encode(*ok, *flat.args(), 1)) == 1
    short_rows = (flat.cum, flat.freq, flat.offset[:-1], flat.size[:-1], flat.radius[:-1])
    with pytest.raises(ValueError, match="tables"):
        _native.encode(*ok, *short_rows, 1)
    with pytest.raises(ValueError, match="freq"):
        _native.encode(*ok, flat.cum, flat.freq[:-1], *flat.args()[2:], 1)
    with pytest.raises(ValueError, match="radius"):
        _native.encode(*ok, *flat.args()[:4], flat.radius[:-1], 1)
    for heads, tokens, dim in ((0, 1, 64), (3, -1, 64), (3, 1, 0)):
        with pytest.raises(ValueError):
            _native.encode(False, x, mu, L, heads, tokens, dim, 7, [30], *flat.args(), 1)
    with pytest.raises(TypeError):
        _native.encode(False, x, mu, L, 3, 1, 64, 7, 30, *flat.args(), 1)  # counts not a sequence
    with pytest.raises(TypeError):
        _native.encode(False, x, mu, L, 3, 1, 64, 7, [30], *flat.args())  # argument missing
    with pytest.raises(TypeError):
        _native.encode(False, [1, 2], mu, L, 3, 1, 64, 7, [30], *flat.args(), 1)  # not a buffer


def test_prepare_mu_rejects_wrong_buffers(nat_case, ckpt):
    nat, _, _, _, mu = nat_case
    tuned = models_of(ckpt)[2]
    a, b = tuned.mu_scale, tuned.mu_shift
    assert a is not None and b is not None
    good = nat.prepare_mu(mu, a, b, None)
    assert good.dtype == np.uint16 and good.shape == mu.shape
    assert np.array_equal(good, tuned.correct(mu, slice(0, LAYERS)))  # the numpy reference's mu'
    with pytest.raises(ValueError):
        nat.prepare_mu(mu, a[:-1], b[:-1], None)
    with pytest.raises(ValueError):
        nat.prepare_mu(mu, a, b[:, :, :, :-1], None)
    with pytest.raises(ValueError):
        nat.prepare_mu(mu, None, None, np.ones((LAYERS - 1, 2), np.float32))
    with pytest.raises(ValueError):
        nat.prepare_mu(mu, None, None, np.ones((LAYERS, 3), np.float32))
    fp8 = nat.prepare_mu(mu, None, None, np.ones((LAYERS, 2), np.float32))
    assert fp8.dtype == np.uint32
    assert np.array_equal(fp8, mu.astype(np.uint32) << 16)  # bf16 / 1.0 in fp32, exactly


def _decode_args(nat_case):
    nat, tab, lg, x, mu = nat_case
    parts = nat.encode(x, mu, lg, [30], 7, tab)
    return nat, tab, lg, x, mu, [(p.blocks, p.bits) for p in parts]


def test_decode_rejects_wrong_buffers(nat_case):
    nat, tab, lg, x, mu, streams = _decode_args(nat_case)
    out = np.empty_like(x)
    nat.decode(mu, lg, [30], 7, streams, tab, out)
    assert np.array_equal(out, x)
    blocks, bits = streams[0]
    bad_calls = {
        "out too small": lambda: nat.decode(mu, lg, [30], 7, streams, tab, np.empty_like(x[:-1])),
        "out as uint32": lambda: nat.decode(mu, lg, [30], 7, streams, tab, np.empty(x.shape, np.uint32)),
        "mu one layer short": lambda: nat.decode(mu[:-1], lg, [30], 7, streams, tab, np.empty_like(x)),
        "sigma wrong shape": lambda: nat.decode(mu, lg[:, :1], [30], 7, streams, tab, np.empty_like(x)),
        "two chunks, one stream": lambda: nat.decode(mu, lg, [15, 15], 7, streams, tab, np.empty_like(x)),
        "one chunk, two streams": lambda: nat.decode(mu, lg, [30], 7, streams * 2, tab, np.empty_like(x)),
        "other elems_per_lane": lambda: nat.decode(mu, lg, [30], 8, streams, tab, np.empty_like(x)),
        "a block too few": lambda: nat.decode(
            mu, lg, [30], 7, [(rans.RansBlocks(blocks.states[:-1], blocks.word_counts[:-1],
                                               blocks.words[:int(blocks.word_counts[:-1].sum())]), bits)],
            tab, np.empty_like(x)),
    }
    _all_value_errors(bad_calls)
    ro = np.empty_like(x)
    ro.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        nat.decode(mu, lg, [30], 7, streams, tab, ro)


def test_decode_rejects_states_below_rans_l(nat_case):
    nat, tab, lg, x, mu, streams = _decode_args(nat_case)
    blocks, bits = streams[0]
    for value in (0, 1, rans.RANS_L - 1):
        states = blocks.states.copy()
        states[len(states) // 2, 5] = value
        with pytest.raises(RansDecodeError, match="below RANS_L"):
            nat.decode(mu, lg, [30], 7, [(rans.RansBlocks(states, blocks.word_counts, blocks.words), bits)],
                       tab, np.empty_like(x))
    # counts that do not add up to the words, and arrays of the wrong dtype: typed errors too
    counts = blocks.word_counts.copy()
    counts[0] += 1
    with pytest.raises(RansDecodeError, match="sum"):
        nat.decode(mu, lg, [30], 7, [(rans.RansBlocks(blocks.states, counts, blocks.words), bits)],
                   tab, np.empty_like(x))
    with pytest.raises(RansDecodeError, match="uint16"):
        nat.decode(mu, lg, [30], 7, [(rans.RansBlocks(blocks.states, blocks.word_counts,
                                                      blocks.words.astype(np.uint32)), bits)],
                   tab, np.empty_like(x))


def test_decode_reports_corruption_as_typed_errors(nat_case):
    """A state at RANS_L or above but wrong, a word flipped, bits cut: RansDecodeError or
    IntegrityError from the status codes, never a crash or a silent success that returns
    the original."""
    nat, tab, lg, x, mu, streams = _decode_args(nat_case)
    blocks, bits = streams[0]
    states = blocks.states.copy()
    states[0, 0] ^= 0x40
    with pytest.raises(RansDecodeError, match="chunk 0, block 0"):
        nat.decode(mu, lg, [30], 7, [(rans.RansBlocks(states, blocks.word_counts, blocks.words), bits)],
                   tab, np.empty_like(x))
    with pytest.raises(IntegrityError, match="chunk 0: bit sections need more than"):
        nat.decode(mu, lg, [30], 7, [(blocks, b"")], tab, np.empty_like(x))
    out = np.empty_like(x)
    try:
        nat.decode(mu, lg, [30], 7, [(blocks, bits[:-1] + bytes([bits[-1] ^ 0x01]))], tab, out)
    except IntegrityError:
        pass
    else:
        assert not np.array_equal(out, x)


def test_decode_status_messages():
    """Every status code of spk_consts.h maps to the numpy decoder's message and type."""
    for status in (1, 2, 3):
        with pytest.raises(RansDecodeError, match=r"^chunk 2, block 5: "):
            native._raise(status, 2, 5, 0, 0)
    expect = {4: "bit sections need more than the 9 bytes present", 8: "expected 9 unary codes, found 4",
              9: "unary codes: 9 bytes for 4 bits", 11: "an element with a non-finite mu was not escaped",
              99: "native decoder status 99"}
    for status, msg in expect.items():
        with pytest.raises(IntegrityError) as ei:
            native._raise(status, 1, 0, 9, 4)
        assert str(ei.value) == f"chunk 1: {msg}"

