"""Stored chunks inside a coded stream (FORMAT.md, format version 3): chunks the encoder
is told to store (the sidecars' mu differ on them) and chunks the size guard stores
(their coded record would be larger than their stored one); version 2 streams keep
their rules.

Every codec test runs on both CPU coders (``make_codec``) and compares the bytes with
the numpy reference's; every decode is compared bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from codec_helpers import (
    ALL_CODES,
    SCALES,
    bf16_from_float,
    bf16_tensor,
    chunk_areas,
    fp8_mu,
    ids_for,
    recrc,
    shape,
    tile,
    unguarded_records,
    versioned_records,
    without_digests,
)
from container_helpers import make_chunk, make_header

from speckv.coder import container as ct
from speckv.coder.codec import Fp8KV
from speckv.coder.stored import stored_record_len
from speckv.errors import FormatError, IntegrityError, MuMismatchError

# NaN / Inf inputs are part of the point: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

T = 5
EPL, LPC = 64, 4  # 8 chunks: 7 of 4 layers, the last of 2
STORED = {0, 2, 3, 7}


def _bf16(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(x, mu) BF16 patterns: x = mu plus tiny noise, so every chunk codes smaller than stored."""
    rng = np.random.default_rng(seed)
    mu_f = rng.standard_normal(shape(T)).astype(np.float32)
    return bf16_from_float(mu_f + 0.001 * rng.standard_normal(shape(T)).astype(np.float32)), bf16_from_float(mu_f)


def _fp8(seed: int = 1) -> tuple[Fp8KV, np.ndarray]:
    codes = tile(ALL_CODES, T, seed=seed)
    return Fp8KV(codes, SCALES["one"]), fp8_mu(codes, SCALES["one"], "near", seed)


def _case(dtype: str) -> tuple[object, np.ndarray, np.ndarray | None, np.ndarray]:
    """(kv, element bit patterns, FP8 scales or None, mu)"""
    if dtype == "bf16":
        x, mu = _bf16()
        return x, x, None, mu
    kv, mu = _fp8()
    return kv, kv.codes, kv.scales, mu


def _garbage_mu(h: ct.StreamHeader, mu: np.ndarray, stored: set[int], fill: int) -> np.ndarray:
    """mu with the layers of the ``stored`` chunks overwritten (the predictor never ran there)."""
    out = mu.copy()
    for i in stored:
        s, n = h.chunk_layers(i)
        out[s:s + n] = fill
    return out


def _stored_flags(h: ct.StreamHeader, records: list[bytes]) -> list[bool]:
    return [ct.is_stored_chunk(h, ct.unpack_chunk(r, h)[0]) for r in records[1:]]


def _same_kv(out, kv) -> bool:
    if isinstance(kv, Fp8KV):
        return (isinstance(out, Fp8KV) and np.array_equal(out.codes, kv.codes)
                and np.array_equal(out.scales.view(np.uint32), kv.scales.view(np.uint32)))
    return isinstance(out, np.ndarray) and out.dtype == np.uint16 and np.array_equal(out, kv)


def _mixed(codec, dtype: str, stored=STORED, fill: int = 0):
    """A version 3 stream whose ``stored`` chunks are stored: (h, records, kv, arr, scales, mu, mu_given)."""
    kv, arr, scales, mu = _case(dtype)
    h = codec.stream_header(dtype == "bf16", arr.shape, ids_for(T))
    mu_given = _garbage_mu(h, mu, set(stored), fill)
    chunks = codec.encode_chunks(h, range(h.n_chunks), arr, mu_given, scales, stored=stored)
    return h, [ct.pack_header(h)] + [ct.pack_chunk(c) for c in chunks], kv, arr, scales, mu, mu_given


# ------------------------------------------------------------------ container


def _stored_like(h: ct.StreamHeader, i: int, steps: int = 0) -> ct.Chunk:
    start, count = h.chunk_layers(i)
    return ct.Chunk(index=i, layer_start=start, layer_count=count, steps=steps, mu_fingerprint=bytes(16),
                    raw_digest=bytes(range(16)), aux=b"", states=np.zeros((0, ct.LANES), np.uint32),
                    word_counts=np.zeros(0, np.uint32), words=np.zeros(0, np.uint16), bits=b"\x01\x02\x03")


