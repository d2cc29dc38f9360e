"""Tests for speckv.coder.container (format versions 2 to 4, see coder/FORMAT.md)."""

from __future__ import annotations

import dataclasses
import struct
import zlib

import numpy as np
import pytest
from container_helpers import (
    fix_crcs,
    make_chunk,
    make_header,
    make_stream,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speckv.coder import container as C
from speckv.coder.container import (
    ChecksumError,
    Chunk,
    FormatError,
    StreamHeader,
    TruncatedError,
    pack_chunk,
    pack_header,
    pack_stream,
    unpack_chunk,
    unpack_header,
    unpack_stream,
)

FAST = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

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

GOLDEN = bytes.fromhex(
    # header: magic, version 3, header_len 110, dtype fp8, model 7, pin 00..1f
    "53504b5603006e000207000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d"
    # shape (1, 2, 1, 1, 2), prompt_digest 20..3f
    "1e1f0100000002000000010000000100000002000000202122232425262728292a2b2c2d2e2f3031"
    # lanes 32, elems_per_lane 1, layers_per_chunk 1, n_chunks 1, crc | chunk: magic, len 223
    "32333435363738393a3b3c3d3e3f2000010000000100010000009e57075a53504b43df0000000000"
    # index 0, layer_start 0, layer_count 1, n_blocks 1, steps 1, mu 11.., raw 22..
    "00000000000000000000010000000100000001000000111111111111111111111111111111112222"
    # aux_len 2, aux abcd, states 0x10000 + lane
    "222222222222222222222222222202000000abcd0000010001000100020001000300010004000100"
    "05000100060001000700010008000100090001000a0001000b0001000c0001000d0001000e000100"
    "0f000100100001001100010012000100130001001400010015000100160001001700010018000100"
    # word_counts [3], words 1234 5678 9abc, bits_len 3 (u64)
    "190001001a0001001b0001001c0001001d0001001e0001001f0001000300000034127856bc9a0300"
    # bits a5 0f 80, crc
    "000000000000a50f802dc5ac7b")


# the same stream in format version 2: version 2 and its header crc (the chunk is unchanged)
GOLDEN_V2 = GOLDEN[:4] + b"\x02\x00" + GOLDEN[6:106] + bytes.fromhex("d3b1efec") + GOLDEN[110:]
# ... and in format version 4 (the container treats aux as opaque in every version)
GOLDEN_V4 = GOLDEN[:4] + b"\x04\x00" + GOLDEN[6:106] + bytes.fromhex("ffe87fec") + GOLDEN[110:]


def golden_objects():
    h = StreamHeader(dtype=C.DTYPE_FP8, model=7, pin=bytes(range(32)), shape=(1, 2, 1, 1, 2),
                     prompt_digest=bytes(range(32, 64)), elems_per_lane=1, layers_per_chunk=1, version=3)
    c = Chunk(index=0, layer_start=0, layer_count=1, steps=1, mu_fingerprint=b"\x11" * 16,
              raw_digest=b"\x22" * 16, aux=b"\xab\xcd",
              states=(0x10000 + np.arange(32, dtype=np.uint32))[None, :],
              word_counts=[3], words=[0x1234, 0x5678, 0x9ABC], bits=b"\xa5\x0f\x80")
    return h, c


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
    assert C.FORMAT_VERSION == 4 and C.READ_VERSIONS == (2, 3, 4)
    h2, chunks = unpack_stream(GOLDEN_V2)
    assert h2.version == 2 and h2 == dataclasses.replace(h, version=2) and chunks == [c]
    assert pack_stream(h2, chunks) == GOLDEN_V2 and pack_header(h2) == GOLDEN_V2[:110]
    assert struct.unpack_from("<I", GOLDEN_V2, 106)[0] == zlib.crc32(GOLDEN_V2[:106])


def test_golden_bytes_version_4():
    """A version 4 stream (what writers write) reads, keeps its version and re-packs to the same bytes."""
    h, c = golden_objects()
    assert StreamHeader(**{**h.__dict__, "version": C.FORMAT_VERSION}).version == 4
    h4, chunks = unpack_stream(GOLDEN_V4)
    assert h4.version == 4 and h4 == dataclasses.replace(h, version=4) and chunks == [c]
    assert pack_stream(h4, chunks) == GOLDEN_V4


# ----------------------------------------------------- corruption, truncation

def test_every_byte_change_is_rejected():
    data = GOLDEN
    checksum = 0
    for pos in range(len(data)):
        for delta in range(1, 256):
            bad = bytearray(data)
            bad[pos] ^= delta
            try:
                unpack_stream(bytes(bad))
            except ChecksumError:
                checksum += 1
            except FormatError:
                pass
            else:
                pytest.fail(f"byte {pos} ^ {delta:#x} was accepted")
    assert checksum > 0.9 * len(data) * 255


def test_every_truncation_is_rejected():
    h, chunks = make_stream(make_header((3, 2, 1, 2, 4), 1, 1))
    data = pack_stream(h, chunks)
    for n in range(len(data)):
        with pytest.raises(TruncatedError):
            unpack_stream(data[:n])
    for n in range(C.HEADER_LEN):
        with pytest.raises(TruncatedError):
            unpack_header(data[:n])
    rec = pack_chunk(chunks[0])
    for n in range(len(rec)):
        with pytest.raises(TruncatedError):
            unpack_chunk(rec[:n], h)


def test_trailing_and_missing_and_reordered_chunks():
    h, chunks = make_stream(make_header((3, 2, 1, 2, 4), 1, 1))
    data = pack_stream(h, chunks)
    with pytest.raises(FormatError, match="trailing"):
        unpack_stream(data + b"\0")
    with pytest.raises(FormatError, match="trailing"):
        unpack_stream(data + pack_chunk(chunks[-1]))
    recs = [pack_chunk(c) for c in chunks]
    with pytest.raises(FormatError, match="position"):
        unpack_stream(pack_header(h) + recs[1] + recs[0] + recs[2])
    with pytest.raises(FormatError):
        pack_stream(h, [chunks[1], chunks[0], chunks[2]])
    with pytest.raises(FormatError):
        pack_stream(h, chunks[:2])
    with pytest.raises(FormatError):
        pack_stream(h, chunks + chunks[:1])


def test_bad_magic_and_version():
    with pytest.raises(FormatError, match="magic"):
        unpack_stream(b"XPKV" + GOLDEN[4:])
    with pytest.raises(TruncatedError):
        unpack_header(b"SP")
    for bad in (0, 1, 5, 0xFFFF):
        with pytest.raises(FormatError, match=f"unsupported format version {bad}$"):
            unpack_header(fix_crcs(GOLDEN[:4] + struct.pack("<H", bad) + GOLDEN[6:]))
        with pytest.raises(FormatError, match=f"unsupported format version {bad}$"):
            StreamHeader(**{**golden_objects()[0].__dict__, "version": bad})
    with pytest.raises(FormatError, match="magic"):
        unpack_chunk(b"SPKV" + GOLDEN[114:], golden_objects()[0])


@pytest.mark.parametrize("offset,fmt,value,match", [
    (6, "<H", 111, "header_len"), (6, "<H", 0, "header_len"), (8, "<B", 0, "dtype"),
    (8, "<B", 3, "dtype"), (46, "<I", 3, "shape"),
    (42, "<I", 0, "layers"), (58, "<I", 0, "head_dim"), (94, "<H", 16, "lanes"),
    (96, "<I", 0, "elems_per_lane"), (100, "<H", 0, "layers_per_chunk"),
    (102, "<I", 2, "n_chunks"), (102, "<I", 0, "n_chunks"),
])
def test_header_field_rules_with_valid_crc(offset, fmt, value, match):
    hdr = bytearray(GOLDEN[:C.HEADER_LEN])
    struct.pack_into(fmt, hdr, offset, value)
    with pytest.raises(FormatError, match=match) as ei:
        unpack_header(fix_crcs(bytes(hdr)))
    assert not isinstance(ei.value, ChecksumError)


# ------------------------------------------------- chunk / header mismatches

@pytest.mark.parametrize("field,value", [
    ("layer_start", 1), ("layer_count", 1), ("index", 5), ("index", 2**32 - 1),
    ("n_blocks", 2), ("n_blocks", 4), ("steps", 33), ("steps", 2**32 - 1),
])
def test_chunk_header_mismatch(field, value):
    h = make_header()  # 3 layers in chunks of 2: chunk 0 = layers (0, 2), 3 blocks
    data = bytearray(pack_chunk(make_chunk(h, 0)))
    offset = {"index": 12, "layer_start": 16, "layer_count": 20, "n_blocks": 24, "steps": 28}
    struct.pack_into("<I", data, offset[field], value)
    with pytest.raises(FormatError) as ei:
        unpack_chunk(fix_crcs(b"\0" * C.HEADER_LEN + bytes(data))[C.HEADER_LEN:], h)
    assert not isinstance(ei.value, ChecksumError)


def test_steps_must_be_zero_without_blocks():
    h = make_header((2, 2, 1, 0, 4), 1, 1)
    with pytest.raises(FormatError):
        pack_stream(h, [make_chunk(h, 0, steps=1), make_chunk(h, 1)])
    ok = make_chunk(h, 0)
    rec = bytearray(pack_chunk(ok))
    struct.pack_into("<I", rec, 28, 1)
    with pytest.raises(FormatError, match="steps"):
        unpack_chunk(fix_crcs(b"\0" * C.HEADER_LEN + bytes(rec))[C.HEADER_LEN:], h)


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


# ------------------------------------------------------------------ fuzzing

def _only_format_errors(fn, *args):
    try:
        return fn(*args)
    except FormatError:
        return None
    except Exception as e:  # pragma: no cover - this is the failure being hunted
        raise AssertionError(f"non-FormatError escaped: {type(e).__name__}: {e}") from e


@FAST
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(data):
    h, _ = golden_objects()
    for prefix in (b"", GOLDEN[:110], b"SPKC"):
        buf = prefix + data
        _only_format_errors(unpack_stream, buf)
        _only_format_errors(unpack_header, buf)
        _only_format_errors(unpack_chunk, buf, h)
        _only_format_errors(unpack_stream, fix_crcs(buf))


_VALID = pack_stream(*make_stream(make_header((3, 2, 1, 3, 4), 1, 2)))
_mutation = st.tuples(st.sampled_from(["set", "insert", "delete", "u32", "u64"]),
                      st.integers(0, len(_VALID) - 1), st.integers(0, 2**64 - 1))


@FAST
@given(st.lists(_mutation, min_size=1, max_size=4), st.booleans())
def test_fuzz_mutations(mutations, recrc):
    b = bytearray(_VALID)
    for kind, pos, val in mutations:
        pos = min(pos, len(b))
        if kind == "set":
            b[pos:pos + 1] = bytes([val & 0xFF])
        elif kind == "insert":
            b[pos:pos] = bytes([val & 0xFF])
        elif kind == "delete":
            del b[pos:pos + 1 + val % 8]
        else:
            size = 4 if kind == "u32" else 8
            b[pos:pos + size] = (val % 2**(8 * size)).to_bytes(size, "little")
    buf = fix_crcs(bytes(b)) if recrc else bytes(b)
    got = _only_format_errors(unpack_stream, buf)
    if got is not None:  # anything accepted must be the canonical encoding
        assert pack_stream(*got) == buf


@FAST
@given(st.integers(1, 6), st.integers(1, 3), st.integers(0, 9), st.integers(1, 9),
       st.integers(1, 70), st.integers(1, 7), st.binary(max_size=40), st.integers(0, 99),
       st.binary(max_size=40))
def test_fuzz_round_trip(layers, heads, tokens, dim, epl, lpc, aux, seed, bits):
    h = make_header((layers, 2, heads, tokens, dim), epl, lpc, dtype=1 + seed % 2,
                    model=1 + seed)
    chunks = [make_chunk(h, i, aux=aux, seed=seed, bits=bits[i:]) for i in range(h.n_chunks)]
    assert unpack_stream(pack_stream(h, chunks)) == (h, chunks)

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
