"""Tests for speckv.coder.container (format versions 2 to 4, see coder/FORMAT.md): round trips,
golden bytes, validation on construction. Malformed input: test_container_rejects.py; records
that lie about their sizes and configurable limits: test_container_limits.py."""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np
import pytest
from container_helpers import (
    GOLDEN,
    GOLDEN_V2,
    GOLDEN_V4,
    golden_objects,
    make_chunk,
    make_header,
    make_stream,
)

from speckv.coder import container as C
from speckv.coder.container import (
    Chunk,
    FormatError,
    StreamHeader,
    pack_chunk,
    pack_header,
    pack_stream,
    unpack_chunk,
    unpack_header,
    unpack_stream,
)

# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("shape,epl,lpc", [
    ((3, 2, 2, 5, 4), 2, 2),      # partial last chunk, partial last block
    ((4, 2, 1, 0, 8), 1, 3),      # 0 tokens -> 0 blocks everywhere
    ((1, 2, 1, 1, 1), 1000, 1),   # 2 elements, one block
    ((5, 2, 3, 7, 2), 1, 65535),  # single chunk
    ((2, 2, 2, 64, 16), 4, 1),    # whole blocks
])
@pytest.mark.parametrize("aux", [b"", b"\xff" * 300])
@pytest.mark.parametrize("bits", [None, b"", b"\x80" * 1000], ids=["rand", "empty", "1000"])
def test_round_trip(shape, epl, lpc, aux, bits):
    h, chunks = make_stream(make_header(shape, epl, lpc), aux=aux, bits=bits)
    assert all(len(c.bits) > 0 for c in chunks) == (bits != b"")
    data = pack_stream(h, chunks)
    h2, chunks2 = unpack_stream(data)
    assert h2 == h and chunks2 == chunks
    assert len(data) == C.HEADER_LEN + sum(c.record_len for c in chunks)
    # piecewise API, fed from bytearray / memoryview at an offset
    hh, off = unpack_header(bytearray(data))
    assert (hh, off) == (h, C.HEADER_LEN) and pack_header(h) == data[:off]
    mv = memoryview(data)
    for c in chunks:
        c2, used = unpack_chunk(mv[off:], h)
        assert c2 == c and used == c.record_len and pack_chunk(c2) == data[off:off + used]
        off += used
    assert off == len(data)


def test_zero_token_chunks_are_minimal():
    h, chunks = make_stream(make_header((4, 2, 1, 0, 8), 1, 3), aux=b"", bits=b"")
    assert h.n_chunks == 2 and all(c.n_blocks == 0 for c in chunks) and C.CHUNK_OVERHEAD == 80
    assert len(pack_stream(h, chunks)) == C.HEADER_LEN + 2 * C.CHUNK_OVERHEAD


def test_unpacked_arrays_are_owned_native():
    h, chunks = make_stream()
    data = bytearray(pack_stream(h, chunks))
    _, got = unpack_stream(data)
    c = got[0]
    for arr, dt in ((c.states, np.uint32), (c.word_counts, np.uint32), (c.words, np.uint16)):
        assert arr.dtype == np.dtype(dt) and arr.dtype.isnative
        assert arr.flags.owndata and arr.flags.writeable and arr.flags.c_contiguous
        assert not np.shares_memory(arr, np.frombuffer(data, np.uint8))
    assert c.states.shape == (c.n_blocks, C.LANES)
    assert type(c.bits) is bytes and type(c.aux) is bytes and c.bits == chunks[0].bits != b""
    data[:] = b"\0" * len(data)  # mutating the source leaves the chunk intact
    assert got == chunks


def test_block_words_and_flat_states():
    h = make_header()
    c = make_chunk(h, 0)
    flat = Chunk(**{**c.__dict__, "states": c.states.reshape(-1)})
    assert flat == c
    joined = np.concatenate([c.block_words(b) for b in range(c.n_blocks)])
    assert np.array_equal(joined, c.words)


def test_bits_normalised_and_compared():
    c = make_chunk(make_header(), 0, bits=b"\x01\x02")
    for like in (bytearray(b"\x01\x02"), memoryview(b"\x01\x02")):
        other = Chunk(**{**c.__dict__, "bits": like})
        assert type(other.bits) is bytes and other == c
    assert Chunk(**{**c.__dict__, "bits": b"\x01\x03"}) != c
    assert Chunk(**{**c.__dict__, "bits": b""}).record_len == c.record_len - 2


def test_header_properties():
    h = make_header((5, 2, 3, 7, 2), epl=1, lpc=2)
    assert h.n_chunks == 3 and h.block_elements == 32
    assert [h.chunk_layers(i) for i in range(3)] == [(0, 2), (2, 2), (4, 1)]
    assert h.chunk_elements(2) == 1 * 2 * 3 * 7 * 2 and h.chunk_blocks(2) == 3
    with pytest.raises(FormatError):
        h.chunk_layers(3)


# ------------------------------------------------------------- golden bytes