def test_container_accepts_stored_chunks_in_version_3_coded_streams_only():
    h = make_header(model=3)  # version 3, coded: chunk_blocks > 0
    h = dataclasses.replace(h, version=3)
    assert ct.FORMAT_VERSION == 5 and h.chunk_blocks(1) > 0
    chunks = [make_chunk(h, 0), _stored_like(h, 1)]
    h2, back = ct.unpack_stream(ct.pack_stream(h, chunks))
    assert h2 == h and back == chunks
    assert [ct.is_stored_chunk(h, c) for c in back] == [False, True]
    rec = ct.pack_chunk(chunks[1])
    with pytest.raises(FormatError, match="steps"):  # a stored chunk has no rANS steps
        ct.unpack_chunk(ct.pack_chunk(_stored_like(h, 1, steps=1)), h)
    v2 = dataclasses.replace(h, version=2)  # version 2: n_blocks must be chunk_blocks
    assert not ct.is_stored_chunk(v2, chunks[1])
    with pytest.raises(FormatError, match="n_blocks"):
        ct.unpack_chunk(rec, v2)
    with pytest.raises(FormatError, match="n_blocks"):
        ct.pack_stream(v2, chunks)
    with pytest.raises(FormatError, match="n_blocks"):
        ct.unpack_stream(ct.pack_header(v2) + ct.pack_chunk(chunks[0]) + rec)
    ct.unpack_chunk(ct.pack_chunk(chunks[0]), v2)  # the coded chunk is the same in both versions


def test_container_other_block_counts_stay_rejected():
    h = make_header(model=3)
    c = make_chunk(dataclasses.replace(h, elems_per_lane=h.elems_per_lane * 4), 1)  # fewer blocks, not 0
    assert 0 < c.n_blocks < h.chunk_blocks(1)
    with pytest.raises(FormatError, match="n_blocks"):
        ct.unpack_chunk(ct.pack_chunk(c), h)


def test_is_stored_chunk_in_stored_and_empty_streams():
    stored = make_header(model=ct.MODEL_STORED)
    assert all(ct.is_stored_chunk(stored, make_chunk(stored, i)) for i in range(stored.n_chunks))
    empty = make_header(shape=(3, 2, 2, 0, 4), model=3)  # no tokens: no blocks, yet coded chunks
    assert empty.chunk_blocks(0) == 0
    assert not any(ct.is_stored_chunk(empty, make_chunk(empty, i)) for i in range(empty.n_chunks))


# ------------------------------------------------------------------ encode / decode


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_mixed_stream_round_trip(make_codec, dtype):
    codec, ref = make_codec(EPL, LPC), make_codec(EPL, LPC, coder="numpy")
    h, records, kv, arr, scales, mu, mu_given = _mixed(codec, dtype)
    assert h.n_chunks == 8 and _stored_flags(h, records) == [i in STORED for i in range(8)]
    # the reference coder writes the same bytes
    assert _mixed(ref, dtype)[1] == records
    # coded chunks are those of the all-coded stream; stored ones carry the raw elements
    full = list(codec.encode(kv, ids_for(T), bf16_tensor(mu)))
    assert not any(_stored_flags(h, full))
    for i in range(h.n_chunks):
        c, _ = ct.unpack_chunk(records[1 + i], h)
        if i not in STORED:
            assert records[1 + i] == full[1 + i]
            continue
        s, n = h.chunk_layers(i)
        assert (c.n_blocks, c.steps, c.mu_fingerprint) == (0, 0, bytes(16))
        assert c.bits == np.ascontiguousarray(arr[s:s + n]).astype(arr.dtype.newbyteorder("<")).tobytes()
        assert c.aux == (b"" if scales is None else scales[s:s + n].astype("<f4").tobytes())
        # stored on request: larger than the coded form
        assert len(records[1 + i]) == c.record_len == stored_record_len(h, i) > len(full[1 + i])
    # decodes under the mu given (garbage where stored) and under the true mu, on both coders
    for dec in (codec, ref):
        assert _same_kv(dec.decode(records, ids_for(T), bf16_tensor(mu_given)), kv)
        assert _same_kv(dec.decode(records, ids_for(T), bf16_tensor(mu)), kv)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_batches_and_runs(make_codec, dtype):
    """encode_chunks / decode_run over batches whose coded chunks form several runs write
    and read the whole stream's records."""
    codec = make_codec(EPL, LPC)
    h, records, kv, arr, scales, mu, mu_given = _mixed(codec, dtype)
    for idx in (range(0, 3), range(3, 8), range(1, 7), range(2, 4), range(7, 8)):
        s, e = h.chunk_layers(idx[0])[0], sum(h.chunk_layers(idx[-1]))
        sc = None if scales is None else scales[s:e]
        # indices of ``stored`` outside the batch are ignored
        chunks = codec.encode_chunks(h, idx, arr[s:e], mu_given, sc, stored=STORED)
        assert [ct.pack_chunk(c) for c in chunks] == records[1 + idx[0]:1 + idx[-1] + 1]
        back = codec.decode_run(h, chunks, mu_given)
        assert back.dtype == arr.dtype and np.array_equal(back, arr[s:e])


