"""Input mutation: bytes (flips, sets, insertions, deletions, splices, integer
fields of the container format), recomputed CRCs, lists of records or messages
(dropped, duplicated, swapped, truncated), odd strings and raw protobuf wire bytes.
"""

from __future__ import annotations

import random
import struct
import zlib
from typing import Sequence, TypeVar

import numpy as np

from speckv.coder import container as ct

T = TypeVar("T")
Fields = Sequence[tuple[int, int]]  # (offset, size) of a record's integer fields

INTERESTING = (0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF,
               0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)
SMALL_INTERESTING = INTERESTING[:21]  # those that fit in 32 bits
# FORMAT.md: the header record's fields, crc last
HEADER_FIELDS = [(4, 2), (6, 2), (8, 1), (9, 1), (10, 32), (42, 4), (46, 4), (50, 4), (54, 4), (58, 4),
                 (62, 32), (94, 2), (96, 4), (100, 2), (102, 4), (106, 4)]


def int_bytes(rng: random.Random, size: int, current: int | None = None) -> bytes:
    """A little-endian integer of ``size`` bytes: near ``current``, interesting, or random."""
    r = rng.random()
    if current is not None and r < 0.3:
        v = current + rng.choice((-2, -1, 1, 2, 16, -16))
    elif r < 0.8:
        v = rng.choice(INTERESTING) + rng.choice((0, 0, 0, -1, 1))
    else:
        v = rng.getrandbits(8 * size)
    return (v % (1 << (8 * size))).to_bytes(size, "little")


def rand_bytes(rng: random.Random, n: int) -> bytes:
    """``n`` random bytes; long runs from a Random seeded by ``rng`` (cheap under hypothesis)."""
    return rng.randbytes(n) if n <= 512 else random.Random(rng.getrandbits(64)).randbytes(n)


def _overwrite_field(rng: random.Random, b: bytearray, fields: Fields) -> None:
    off, size = rng.choice(fields)
    if off + size <= len(b):
        cur = int.from_bytes(b[off:off + size], "little") if size <= 8 else None
        b[off:off + size] = int_bytes(rng, size, cur) if size <= 8 else rng.randbytes(size)


def mutate_bytes(rng: random.Random, data: bytes, donors: Sequence[bytes] = (), fields: Fields = (),
                 max_ops: int = 4) -> bytes:
    """1..max_ops mutations of ``data``: bit flips, byte sets, insertions, deletions,
    truncation, appends, splices from ``donors``, integer overwrites (at the known
    ``fields`` or anywhere), duplicated ranges, whole replacement."""
    b = bytearray(data)
    for _ in range(rng.randint(1, max_ops)):
        op = rng.randrange(12)
        pos = rng.randrange(len(b) + 1)
        last = min(pos, len(b) - 1)
        if op == 0 and b:  # bit flip
            b[last] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # set a byte
            b[last] = rng.randrange(256)
        elif op == 2:  # insert
            b[pos:pos] = rng.randbytes(rng.choice((1, 1, 2, 4, 8, rng.randint(1, 300))))
        elif op == 3 and b:  # delete a range
            del b[pos:pos + rng.choice((1, 1, 2, 4, rng.randint(1, 300)))]
        elif op == 4:  # truncate
            del b[pos:]
        elif op == 5:  # append
            b += rng.randbytes(rng.randint(1, 64))
        elif op == 6 and donors:  # splice: a range of another record replaces a range of this one
            d = rng.choice(donors)
            s = rng.randrange(len(d) + 1)
            b[pos:pos + rng.randint(0, 300)] = d[s:s + rng.randint(0, 300)]
        elif op in (7, 8) and fields:  # a field of the format
            _overwrite_field(rng, b, fields)
        elif op == 9:  # an integer anywhere
            size = rng.choice((1, 2, 4, 8))
            b[pos:pos + size] = int_bytes(rng, size)
        elif op == 10 and b:  # duplicate a range
            s = rng.randrange(len(b))
            b[pos:pos] = b[s:s + rng.randint(1, 64)]
        elif op == 11 and rng.random() < 0.2:  # replace everything
            b = bytearray(rand_bytes(rng, rng.randint(0, 2 * len(b) + 16)))
    return bytes(b)