def test_golden_bytes():
    h, c = golden_objects()
    assert pack_stream(h, [c]) == GOLDEN
    assert unpack_stream(GOLDEN) == (h, [c])
    # spot-check the layout against FORMAT.md independently of the packer
    assert GOLDEN[:4] == b"SPKV" and struct.unpack_from("<HHBB", GOLDEN, 4) == (3, 110, 2, 7)
    assert struct.unpack_from("<5I", GOLDEN, 42) == (1, 2, 1, 1, 2)
    assert struct.unpack_from("<HIHI", GOLDEN, 94) == (32, 1, 1, 1)
    assert struct.unpack_from("<I", GOLDEN, 106)[0] == zlib.crc32(GOLDEN[:106])
    rec = GOLDEN[110:]
    # 80 + aux_len 2 + 132 * 1 block + 2 * 3 words + bits_len 3
    assert rec[:4] == b"SPKC" and struct.unpack_from("<Q", rec, 4)[0] == len(rec) == 223
    assert struct.unpack_from("<5I", rec, 12) == (0, 0, 1, 1, 1)
    assert rec[32:48] == b"\x11" * 16 and rec[48:64] == b"\x22" * 16
    assert struct.unpack_from("<I", rec, 64)[0] == 2 and rec[68:70] == b"\xab\xcd"
    s_off = 70
    assert struct.unpack_from("<32I", rec, s_off) == tuple(range(0x10000, 0x10020))
    w_off = s_off + 128
    assert struct.unpack_from("<I", rec, w_off)[0] == 3
    d_off = w_off + 4
    assert struct.unpack_from("<3H", rec, d_off) == (0x1234, 0x5678, 0x9ABC)
    b_off = d_off + 2 * 3
    assert b_off == 208 and struct.unpack_from("<Q", rec, b_off)[0] == 3
    assert rec[b_off + 8:b_off + 11] == b"\xa5\x0f\x80"
    assert b_off + 11 == 219 == len(rec) - 4
    assert struct.unpack_from("<I", rec, 219)[0] == zlib.crc32(rec[:219])


def test_golden_bytes_version_2():
    """A version 2 stream still reads, keeps its version and re-packs to the same bytes."""
    h, c = golden_objects()
    assert C.FORMAT_VERSION == 5 and C.READ_VERSIONS == (2, 3, 4, 5)
    h2, chunks = unpack_stream(GOLDEN_V2)
    assert h2.version == 2 and h2 == dataclasses.replace(h, version=2) and chunks == [c]
    assert pack_stream(h2, chunks) == GOLDEN_V2 and pack_header(h2) == GOLDEN_V2[:110]
    assert struct.unpack_from("<I", GOLDEN_V2, 106)[0] == zlib.crc32(GOLDEN_V2[:106])


def test_golden_bytes_version_4():
    """A version 4 stream (what writers wrote before version 5) reads, keeps its version and re-packs
    to the same bytes."""
    h, c = golden_objects()
    assert StreamHeader(**{**h.__dict__, "version": C.FORMAT_VERSION}).version == 5
    h4, chunks = unpack_stream(GOLDEN_V4)
    assert h4.version == 4 and h4 == dataclasses.replace(h, version=4) and chunks == [c]
    assert pack_stream(h4, chunks) == GOLDEN_V4


# ------------------------------------------------------ validation on construction

@pytest.mark.parametrize("kw", [
    {"dtype": 0}, {"dtype": 3}, {"model": -1}, {"model": 256}, {"pin": b"x" * 31},
    {"pin": "x" * 32}, {"prompt_digest": b""}, {"shape": (1, 2, 1, 1)},
    {"shape": (1, 3, 1, 1, 1)}, {"shape": (0, 2, 1, 1, 1)}, {"shape": (1, 2, 0, 1, 1)},
    {"shape": (1, 2, 1, 1, 0)}, {"shape": (1, 2, 1, -1, 1)}, {"shape": (2**32, 2, 1, 1, 1)},
    {"shape": (1, 2, 1, 1.5, 1)}, {"shape": 5}, {"elems_per_lane": 0},
    {"elems_per_lane": 2**32}, {"layers_per_chunk": 0}, {"layers_per_chunk": 2**16},
    {"dtype": True}, {"shape": (1, 2, 2**19, 2**19, 1), "elems_per_lane": 1},
])
def test_header_validation(kw):
    base = dict(dtype=1, model=1, pin=b"\0" * 32, shape=(1, 2, 1, 1, 1),
                prompt_digest=b"\0" * 32, elems_per_lane=1, layers_per_chunk=1)
    with pytest.raises(FormatError):
        StreamHeader(**{**base, **kw})


@pytest.mark.parametrize("kw", [
    {"index": -1}, {"steps": 2**32}, {"mu_fingerprint": b"\0" * 15}, {"raw_digest": None},
    {"aux": "text"}, {"aux": b"\0" * (2**20 + 1)}, {"states": np.zeros((1, 31), np.uint32)},
    {"states": np.zeros((2, 32), np.uint32)}, {"states": -np.ones((1, 32), np.int64)},
    {"states": np.full((1, 32), 2**32, np.int64)}, {"states": np.zeros((1, 32))},
    {"word_counts": [2]}, {"word_counts": [[1]]}, {"words": [70000]}, {"words": [1, 2]},
    {"bits": "text"}, {"bits": None}, {"bits": [1, 2]}, {"bits": np.zeros(2, np.uint8)},
    {"bits": 3},
])
def test_chunk_validation(kw):
    base = dict(index=0, layer_start=0, layer_count=1, steps=1, mu_fingerprint=b"\0" * 16,
                raw_digest=b"\0" * 16, aux=b"", states=np.zeros((1, 32), np.uint32),
                word_counts=[1], words=[5], bits=b"")
    Chunk(**base)
    with pytest.raises(FormatError):
        Chunk(**{**base, **kw})