def test_stored_chunks_ignore_mu_and_coded_ones_check_it(make_codec):
    codec = make_codec(EPL, LPC)
    h, records, kv, *_ = _mixed(codec, "bf16", fill=0)
    _, records_nan, *_, mu, _ = _mixed(codec, "bf16", fill=0x7FC0)
    assert records_nan == records  # the stored chunks' mu is never read
    other = mu.copy()
    other[h.chunk_layers(2)[0]] ^= 1  # a stored chunk's layer: no matter
    assert _same_kv(codec.decode(records, ids_for(T), bf16_tensor(other)), kv)
    other = mu.copy()
    other[h.chunk_layers(4)[0], 1, 2, 3, 4] ^= 1  # one bit of a coded chunk's mu
    with pytest.raises(MuMismatchError, match="chunk 4"):
        codec.decode(records, ids_for(T), bf16_tensor(other))


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_mu_none_when_every_chunk_is_stored(make_codec, dtype):
    codec = make_codec(EPL, LPC)
    h, records, kv, arr, scales, mu, _ = _mixed(codec, dtype)
    s, e = h.chunk_layers(2)[0], sum(h.chunk_layers(3))
    sc = None if scales is None else scales[s:e]
    chunks = codec.encode_chunks(h, range(2, 4), arr[s:e], None, sc, stored={2, 3})
    assert [ct.pack_chunk(c) for c in chunks] == records[3:5]
    assert np.array_equal(codec.decode_run(h, chunks, None), arr[s:e])
    assert np.array_equal(codec.decode_chunk(h, chunks[0], None), arr[s:s + LPC])
    with pytest.raises(ValueError, match="chunks \\[4\\] are coded: they need mu"):
        codec.encode_chunks(h, range(2, 5), arr[s:e + LPC], None, None if scales is None else scales[s:e + LPC],
                            stored={2, 3})
    mixed = [ct.unpack_chunk(r, h)[0] for r in records[3:6]]  # chunks 2, 3 stored, 4 coded
    with pytest.raises(ValueError, match="chunks \\[4\\] are coded: decoding them needs mu"):
        codec.decode_run(h, mixed, None)
    assert np.array_equal(codec.decode_run(h, mixed, mu), arr[s:e + LPC])


def test_stored_chunks_need_version_3(make_codec):
    codec = make_codec(EPL, LPC)
    x, mu = _bf16()
    h2 = dataclasses.replace(codec.stream_header(True, x.shape, ids_for(T)), version=2)
    with pytest.raises(ValueError, match="version 3"):
        codec.encode_chunks(h2, range(h2.n_chunks), x, mu, stored={1})