def fix_crcs(buf: bytes) -> bytes:
    """Recompute the crc of a header record at the start and of every chunk record that
    can be walked after it (or at the start when there is no header)."""
    b = bytearray(buf)
    off = 0
    if b[:4] == ct.MAGIC:
        if len(b) >= ct.HEADER_LEN:
            struct.pack_into("<I", b, 106, zlib.crc32(b[:106]))
        off = ct.HEADER_LEN
    while off + 12 <= len(b) and b[off:off + 4] == ct.CHUNK_MAGIC:
        (rl,) = struct.unpack_from("<Q", b, off + 4)
        if rl < ct.CHUNK_OVERHEAD or off + rl > len(b):
            break
        struct.pack_into("<I", b, off + rl - 4, zlib.crc32(b[off:off + rl - 4]))
        off += rl
    return bytes(b)


def mutate_record(rng: random.Random, rec: bytes, donors: Sequence[bytes], fields: Fields, p_fix: float,
                  max_ops: int = 4) -> bytes:
    """``mutate_bytes``, then (with probability ``p_fix``) the CRCs recomputed."""
    out = mutate_bytes(rng, rec, donors, fields, max_ops)
    return fix_crcs(out) if rng.random() < p_fix else out


def random_record(rng: random.Random, prefixes: Sequence[bytes], max_len: int, p_fix: float = 0.5) -> bytes:
    """One of ``prefixes`` and up to ``max_len`` random bytes, sometimes with fixed CRCs."""
    buf = rng.choice(prefixes) + rng.randbytes(rng.randint(0, max_len))
    return fix_crcs(buf) if rng.random() < p_fix else buf


def chunk_fields(rec: bytes, h: ct.StreamHeader) -> list[tuple[int, int]]:
    """(offset, size) of a valid chunk record's fields (FORMAT.md), counts and sections."""
    c, _ = ct.unpack_chunk(rec, h)
    s = 68 + len(c.aux)
    w = s + 128 * c.n_blocks
    d = w + 4 * c.n_blocks
    bl = d + 2 * c.words.size
    out = [(4, 8), (12, 4), (16, 4), (20, 4), (24, 4), (28, 4), (32, 16), (48, 16), (64, 4), (bl, 8),
           (len(rec) - 4, 4)]
    out += [(w + 4 * k, 4) for k in range(min(c.n_blocks, 8))]  # word counts
    out += [(s + 4 * k, 4) for k in range(0, 128 * c.n_blocks, 4)][:16]  # states
    if len(c.aux) >= 4:
        out += [(68, 4)]
    if len(c.bits):
        out += [(bl + 8, min(8, len(c.bits)))]
    return out


def fields_of(h: ct.StreamHeader, rec: bytes) -> list[tuple[int, int]]:
    """``chunk_fields`` of a record, or none when it does not parse."""
    try:
        return chunk_fields(rec, h)
    except ct.FormatError:
        return []


def record_fields(records: Sequence[bytes]) -> list[list[tuple[int, int]]]:
    """The fields of each record of a valid stream (header record first)."""
    h, _ = ct.unpack_header(records[0])
    return [HEADER_FIELDS] + [chunk_fields(r, h) for r in records[1:]]


def restructure(rng: random.Random, items: Sequence[T], op: int) -> list[T]:
    """List operation ``op`` on a copy of ``items``: 0 drop one, 1 duplicate one,
    2 swap two, 3 truncate."""
    items = list(items)
    if not items:
        return items
    k = rng.randrange(len(items))
    if op == 0:
        del items[k]
    elif op == 1:
        items.insert(k, items[k])
    elif op == 2:
        j = rng.randrange(len(items))
        items[k], items[j] = items[j], items[k]
    else:
        items = items[:rng.randrange(len(items) + 1)]
    return items


