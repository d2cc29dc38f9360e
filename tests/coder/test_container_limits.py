"""Container records that lie about their sizes (with valid crcs): typed errors,
fast, without allocating what they claim; configurable limits."""

from __future__ import annotations

import struct
import time
import tracemalloc
import zlib

import pytest
from container_helpers import (
    GOLDEN,
    fix_crcs,
    golden_objects,
    make_header,
)

from speckv.coder import container as C
from speckv.coder.container import (
    ChecksumError,
    Chunk,
    FormatError,
    TruncatedError,
    pack_chunk,
    pack_header,
    unpack_chunk,
    unpack_stream,
)

# -------------------------------------------- lying sizes (valid crc, no alloc)

def _patched_chunk(fields: dict, tail: bytes = b"", record_len=None) -> bytes:
    f = {"index": 0, "layer_start": 0, "layer_count": 1, "n_blocks": 1, "steps": 1,
         "aux_len": 0, **fields}
    body_len = 68 + len(tail)
    rl = body_len + 4 if record_len is None else record_len
    body = struct.pack("<4sQIIIII16s16sI", b"SPKC", rl, f["index"], f["layer_start"],
                       f["layer_count"], f["n_blocks"], f["steps"], b"\0" * 16, b"\0" * 16,
                       f["aux_len"]) + tail
    return body + struct.pack("<I", zlib.crc32(body))