def test_stored_chunk_in_a_version_2_stream_is_rejected(make_codec):
    codec = make_codec(EPL, LPC)
    h, records, kv, _, _, mu, _ = _mixed(codec, "bf16")
    v2 = ct.pack_header(dataclasses.replace(h, version=2))
    with pytest.raises(FormatError, match="chunk 0: n_blocks 0"):
        codec.decode([v2] + records[1:], ids_for(T), bf16_tensor(mu))
    # a version 3 stream without stored chunks under a version 2 header fails its digests
    # (version 2's are blake2b-128, version 3's XXH3-128); written as version 2, it decodes
    full = versioned_records(codec, kv, ids_for(T), bf16_tensor(mu), 3)
    with pytest.raises(MuMismatchError):
        codec.decode([v2] + full[1:], ids_for(T), bf16_tensor(mu))
    # a version 4 stream whose chunks carry sigma shifts: their aux is too long for version 2
    v4 = list(codec.encode(kv, ids_for(T), bf16_tensor(mu)))
    assert any(len(ct.unpack_chunk(r, h)[0].aux) for r in v4[1:])
    with pytest.raises(IntegrityError, match="aux"):
        codec.decode([v2] + v4[1:], ids_for(T), bf16_tensor(mu))
    h2 = dataclasses.replace(h, version=2)
    old = [ct.pack_chunk(c) for c in codec.encode_chunks(h2, range(h2.n_chunks), kv, mu)]
    assert _same_kv(codec.decode([v2] + old, ids_for(T), bf16_tensor(mu)), kv)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_corrupt_stored_chunk_fails_its_digest(make_codec, dtype):
    codec = make_codec(EPL, LPC)
    h, records, kv, arr, scales, mu, mu_given = _mixed(codec, dtype)
    i = 3
    areas = chunk_areas(records[0], records[1 + i])
    chunk = ct.unpack_chunk(records[1 + i], h)[0]
    for area in ("bits", "aux") if dtype == "fp8" else ("bits",):
        lo, hi = areas[area]
        for pos in (lo, (lo + hi) // 2, hi - 1):
            bad = bytearray(records[1 + i])
            bad[pos] ^= 0x20
            recs = list(records)
            recs[1 + i] = recrc(bad)
            with pytest.raises(IntegrityError, match="checksum"):
                codec.decode(recs, ids_for(T), bf16_tensor(mu_given))
            with pytest.raises(IntegrityError, match="checksum"):
                codec.decode_run(h, [ct.unpack_chunk(recs[1 + i], h)[0]], mu_given)
    short = dataclasses.replace(chunk, bits=chunk.bits[:-1])
    with pytest.raises(IntegrityError, match="needs"):
        codec.decode_run(h, [short], None)


# ------------------------------------------------------------------ the size guard


def _incompressible(dtype: str, seed: int = 5):
    """(kv, arr, scales, mu): uniform random bit patterns under a mu far from them."""
    rng = np.random.default_rng(seed)
    if dtype == "bf16":
        x = rng.integers(0, 1 << 16, shape(T)).astype(np.uint16)
        return x, x, None, np.full(shape(T), 0x3F80, np.uint16)  # mu = 1.0 everywhere
    codes = rng.integers(0, 256, shape(T)).astype(np.uint8)
    scales = SCALES["mixed"]
    return Fp8KV(codes, scales), codes, scales, rng.integers(0, 1 << 16, shape(T)).astype(np.uint16)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_guard_stores_incompressible_chunks(make_codec, dtype):
    codec, ref = make_codec(EPL, LPC), make_codec(EPL, LPC, coder="numpy")
    kv, arr, scales, mu = _incompressible(dtype)
    ids = ids_for(T)
    records = list(codec.encode(kv, ids, bf16_tensor(mu)))
    assert records == list(ref.encode(kv, ids, bf16_tensor(mu)))
    h, _ = ct.unpack_header(records[0])
    assert h.version == ct.FORMAT_VERSION and h.model != ct.MODEL_STORED and all(_stored_flags(h, records))
    coded = unguarded_records(codec, kv, ids, bf16_tensor(mu))  # what version 2 wrote: larger
    for i in range(h.n_chunks):
        assert len(records[1 + i]) == stored_record_len(h, i) < len(coded[1 + i])
    assert _same_kv(codec.decode(records, ids, bf16_tensor(mu)), kv)
    assert _same_kv(ref.decode(records, ids, bf16_tensor(mu)), kv)
    # streaming: the same guard chunk by chunk
    for i in range(h.n_chunks):
        s, n = h.chunk_layers(i)
        c = codec.encode_chunk(h, i, arr[s:s + n], mu, None if scales is None else scales[s:s + n])
        assert ct.pack_chunk(c) == records[1 + i]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_guard_on_half_incompressible_kv(make_codec, dtype):
    """Layers 0..15 predictable, 16..29 random: the guard stores exactly the random chunks."""
    codec, ref = make_codec(EPL, LPC), make_codec(EPL, LPC, coder="numpy")
    good, bad = _case(dtype), _incompressible(dtype)
    arr = np.concatenate([good[1][:16], bad[1][16:]])
    mu = np.concatenate([good[3][:16], bad[3][16:]])
    scales = None if good[2] is None else np.concatenate([good[2][:16], bad[2][16:]])
    kv = arr if scales is None else Fp8KV(arr, scales)
    ids = ids_for(T)
    records = list(codec.encode(kv, ids, bf16_tensor(mu)))
    assert records == list(ref.encode(kv, ids, bf16_tensor(mu)))
    h, _ = ct.unpack_header(records[0])
    assert _stored_flags(h, records) == [False] * 4 + [True] * 4
    coded = unguarded_records(codec, kv, ids, bf16_tensor(mu))  # version 2: its digests are blake2b-128
    v3 = versioned_records(codec, kv, ids, bf16_tensor(mu), 3)  # version 3: no sigma shifts
    assert _stored_flags(h, v3) == [False] * 4 + [True] * 4
    assert [without_digests(r) for r in v3[1:5]] == [without_digests(r) for r in coded[1:5]]
    assert _same_kv(codec.decode(records, ids, bf16_tensor(mu)), kv)


@pytest.mark.parametrize("mode", ["random", "nan", "inf", "zero", "true"])
def test_no_chunk_is_larger_than_stored(make_codec, mode):
    """Whatever mu is, every record of a version 3 stream is at most its stored size."""
    codec = make_codec(16, 3)
    rng = np.random.default_rng(11)
    x = rng.integers(0, 1 << 16, shape(2)).astype(np.uint16)
    x.reshape(-1)[::2] = bf16_from_float(rng.standard_normal(x.size // 2))
    mu = {"random": rng.integers(0, 1 << 16, x.shape).astype(np.uint16), "nan": np.full(x.shape, 0x7FC0, np.uint16),
          "inf": np.full(x.shape, 0x7F80, np.uint16), "zero": np.zeros(x.shape, np.uint16), "true": x}[mode]
    records = list(codec.encode(x, ids_for(2), bf16_tensor(mu)))
    h, _ = ct.unpack_header(records[0])
    for i, r in enumerate(records[1:]):
        c, _ = ct.unpack_chunk(r, h)
        assert len(r) <= stored_record_len(h, i)
        assert ct.is_stored_chunk(h, c) == (len(r) == stored_record_len(h, i) and c.n_blocks == 0)
    assert np.array_equal(codec.decode(records, ids_for(2), bf16_tensor(mu)), x)


def test_empty_stream_chunks_are_coded(make_codec):
    """No tokens: every chunk has no blocks and is a (coded) chunk of the same size."""
    codec = make_codec(EPL, LPC)
    x = np.zeros(shape(0), np.uint16)
    records = list(codec.encode(x, ids_for(0), bf16_tensor(x)))
    h, _ = ct.unpack_header(records[0])
    assert not any(_stored_flags(h, records))
    assert all(len(r) == stored_record_len(h, i) == ct.CHUNK_OVERHEAD for i, r in enumerate(records[1:]))
    assert np.array_equal(codec.decode(records, ids_for(0), bf16_tensor(x)), x)
