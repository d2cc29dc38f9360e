"""Raw bit fields: variable-width fields and unary codes, MSB-first, vectorised.

Used for the parts of a symbol that are exactly uniform (low significand
bits, zero-bin mantissas, escaped raw symbols) or exactly geometric with
p = 1/2 (unary exponent distances): coding them raw costs the same bits as
rANS would, and keeps the rANS loop at one op per element.

Each section is padded with zero bits to a byte boundary.
"""

from __future__ import annotations

import numpy as np

from speckv.errors import IntegrityError

MAX_FIELD_BITS = 16
WINDOW_BYTES = 4  # every field (<= 16 bits at any bit offset) fits a 32-bit window


def _offsets(widths: np.ndarray) -> tuple[np.ndarray, int]:
    ends = np.cumsum(widths)
    return ends - widths, int(ends[-1]) if len(ends) else 0


def pack_fields(values: np.ndarray, widths: np.ndarray) -> bytes:
    """Concatenate ``values[i]`` in ``widths[i]`` bits each (0..16), MSB first."""
    widths = np.asarray(widths, np.int64).ravel()
    live = widths > 0
    v, w = np.asarray(values).ravel()[live].astype(np.int32), widths[live]
    total = int(w.sum())
    if total == 0:
        return b""
    # stream bit i = bit (end - 1 - i) of the field it falls in
    shift: np.ndarray = np.repeat((np.cumsum(w) - 1).astype(np.int32), w) - np.arange(total, dtype=np.int32)
    return np.packbits(((np.repeat(v, w) >> shift) & 1).astype(np.uint8)).tobytes()


def unpack_fields(buf: bytes, widths: np.ndarray) -> np.ndarray:
    """Inverse of ``pack_fields``; ``buf`` must hold exactly the padded fields."""
    widths = np.asarray(widths, np.int64).ravel()
    starts, total = _offsets(widths)
    _expect_len(buf, total, "bit fields")
    if total == 0:
        return np.zeros(len(widths), np.int64)
    if total % 8 and np.frombuffer(buf, np.uint8)[-1] & ((1 << (8 - total % 8)) - 1):
        raise IntegrityError("non-zero padding after bit fields")
    data = np.concatenate([np.frombuffer(buf, np.uint8), np.zeros(WINDOW_BYTES, np.uint8)])
    # big-endian 32-bit window at each field's first byte (unaligned uint32 reads)
    windows = np.ndarray(len(data) - 3, ">u4", data, 0, (1,))
    word = windows[starts >> 3].astype(np.uint32)
    w32 = widths.astype(np.uint32)
    return ((word << (starts & 7).astype(np.uint32)) >> (32 - w32)) * (w32 > 0)


def pack_unary(deltas: np.ndarray) -> bytes:
    """Each delta >= 0 as ``delta`` zeros then a one."""
    deltas = np.asarray(deltas, np.int64).ravel()
    if len(deltas) == 0:
        return b""
    ones = np.cumsum(deltas + 1) - 1
    bits = np.zeros(int(ones[-1]) + 1, np.uint8)
    bits[ones] = 1
    return np.packbits(bits).tobytes()


def unpack_unary(buf: bytes, n: int) -> np.ndarray:
    """Read ``n`` unary codes; the buffer must end right after the last one (plus padding)."""
    if n == 0:
        _expect_len(buf, 0, "unary codes")
        return np.zeros(0, np.int64)
    ones = np.flatnonzero(np.unpackbits(np.frombuffer(buf, np.uint8)))
    if len(ones) != n:
        raise IntegrityError(f"expected {n} unary codes, found {len(ones)}")
    _expect_len(buf, int(ones[-1]) + 1, "unary codes")
    return np.diff(ones, prepend=-1) - 1


def _expect_len(buf: bytes, nbits: int, what: str) -> None:
    if len(buf) != (nbits + 7) // 8:
        raise IntegrityError(f"{what}: {len(buf)} bytes for {nbits} bits")


def split_sections(buf: bytes, sizes: list[int | None]) -> list[bytes]:
    """Cut ``buf`` into sections of the given byte sizes; ``None`` takes the rest (last only)."""
    out, off = [], 0
    for size in sizes:
        size = len(buf) - off if size is None else size
        if size < 0 or off + size > len(buf):
            raise IntegrityError(f"bit sections need more than the {len(buf)} bytes present")
        out.append(bytes(buf[off:off + size]))
        off += size
    if off != len(buf):
        raise IntegrityError(f"{len(buf) - off} stray bytes after the bit sections")
    return out
