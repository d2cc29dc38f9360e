"""Records as buffers (coder/framing.py): ``chunk_pieces`` and ``stored_pieces`` join to
exactly ``pack_chunk``'s bytes, ``stored_record`` (the sidecar's stored chunks, straight
from their layers) to ``pack_chunk(stored_chunk(...))``; ``unpack_chunk(borrow=True)``
reads the same chunk with its bits and words views of the record; the crc32 is zlib's whatever
implementation computes it."""
from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
from container_helpers import make_chunk, make_header, make_stream

from speckv.coder import container as ct
from speckv.coder import framing
from speckv.coder.stored import stored_chunk, stored_record
from speckv.errors import FormatError


def test_chunk_pieces_join_to_pack_chunk():
    h, chunks = make_stream(make_header((5, 2, 3, 7, 2), epl=1, lpc=2), aux=b"\x01\x02\x03")
    for c in chunks:
        pieces = ct.chunk_pieces(c)
        assert all(isinstance(p, memoryview) for p in pieces)
        assert b"".join(pieces) == ct.pack_chunk(c) and sum(len(p) for p in pieces) == c.record_len
    empty = make_stream(make_header((4, 2, 1, 0, 8), 1, 3), aux=b"", bits=b"")[1][0]  # no blocks, no bits
    assert b"".join(ct.chunk_pieces(empty)) == ct.pack_chunk(empty) and len(ct.pack_chunk(empty)) == ct.CHUNK_OVERHEAD


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("fp8", [False, True])
def test_stored_record_is_pack_chunk_of_stored_chunk(version, fp8):
    shape = (5, 2, 3, 4, 8)
    h = dataclasses.replace(make_header(shape, lpc=2, dtype=ct.DTYPE_FP8 if fp8 else ct.DTYPE_BF16,
                                        model=ct.MODEL_STORED), version=version)
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256 if fp8 else 1 << 16, shape, dtype=np.uint8 if fp8 else np.uint16)
    scales = rng.uniform(0.1, 2.0, (shape[0], 2)).astype(np.float32) if fp8 else None
    for i in range(h.n_chunks):
        s, n = h.chunk_layers(i)
        sc = None if scales is None else scales[s:s + n]
        want = ct.pack_chunk(stored_chunk(h, i, x[s:s + n], sc))
        assert b"".join(stored_record(h, i, list(x[s:s + n]), sc)) == want
    with pytest.raises(ValueError):
        stored_record(h, 0, [x[0]], None)  # chunk 0 has 2 layers


def test_stored_pieces_validate_as_chunk_does(monkeypatch):
    with pytest.raises(FormatError):
        ct.stored_pieces(0, 0, 1, bytes(15), b"", [b"ab"])  # raw_digest of 15 bytes
    with pytest.raises(FormatError):
        ct.stored_pieces(-1, 0, 1, bytes(16), b"", [b"ab"])
    monkeypatch.setattr(ct, "MAX_BITS_BYTES", 3)
    with pytest.raises(FormatError, match="MAX_BITS_BYTES"):
        ct.stored_pieces(0, 0, 1, bytes(16), b"", [b"ab", b"cd"])


def test_borrowed_bits_and_words_are_views_of_the_record():
    h, chunks = make_stream()
    assert any(c.words.size for c in chunks)
    for c in chunks:
        rec = bytearray(ct.pack_chunk(c))
        got, used = ct.unpack_chunk(rec, h, borrow=True)
        assert got == c and used == len(rec) and isinstance(got.bits, memoryview) and got.bits.readonly
        assert np.shares_memory(np.frombuffer(got.bits, np.uint8), np.frombuffer(rec, np.uint8))
        if c.words.size:  # this host is little-endian, as the wire
            assert np.shares_memory(got.words, np.frombuffer(rec, np.uint8)) and not got.words.flags.writeable
        owned, _ = ct.unpack_chunk(rec, h)
        assert type(owned.bits) is bytes and owned == c and owned.words.flags.owndata
        assert not np.shares_memory(owned.words, np.frombuffer(rec, np.uint8))
        assert b"".join(ct.chunk_pieces(got)) == bytes(rec)  # a borrowed chunk packs as any other


def test_crc32_is_zlibs():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    for n in (0, 1, 7, 64, 4097, len(data)):
        assert framing.crc32(data[:n]) == zlib.crc32(data[:n])
        assert framing.crc32(data[n:], framing.crc32(data[:n])) == zlib.crc32(data)


def test_header_and_chunk_crcs_are_checked():
    h, chunks = make_stream()
    rec = bytearray(ct.pack_chunk(chunks[0]))
    rec[20] ^= 1
    with pytest.raises(ct.ChecksumError):
        ct.unpack_chunk(rec, h, borrow=True)
    c = make_chunk(h, 1)
    assert ct.unpack_chunk(ct.pack_chunk(c), h, borrow=True)[0] == c


def test_borrowed_items_at_an_odd_offset_are_copied():
    """An odd-length aux leaves a chunk's u16 words at an odd offset: borrowed, they are copied (aligned,
    owned) rather than viewed misaligned; at an even offset they are a read-only view."""
    buf = memoryview(bytes(range(1, 34)))
    odd = framing.le_array(buf, 1, 8, "<u2", np.uint16, borrow=True)
    even = framing.le_array(buf, 2, 8, "<u2", np.uint16, borrow=True)
    assert odd.flags.aligned and odd.flags.owndata and np.array_equal(odd, np.frombuffer(buf[1:17], "<u2"))
    assert not even.flags.owndata and not even.flags.writeable and np.array_equal(even, np.frombuffer(buf[2:18], "<u2"))
