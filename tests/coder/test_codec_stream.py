"""Chunk-at-a-time coding (``Codec.encode_chunk`` / ``decode_chunk``, what the
sidecars use to pipeline layers) and stored streams (FORMAT.md, model 0).

Streaming must write the very bytes the whole-tensor path writes, and every
decode is compared bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest
from codec_helpers import bf16_from_float, ids_for, shape, tile

from speckv.coder import container as ct
from speckv.coder.codec import Fp8KV, bf16_bits
from speckv.errors import IntegrityError, MuMismatchError

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

T = 7


def _bf16_pair(seed=0):
    rng = np.random.default_rng(seed)
    mu = bf16_from_float(rng.normal(0, 1, shape(T)))
    x = bf16_from_float(rng.normal(0, 1, shape(T)) * 0.1 + (mu.astype(np.uint32) << 16).view(np.float32))
    return x, mu


def _fp8_kv(seed=1):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, shape(T), dtype=np.uint8)
    scales = rng.uniform(0.01, 2, (shape(T)[0], 2)).astype(np.float32)
    return Fp8KV(codes, scales)


@pytest.mark.parametrize("lpc", [1, 2, 7])
def test_streamed_chunks_equal_whole_stream_bf16(make_codec, lpc):
    codec = make_codec(epl=64, lpc=lpc)
    x, mu = _bf16_pair()
    ids = ids_for(T)
    whole = list(codec.encode(x, ids, mu))
    h = codec.stream_header(True, x.shape, ids)
    assert ct.pack_header(h) == whole[0]
    for i in range(h.n_chunks):
        start, count = h.chunk_layers(i)
        c = codec.encode_chunk(h, i, x[start:start + count], mu)
        assert ct.pack_chunk(c) == whole[1 + i]
        back = codec.decode_chunk(h, c, mu)
        assert back.dtype == np.uint16 and np.array_equal(back, x[start:start + count])


def test_streamed_chunks_equal_whole_stream_fp8(make_codec):
    codec = make_codec(epl=64, lpc=3)
    kv, ids = _fp8_kv(), ids_for(T)
    _, mu = _bf16_pair(2)
    whole = list(codec.encode(kv, ids, mu))
    h = codec.stream_header(False, kv.codes.shape, ids)
    for i in range(h.n_chunks):
        s, n = h.chunk_layers(i)
        c = codec.encode_chunk(h, i, kv.codes[s:s + n], mu, kv.scales[s:s + n])
        assert ct.pack_chunk(c) == whole[1 + i]
        back = codec.decode_chunk(h, c, mu)
        assert back.dtype == np.uint8 and np.array_equal(back, kv.codes[s:s + n])


def test_decode_chunk_detects_other_mu(make_codec):
    codec = make_codec(epl=64, lpc=2)
    x, mu = _bf16_pair()
    h = codec.stream_header(True, x.shape, ids_for(T))
    c = codec.encode_chunk(h, 3, x[6:8], mu)
    assert not ct.is_stored_chunk(h, c)  # a coded chunk (the size guard stores layers 0..3 of this KV)
    other = mu.copy()
    other[7, 0, 0, 0, 0] ^= 1  # one bit of one scalar of this chunk's mu
    with pytest.raises(MuMismatchError):
        codec.decode_chunk(h, c, other)


def test_encode_chunk_rejects_wrong_extent(make_codec):
    codec = make_codec(epl=64, lpc=2)
    x, mu = _bf16_pair()
    h = codec.stream_header(True, x.shape, ids_for(T))
    with pytest.raises(ValueError, match="shape"):
        codec.encode_chunk(h, 0, x[:3], mu)
    hf = codec.stream_header(False, x.shape, ids_for(T))
    with pytest.raises(ValueError, match="scales"):
        codec.encode_chunk(hf, 0, x[:2].astype(np.uint8), mu)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_stored_round_trip_needs_no_predictor(make_codec, dtype):
    codec = make_codec(epl=64, lpc=4)
    ids = ids_for(T)
    kv = _fp8_kv() if dtype == "fp8" else _bf16_pair()[0]
    arr = kv.codes if dtype == "fp8" else kv
    h = codec.stream_header(dtype == "bf16", arr.shape, ids, stored=True)
    assert h.model == ct.MODEL_STORED and h.chunk_blocks(0) == 0
    recs = [ct.pack_header(h)]
    for i in range(h.n_chunks):
        s, n = h.chunk_layers(i)
        sc = kv.scales[s:s + n] if dtype == "fp8" else None
        recs.append(ct.pack_chunk(codec.encode_chunk(h, i, arr[s:s + n], None, sc)))
    # stored records: raw bytes plus framing, n_blocks = 0
    assert sum(map(len, recs)) == arr.nbytes + ct.HEADER_LEN + h.n_chunks * ct.CHUNK_OVERHEAD + (
        8 * arr.shape[0] if dtype == "fp8" else 0)
    back = codec.decode(recs, ids)  # no mu, no predictor
    if dtype == "fp8":
        assert np.array_equal(back.codes, kv.codes) and np.array_equal(back.scales, kv.scales)
    else:
        assert np.array_equal(back, arr)


def test_stored_ignores_pin_but_checks_bytes(make_codec):
    codec = make_codec(epl=64, lpc=30)
    other = make_codec(epl=64, lpc=30, pin="ab" * 32)
    x, _ = _bf16_pair()
    ids = ids_for(T)
    h = other.stream_header(True, x.shape, ids, stored=True)
    c = other.encode_chunk(h, 0, x, None)
    assert np.array_equal(codec.decode([ct.pack_header(h), ct.pack_chunk(c)], ids), x)
    bad = bytearray(c.bits)
    bad[5] ^= 0x10
    tampered = ct.Chunk(**{**{f: getattr(c, f) for f in c.__dataclass_fields__}, "bits": bytes(bad)})
    with pytest.raises(IntegrityError, match="checksum"):
        codec.decode_chunk(h, tampered, None)
    short = ct.Chunk(**{**{f: getattr(c, f) for f in c.__dataclass_fields__}, "bits": bytes(bad[:-2])})
    with pytest.raises(IntegrityError, match="needs"):
        codec.decode_chunk(h, short, None)


def test_bf16_bits_of_stored_decode_are_native_uint16(make_codec):
    codec = make_codec(epl=64, lpc=30)
    x = tile(np.array([0, 0x7F80, 0xFFFF, 0x8000, 0x7FC1], np.uint16), T)
    h = codec.stream_header(True, x.shape, ids_for(T), stored=True)
    back = codec.decode_chunk(h, codec.encode_chunk(h, 0, x, None), None)
    assert back.dtype == np.uint16 and np.array_equal(bf16_bits(back), x)