def _fast_and_small(fn, exc=FormatError, match=None):
    """``fn`` raises ``exc`` (never a ChecksumError: the crcs are valid) in under
    a second with under 1 MiB of peak allocation."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(exc, match=match) as ei:
            fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 1.0 and peak < 1 << 20
    assert not isinstance(ei.value, ChecksumError)


def test_lying_sizes_fail_fast_without_allocating():
    big = make_header((1024, 2, 8, 2**20, 32), epl=1, lpc=1)  # 2**39 elements
    nb = big.chunk_blocks(0)
    assert nb == 2**24
    tail = b"\0" * (132 * 4)
    cases = [
        _patched_chunk({"n_blocks": nb}, tail),                     # counts exceed record
        _patched_chunk({"n_blocks": nb}, tail, record_len=2**40),   # over MAX_CHUNK_BYTES
        _patched_chunk({"n_blocks": nb, "aux_len": 2**32 - 1}, tail),
        _patched_chunk({"n_blocks": nb, "aux_len": 2**20}, tail),
    ]
    for rec in cases:
        _fast_and_small(lambda rec=rec: unpack_chunk(rec, big))
    _fast_and_small(lambda: unpack_chunk(_patched_chunk({}, record_len=2**29), big),
                    TruncatedError)
    # word_counts claiming 2**32-1 words, in a crc'd record with room for bits_len
    small = make_header((1, 2, 1, 1, 2), epl=1, lpc=1)
    lie = _patched_chunk({}, b"\0" * 128 + b"\xff\xff\xff\xff" + bytes(8))
    _fast_and_small(lambda: unpack_chunk(lie, small), match="bits_len")
    # header: more elements than MAX_ELEMENTS; n_chunks of 2**32-1 empty chunks
    hdr = bytearray(pack_header(small))
    struct.pack_into("<5I", hdr, 42, 2**32 - 1, 2, 2**32 - 1, 2**32 - 1, 2**32 - 1)
    _fast_and_small(lambda: unpack_stream(fix_crcs(bytes(hdr))))
    struct.pack_into("<5I", hdr, 42, 2**32 - 1, 2, 1, 0, 1)
    struct.pack_into("<I", hdr, 102, 2**32 - 1)
    _fast_and_small(lambda: unpack_stream(fix_crcs(bytes(hdr))), TruncatedError)


_SMALL = make_header((1, 2, 1, 1, 2), epl=1, lpc=1)  # one chunk of one block


def _bits_chunk(bits_len: int, after: bytes = b"", n_words: int = 0) -> bytes:
    """A crc-valid record of ``_SMALL``: one block of zero states, ``n_words``
    words, then the u64 ``bits_len`` and the bytes ``after`` (not counted by it)."""
    tail = (bytes(128) + struct.pack("<I", n_words) + bytes(2 * n_words)
            + struct.pack("<Q", bits_len) + after)
    return _patched_chunk({}, tail)


@pytest.mark.parametrize("bits_len,after", [
    (2**64 - 1, b""), (2**63, b"xyz"), (2**30, b""), (2**30 + 1, b"ab"),
    (2**32 + 3, b"abc"),  # agrees with the record modulo 2**32
    (4, b"abc"), (2, b"abc"), (0, b"\0"),  # off by one either way
])
def test_lying_bits_len_fails_fast_without_allocating(bits_len, after):
    rec = _bits_chunk(bits_len, after)
    _fast_and_small(lambda: unpack_chunk(rec, _SMALL), match="bits_len|disagrees")
    _fast_and_small(lambda: unpack_stream(pack_header(_SMALL) + rec),
                    match="bits_len|disagrees")


def test_bits_len_must_lie_inside_the_record():
    ok = _bits_chunk(3, b"abc", n_words=2)
    assert unpack_chunk(ok, _SMALL)[0].bits == b"abc"
    # the pre-bits layout (no bits_len; words run up to the crc) and records in which
    # the words leave fewer than 8 bytes before the crc are rejected before reading it
    for n_words in (1, 2, 3, 4, 5, 2**32 - 1):
        body = bytes(128) + struct.pack("<I", n_words) + bytes(2 * 2 + 4)
        _fast_and_small(lambda body=body: unpack_chunk(_patched_chunk({}, body), _SMALL),
                        match="no room for bits_len")
    # n_blocks = 0 (tokens == 0): bits_len follows aux directly
    empty = make_header((1, 2, 1, 0, 2), epl=1, lpc=1)
    rec = _patched_chunk({"n_blocks": 0, "steps": 0, "aux_len": 1},
                         b"\x07" + struct.pack("<Q", 2) + b"\x01\x02")
    assert unpack_chunk(rec, empty)[0].bits == b"\x01\x02"
    _fast_and_small(lambda: unpack_chunk(_patched_chunk(
        {"n_blocks": 0, "steps": 0, "aux_len": 1}, b"\x07" + bytes(7)), empty))


# ------------------------------------------------------------- configurable limits

def test_limits_are_configurable(monkeypatch):
    h, c = golden_objects()
    monkeypatch.setattr(C, "MAX_CHUNK_BYTES", 200)
    with pytest.raises(FormatError, match="MAX_CHUNK_BYTES"):
        unpack_stream(GOLDEN)
    with pytest.raises(FormatError):
        pack_chunk(c)
    monkeypatch.setattr(C, "MAX_CHUNK_BYTES", 222)  # only the 3 bits bytes push it over
    with pytest.raises(FormatError, match="MAX_CHUNK_BYTES"):
        pack_chunk(c)
    with pytest.raises(FormatError, match="MAX_CHUNK_BYTES"):
        unpack_stream(GOLDEN)
    monkeypatch.setattr(C, "MAX_CHUNK_BYTES", 223)
    assert unpack_stream(GOLDEN) == (h, [c])
    monkeypatch.setattr(C, "MAX_BITS_BYTES", 2)
    with pytest.raises(FormatError, match="MAX_BITS_BYTES"):
        unpack_stream(GOLDEN)
    with pytest.raises(FormatError, match="MAX_BITS_BYTES"):
        Chunk(**{**c.__dict__})
    assert Chunk(**{**c.__dict__, "bits": b"\0\0"}).bits == b"\0\0"
    monkeypatch.setattr(C, "MAX_ELEMENTS", 3)
    with pytest.raises(FormatError, match="MAX_ELEMENTS"):
        make_header((1, 2, 1, 1, 2))
