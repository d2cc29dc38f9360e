"""The container's low-level pieces (``container.py`` uses them; FORMAT.md has the
layout): field validators that raise FormatError, the chunk-record writer, and the
chunk-record reader's first steps (magic, length and crc; the little-endian arrays;
the bits section). The limits are the caller's (``container.MAX_*``, read at call time).

The writer emits a record as a list of buffers, the chunk's arrays and bits read in
place and the crc32 computed over them as they are: ``b"".join`` of the list is the
record with one copy of its bytes, and a sender may cut its message parts straight
from the buffers (``speckv.wire.record_slices``) instead, copying nothing twice.
"""

from __future__ import annotations

import operator
import struct
from typing import TYPE_CHECKING, Sequence, SupportsIndex, Union, cast

import numpy as np

from speckv.errors import ChecksumError, FormatError, TruncatedError

if TYPE_CHECKING:
    from typing_extensions import Buffer as BufferProtocol  # an ndarray is one (declared for 3.12+ only)

try:  # zlib-ng's crc32 (speckv[server]): the same CRC-32 as zlib's, SIMD-accelerated (~5x here)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover -- zlib's, the same values
    from zlib import crc32

Buffer = Union[bytes, bytearray, memoryview]

CHUNK_MAGIC = b"SPKC"
CHUNK = struct.Struct("<4sQIIIII16s16sI")  # fixed part of a chunk record, up to aux_len
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
CHUNK_OVERHEAD = CHUNK.size + 8 + 4  # 80: fixed part, bits_len and crc


def check_uint(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool):
        raise FormatError(f"{name} must be an integer, got bool")
    try:
        v = operator.index(cast(SupportsIndex, value))  # a non-integer still raises TypeError
    except TypeError:
        raise FormatError(f"{name} must be an int, not {type(value).__name__}") from None
    if not lo <= v <= hi:
        raise FormatError(f"{name}={v} outside [{lo}, {hi}]")
    return v


def check_digest(name: str, value: object, size: int) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise FormatError(f"{name} must be bytes, got {type(value).__name__}")
    b = bytes(value)
    if len(b) != size:
        raise FormatError(f"{name} must be {size} bytes, got {len(b)}")
    return b


def check_blob(name: str, value: object, limit: int, limit_name: str) -> bytes:
    """Validate a variable-length byte field; return it as an owned ``bytes``."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise FormatError(f"{name} must be bytes, got {type(value).__name__}")
    b = bytes(value)
    if len(b) > limit:
        raise FormatError(f"{name} of {len(b)} bytes exceeds {limit_name}={limit}")
    return b


def need(buf: memoryview, n: int, what: str) -> None:
    if len(buf) < n:
        raise TruncatedError(f"{what}: need {n} bytes, have {len(buf)}")


def check_magic(buf: memoryview, magic: bytes, what: str) -> None:
    head = bytes(buf[: len(magic)])
    if head != magic[: len(head)]:
        raise FormatError(f"{what}: bad magic {head!r}")
    need(buf, len(magic), what)


def check_crc(body: memoryview, stored: int, what: str) -> None:
    actual = crc32(body)
    if actual != stored:
        raise ChecksumError(f"{what}: crc32 {stored:#010x} != computed {actual:#010x}")


def flat(b: "Buffer | np.ndarray", wire: str | None = None) -> memoryview:
    """``b`` as a flat byte view, no copy: an array C-contiguous (copied only if it is not)
    and, with ``wire`` (e.g. ``"<u4"``), in that dtype (a no-op on a little-endian host)."""
    if isinstance(b, np.ndarray):
        a = np.ascontiguousarray(b)
        if wire is not None:
            a = a.astype(wire, copy=False)
        return memoryview(cast("BufferProtocol", a.reshape(-1).view(np.uint8)))
    m = memoryview(b)
    return m if m.format == "B" and m.ndim == 1 else m.cast("B")


def record_pieces(fields: tuple[int, int, int, int, int, bytes, bytes], aux: bytes,
                  arrays: Sequence[memoryview], bits: Sequence[memoryview], max_record: int) -> list[memoryview]:
    """A chunk record (FORMAT.md) as buffers; ``fields`` = (index, layer_start, layer_count,
    n_blocks, steps, mu_fingerprint, raw_digest), all validated; ``arrays`` the states,
    word_counts and words as little-endian bytes; ``bits`` the bits section's pieces."""
    bits_len = sum(len(b) for b in bits)
    record_len = CHUNK_OVERHEAD + len(aux) + sum(len(a) for a in arrays) + bits_len
    if record_len > max_record:
        raise FormatError(f"record of {record_len} bytes exceeds MAX_CHUNK_BYTES")
    index, start, count, n_blocks, steps, mu, raw = fields
    fixed = CHUNK.pack(CHUNK_MAGIC, record_len, index, start, count, n_blocks, steps, mu, raw, len(aux))
    out = [memoryview(fixed), memoryview(aux), *arrays, memoryview(U64.pack(bits_len)), *bits]
    crc = 0
    for p in out:
        crc = crc32(p, crc)
    out.append(memoryview(U32.pack(crc)))
    return out


def read_record(mv: memoryview, max_record: int) -> memoryview:
    """Steps 1-3 of the reader order: magic, record_len bounds (``max_record``:
    MAX_CHUNK_BYTES), crc. The record, a view into ``mv``."""
    check_magic(mv, CHUNK_MAGIC, "chunk")
    need(mv, 12, "chunk")
    (record_len,) = struct.unpack_from("<Q", mv, 4)
    if record_len < CHUNK_OVERHEAD:
        raise FormatError(f"chunk record_len {record_len} < {CHUNK_OVERHEAD}")
    if record_len > max_record:
        raise FormatError(f"chunk record_len {record_len} exceeds MAX_CHUNK_BYTES")
    need(mv, record_len, "chunk")
    rec = mv[:record_len]
    check_crc(rec[:-4], U32.unpack_from(rec, record_len - 4)[0], "chunk")
    return rec


def le_array(rec: memoryview, offset: int, count: int, wire: str, native: type,
             shape: tuple[int, ...] | None = None, borrow: bool = False) -> np.ndarray:
    """Owned native-endian copy of ``count`` little-endian items at ``offset``; with ``borrow``
    a read-only view of ``rec`` where the host is little-endian and the items are aligned (a copy
    elsewhere: an odd-length aux leaves a chunk's u16 words at an odd offset, and native code
    reads them through typed pointers)."""
    a = np.frombuffer(rec, dtype=wire, count=count, offset=offset)
    view = borrow and a.flags.aligned
    out: np.ndarray = a.reshape(shape if shape is not None else (count,)).astype(native, copy=not view)
    if not out.flags.owndata:
        out.flags.writeable = False  # NOTE: the record's bytes: nothing may write through the view
    return out


def read_bits(rec: memoryview, b_off: int, index: int, max_bits: int) -> memoryview:
    """The ``bits`` section whose u64 length is at ``b_off`` (a view into ``rec``);
    ``max_bits``: MAX_BITS_BYTES."""
    if b_off + 8 > len(rec) - 4:
        raise FormatError(f"chunk {index}: record_len {len(rec)} leaves no room for bits_len")
    (bits_len,) = U64.unpack_from(rec, b_off)
    if b_off + 8 + bits_len + 4 != len(rec):
        raise FormatError(f"chunk {index}: record_len {len(rec)} disagrees with counts")
    if bits_len > max_bits:
        raise FormatError(f"chunk {index}: bits_len {bits_len} exceeds MAX_BITS_BYTES")
    return rec[b_off + 8: b_off + 8 + bits_len]