def _merge_or_split(rng: random.Random, items: list[tuple[bytes, Fields]]) -> list[tuple[bytes, Fields]]:
    k = rng.randrange(len(items))
    rec = items[k][0]
    if rng.random() < 0.5 and k + 1 < len(items):  # two records in one buffer
        return items[:k] + [(rec + items[k + 1][0], ())] + items[k + 2:]
    p = rng.randrange(len(rec) + 1)
    return items[:k] + [(rec[:p], ()), (rec[p:], ())] + items[k + 1:]


def mutate_record_list(rng: random.Random, recs: Sequence[bytes], donors: Sequence[bytes],
                       fields: Sequence[Fields], p_fix: float) -> list[bytes]:
    """1..3 mutations of a record list: one record's bytes, records dropped, duplicated,
    swapped, cut off, inserted (from ``donors`` or random), merged or split."""
    items = list(zip(recs, fields, strict=True))
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(10)
        if op < 4 and items:  # the bytes of one record
            k = rng.randrange(len(items))
            rec, f = items[k]
            items[k] = (mutate_record(rng, rec, donors, f, p_fix), f)
        elif 4 <= op < 8:
            items = restructure(rng, items, op - 4)
        elif op == 8:
            new = rng.choice(donors) if rng.random() < 0.8 else rng.randbytes(rng.randint(0, 200))
            items.insert(rng.randrange(len(items) + 1), (new, ()))
        elif op == 9 and items:
            items = _merge_or_split(rng, items)
    return [r for r, _ in items]


def flip_bit(rng: random.Random, a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` with one bit of one element flipped."""
    a = a.copy()
    u = a.reshape(-1).view(f"u{a.itemsize}")  # the bit patterns (a signed sign bit overflows)
    u[rng.randrange(a.size)] ^= u.dtype.type(1 << rng.randrange(8 * a.itemsize))
    return a


def as_buffer(rng: random.Random, b: bytes) -> bytes | bytearray | memoryview:
    """``b`` as bytes, a bytearray or a memoryview (the parsers take any buffer)."""
    k = rng.randrange(4)
    return b if k < 2 else bytearray(b) if k == 2 else memoryview(b)


def odd_string(rng: random.Random) -> str:
    """An empty, control-character, non-ASCII, over-long or path-like string."""
    r = rng.random()
    if r < 0.15:
        return ""
    if r < 0.3:
        return "".join(chr(rng.choice((0, 1, 10, 13, 0x7F, 0xE9, 0x2028, 0xFFFD, 0x1F600, 0xD7FF, 0x10FFFF)))
                       for _ in range(rng.randint(1, 8)))
    if r < 0.45:
        return "x" * rng.choice((255, 256, 257, 300, 1024))
    if r < 0.5:
        return "y" * rng.choice((10_000, 15_000))  # long but within gRPC's metadata limit when echoed
    if r < 0.55:
        return "\U0001F600" * rng.randint(60, 80)  # <= 256 code points, > 256 bytes
    if r < 0.6:
        return "/../" + "%00" + "'\"\\"
    return "".join(chr(rng.randrange(0x20, 0x7F)) for _ in range(rng.randint(1, 40)))


def _varint(v: int) -> bytes:
    out = b""
    while True:
        out += bytes([(v & 0x7F) | (0x80 if v > 0x7F else 0)])
        v >>= 7
        if not v:
            return out


def random_wire_message(rng: random.Random) -> bytes:
    """Valid protobuf wire format of 1..4 arbitrary fields (varints and short byte
    strings): it parses, with fields unknown or of odd values."""
    out = b""
    for _ in range(rng.randint(1, 4)):
        fnum, wt = rng.randint(1, 12), rng.choice((0, 2))
        out += bytes([(fnum << 3) | wt])
        if wt == 0:
            out += _varint(rng.choice(INTERESTING))
        else:
            body = rng.randbytes(rng.randint(0, 20))
            out += bytes([len(body)]) + body
    return out
