"""Shared helpers of the native-coder tests (test_native_*.py): hypothesis settings,
the geometries and special FP8 scales they sweep, a per-module cache of numpy / native
codecs, the byte-for-byte and bit-for-bit comparisons, and ``both_ways`` (encode on both
backends, identical records; each decodes the other's stream to the input; the same for the
version 2 stream, every chunk coded even where version 3's size guard stores it).

Not a test module. A missing extension skips the tests that need it on a developer's
machine and fails them in CI (SPECKV_REQUIRE_NATIVE, tests/require.py).
"""

from __future__ import annotations

import numpy as np
from codec_helpers import ADVERSARIAL, bf16_from_float, bf16_tensor, chunk_areas, shape, unguarded_records
from hypothesis import HealthCheck, settings
from require import missing

from speckv.coder import native
from speckv.coder.codec import Codec, CodecConfig, Fp8KV
from speckv.errors import SpeckvError

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


def need_native() -> None:
    if not native.available():
        missing("NATIVE", f"the native coder is not built ({native.IMPORT_ERROR})")


def native_codecs(ckpt):
    """``codecs(coder, epl, lpc, threads, model)``: one cached Codec per configuration
    (each test module's ``codecs`` fixture holds one)."""
    need_native()
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


def as_mu(mu_bits: np.ndarray, as_torch: bool):
    """mu as the caller may give it: a torch bfloat16 tensor or numpy uint16 patterns."""
    return bf16_tensor(mu_bits) if as_torch else np.ascontiguousarray(mu_bits, np.uint16)


def both_ways(codecs, kv, ids, mu, epl=7, lpc=4, model="tuned", threads=(2,)) -> list[bytes]:
    """Encode on numpy (threads=2) and on native (each of ``threads``): identical records;
    each backend decodes the other's stream (and its own) to exactly ``kv``. The same for the
    version 2 stream (every chunk coded: adversarial chunks the size guard stores in version 3
    still meet both coders). Returns numpy's version 3 records."""
    ref_codec = codecs("numpy", epl, lpc, 2, model)
    ref = list(ref_codec.encode(kv, ids, mu))
    ref2 = unguarded_records(ref_codec, kv, ids, mu)
    nat_codec = None
    for t in threads:
        nat_codec = codecs("native", epl, lpc, t, model)
        assert_same_records(ref, list(nat_codec.encode(kv, ids, mu)))
        assert_same_records(ref2, unguarded_records(nat_codec, kv, ids, mu))
    assert nat_codec is not None
    want = kv if isinstance(kv, Fp8KV) else np.ascontiguousarray(kv).view(np.uint16)
    if isinstance(want, Fp8KV):
        want = Fp8KV(np.ascontiguousarray(want.codes, np.uint8), np.ascontiguousarray(want.scales, np.float32))
    # native decodes numpy's stream and numpy decodes native's (the same bytes, checked above)
    for records in (ref, ref2):
        out_nat = nat_codec.decode(records, ids, mu)
        out_np = ref_codec.decode(records, ids, mu)
        assert_same_kv(out_nat, out_np)
        assert_same_kv(out_nat, want)
    if native.vector_path():
        scalar_path_too(nat_codec, kv, ids, mu, ref, want)
    return ref


def scalar_path_too(nat_codec, kv, ids, mu, ref: list[bytes], want) -> None:
    """The native coder's scalar path (the fallback of CPUs without AVX2) on the same input and,
    where "auto" runs the AVX-512 build of the vector stages, their AVX2 build: the same
    records, the same decode."""
    backend = nat_codec.backend
    try:
        for path in ["lookup"] + (["vector"] if native.wide_path() else []):
            backend.path = path
            assert_same_records(ref, list(nat_codec.encode(kv, ids, mu)))
            assert_same_kv(nat_codec.decode(ref, ids, mu), want)
    finally:
        backend.path = "auto"


def fp8_kv(codes: np.ndarray, scale_bits: np.ndarray) -> Fp8KV:
    return Fp8KV(np.ascontiguousarray(codes, np.uint8),
                 np.ascontiguousarray(scale_bits, np.uint32).view(np.float32))


def realistic_pair(T: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A BF16 pair (x, mu): mu Gaussian, x = mu plus small noise, its first elements the adversarial values."""
    rng = np.random.default_rng(seed)
    mu = bf16_from_float(rng.standard_normal(shape(T)).astype(np.float32))
    x = bf16_from_float((mu.astype(np.uint32) << 16).view(np.float32)
                        + 0.02 * rng.standard_normal(shape(T)).astype(np.float32))
    x.reshape(-1)[: min(len(ADVERSARIAL), x.size)] = ADVERSARIAL[: x.size]
    return x, mu
