"""Tests of the raw bit sections (``speckv.coder.bitpack``) against a pure-Python
string-of-bits reference: fields, unary codes, section splitting, and the
rejection of non-zero padding and wrong lengths (IntegrityError)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.coder.bitpack import (
    MAX_FIELD_BITS,
    pack_fields,
    pack_unary,
    split_sections,
    unpack_fields,
    unpack_unary,
)
from speckv.errors import IntegrityError, SpeckvError

PROPERTY = settings(max_examples=100, deadline=None, database=None)

# ----------------------------------------------------------- reference


def bits_to_bytes(bits: str) -> bytes:
    """MSB-first bit string -> bytes, zero-padded to a byte boundary."""
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))


def bytes_to_bits(buf: bytes) -> str:
    return "".join(format(b, "08b") for b in buf)


def ref_pack_fields(values, widths) -> bytes:
    return bits_to_bytes("".join(format(v, f"0{w}b") if w else "" for v, w in zip(values, widths, strict=True)))


def ref_unpack_fields(buf: bytes, widths) -> list[int]:
    bits, pos, out = bytes_to_bits(buf), 0, []
    for w in widths:
        out.append(int(bits[pos:pos + w], 2) if w else 0)
        pos += w
    return out


def ref_pack_unary(deltas) -> bytes:
    return bits_to_bytes("".join("0" * d + "1" for d in deltas))


def ref_unpack_unary(buf: bytes, n: int) -> list[int]:
    bits, out, run = bytes_to_bits(buf), [], 0
    for b in bits:
        if len(out) == n:
            break
        if b == "1":
            out.append(run)
            run = 0
        else:
            run += 1
    return out


@st.composite
def fields(draw, max_len=300):
    widths = draw(st.lists(st.integers(0, MAX_FIELD_BITS), max_size=max_len))
    values = [draw(st.integers(0, (1 << w) - 1)) for w in widths]
    return values, widths


# -------------------------------------------------------------- fields


@PROPERTY
@given(fields())
def test_pack_fields_matches_reference(vw):
    values, widths = vw
    buf = pack_fields(np.array(values, np.int64), np.array(widths, np.int64))
    assert isinstance(buf, bytes)
    assert buf == ref_pack_fields(values, widths)
    assert len(buf) == (sum(widths) + 7) // 8


@PROPERTY
@given(fields())
def test_unpack_fields_matches_reference(vw):
    values, widths = vw
    buf = ref_pack_fields(values, widths)
    out = unpack_fields(buf, np.array(widths, np.int64))
    assert out.tolist() == values == ref_unpack_fields(buf, widths)


@PROPERTY
@given(st.lists(st.integers(0, MAX_FIELD_BITS), min_size=1, max_size=50), st.randoms())
def test_fields_of_uint16_patterns(widths, rnd):
    """Values as the codec passes them: uint16 / int32 arrays of full 16-bit patterns."""
    values = [rnd.getrandbits(w) if w else 0 for w in widths]
    for dtype in (np.uint16, np.int32, np.int64):
        buf = pack_fields(np.array(values, dtype), np.array(widths))
        assert buf == ref_pack_fields(values, widths)
        assert unpack_fields(buf, np.array(widths)).tolist() == values


def test_fields_edge_cases():
    assert pack_fields(np.zeros(0, np.int64), np.zeros(0, np.int64)) == b""
    assert pack_fields(np.array([5, 7]), np.array([0, 0])) == b""  # zero-width fields take no bits
    assert unpack_fields(b"", np.zeros(0, np.int64)).tolist() == []
    assert unpack_fields(b"", np.array([0, 0, 0])).tolist() == [0, 0, 0]
    assert pack_fields(np.array([0xFFFF]), np.array([16])) == b"\xff\xff"
    assert pack_fields(np.array([1]), np.array([1])) == b"\x80"
    assert pack_fields(np.array([1, 0, 1]), np.array([1, 16, 1])) == bits_to_bytes("1" + "0" * 16 + "1")
    # trailing zero-width fields after the last byte still decode as 0
    assert unpack_fields(b"\xff\xff", np.array([16, 0, 0])).tolist() == [0xFFFF, 0, 0]
    # 2-D inputs are flattened
    v, w = np.array([[3, 1], [2, 0]]), np.array([[2, 1], [2, 3]])
    assert pack_fields(v, w) == ref_pack_fields([3, 1, 2, 0], [2, 1, 2, 3])


@PROPERTY
@given(fields(max_len=60).filter(lambda vw: sum(vw[1]) % 8), st.data())
def test_nonzero_field_padding_rejected(vw, data):
    values, widths = vw
    buf = bytearray(ref_pack_fields(values, widths))
    pad = 8 - sum(widths) % 8
    buf[-1] |= 1 << data.draw(st.integers(0, pad - 1))
    with pytest.raises(IntegrityError):
        unpack_fields(bytes(buf), np.array(widths))


@PROPERTY
@given(fields(max_len=60), st.sampled_from(["short", "long", "empty_extra"]))
def test_wrong_field_lengths_rejected(vw, how):
    values, widths = vw
    buf = ref_pack_fields(values, widths)
    if how == "short":
        if not buf:
            return
        bad = buf[:-1]
    elif how == "long":
        bad = buf + b"\x00"
    else:
        bad = buf + b"\x00" * 3
    with pytest.raises(IntegrityError):
        unpack_fields(bad, np.array(widths))


# --------------------------------------------------------------- unary


@PROPERTY
@given(st.lists(st.integers(0, 200), max_size=200))
def test_unary_matches_reference(deltas):
    buf = pack_unary(np.array(deltas, np.int64))
    assert isinstance(buf, bytes)
    assert buf == ref_pack_unary(deltas)
    assert len(buf) == (sum(deltas) + len(deltas) + 7) // 8
    out = unpack_unary(buf, len(deltas))
    assert out.tolist() == deltas == ref_unpack_unary(buf, len(deltas))


def test_unary_edge_cases():
    assert pack_unary(np.zeros(0, np.int64)) == b""
    assert unpack_unary(b"", 0).tolist() == []
    assert pack_unary(np.array([0])) == b"\x80"
    assert pack_unary(np.array([7])) == b"\x01"
    assert pack_unary(np.array([8])) == b"\x00\x80"
    assert pack_unary(np.zeros(8, np.int64)) == b"\xff"
    assert unpack_unary(b"\x00\x00\x01", 1).tolist() == [23]
    assert unpack_unary(b"\x00" * 40 + b"\x80", 1).tolist() == [320]


@PROPERTY
@given(st.lists(st.integers(0, 40), max_size=50), st.data())
def test_unary_wrong_counts_and_lengths_rejected(deltas, data):
    buf = ref_pack_unary(deltas)
    n = len(deltas)
    # asking for more codes than the buffer holds
    with pytest.raises(IntegrityError):
        unpack_unary(buf, n + 1)
    if n:
        # asking for fewer: the buffer holds one code too many
        with pytest.raises(IntegrityError):
            unpack_unary(buf, n - 1)
    # an extra zero byte after the last code
    with pytest.raises(IntegrityError):
        unpack_unary(buf + b"\x00", n)
    # a one bit in the padding is an extra code
    used = sum(deltas) + n
    if used % 8:
        bad = bytearray(buf)
        bad[-1] |= 1 << data.draw(st.integers(0, 7 - used % 8))
        with pytest.raises(IntegrityError):
            unpack_unary(bytes(bad), n)
    # a byte cut off the end loses the last code
    if buf:
        with pytest.raises(IntegrityError):
            unpack_unary(buf[:-1], n)


def test_unary_of_nothing_needs_an_empty_buffer():
    for buf in (b"\x00", b"\x80", b"\xff\xff"):
        with pytest.raises(IntegrityError):
            unpack_unary(buf, 0)


def test_unary_all_zero_buffer():
    with pytest.raises(IntegrityError):
        unpack_unary(b"\x00" * 16, 1)


# ------------------------------------------------------------ sections


def ref_split(buf: bytes, sizes):
    out, off = [], 0
    for i, s in enumerate(sizes):
        if s is None:
            assert i == len(sizes) - 1
            s = len(buf) - off
        if s < 0 or off + s > len(buf):
            return None
        out.append(buf[off:off + s])
        off += s
    return out if off == len(buf) else None


@PROPERTY
@given(st.binary(max_size=64), st.lists(st.integers(0, 70), max_size=5), st.booleans())
def test_split_sections_matches_reference(buf, sizes, rest):
    sizes = list(sizes) + ([None] if rest else [])
    want = ref_split(buf, sizes)
    if want is None:
        with pytest.raises(IntegrityError):
            split_sections(buf, sizes)
    else:
        got = split_sections(buf, sizes)
        assert got == want and all(isinstance(g, bytes) for g in got)


def test_split_sections_cases():
    assert split_sections(b"abcdef", [1, 2, None]) == [b"a", b"bc", b"def"]
    assert split_sections(b"abc", [3, None]) == [b"abc", b""]
    assert split_sections(b"", [0, 0, None]) == [b"", b"", b""]
    assert split_sections(b"", []) == []
    assert split_sections(memoryview(b"xy"), [1, 1]) == [b"x", b"y"]
    with pytest.raises(IntegrityError, match="stray"):
        split_sections(b"abc", [1, 1])
    with pytest.raises(IntegrityError):
        split_sections(b"abc", [2, 2])
    with pytest.raises(IntegrityError):
        split_sections(b"abc", [4, None])
    with pytest.raises(IntegrityError):
        split_sections(b"abc", [-1, None])


def test_errors_are_speckv_errors():
    assert issubclass(IntegrityError, SpeckvError)


# ---------------------------------------------- the codec's section layout


@PROPERTY
@given(fields(max_len=40), fields(max_len=40), st.lists(st.integers(0, 30), max_size=40))
def test_sections_round_trip_as_the_model_uses_them(a, b, deltas):
    """LOW | ZMAN | UNARY concatenated, each byte-padded, then split and unpacked."""
    (va, wa), (vb, wb) = a, b
    raw = (pack_fields(np.array(va, np.int64), np.array(wa, np.int64))
           + pack_fields(np.array(vb, np.int64), np.array(wb, np.int64))
           + pack_unary(np.array(deltas, np.int64)))
    sa, sb, su = split_sections(raw, [(sum(wa) + 7) // 8, (sum(wb) + 7) // 8, None])
    assert unpack_fields(sa, np.array(wa)).tolist() == va
    assert unpack_fields(sb, np.array(wb)).tolist() == vb
    assert unpack_unary(su, len(deltas)).tolist() == deltas
