"""Malformed container input (speckv.coder.container): every byte change, truncation and
reordering of a stream, header fields and chunk-vs-header rules broken under a valid crc,
and hypothesis fuzzing (random bytes, mutations, round trips). A reader raises FormatError
(or a subclass) and nothing else, and whatever it accepts re-packs to the same bytes."""

from __future__ import annotations

import struct

import pytest
from container_helpers import (
    FAST,
    GOLDEN,
    fix_crcs,
    golden_objects,
    make_chunk,
    make_header,
    make_stream,
)
from hypothesis import given
from hypothesis import strategies as st

from speckv.coder import container as C
from speckv.coder.container import (
    ChecksumError,
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
    for bad in (0, 1, 6, 0xFFFF):
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
