"""Builders of valid headers, chunks and streams for the container tests, and a golden
stream (``GOLDEN``: format version 3, one FP8 chunk) with its objects."""

from __future__ import annotations

import struct
import zlib

import numpy as np
from hypothesis import HealthCheck, settings

from speckv.coder import container as C
from speckv.coder.container import (
    Chunk,
    StreamHeader,
)

FAST = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def make_header(shape=(3, 2, 2, 5, 4), epl=2, lpc=2, dtype=C.DTYPE_BF16, model=3):
    return StreamHeader(dtype=dtype, model=model, pin=bytes(range(32)), shape=shape,
                        prompt_digest=bytes(range(32, 64)), elems_per_lane=epl,
                        layers_per_chunk=lpc)


def make_chunk(h: StreamHeader, i: int, aux=b"", seed=0, steps=None, bits=None) -> Chunk:
    """A valid chunk ``i`` of ``h``; ``bits=None`` draws 1..11 random bytes."""
    rng = np.random.default_rng(seed + 1000 * i)
    nb = h.chunk_blocks(i)
    counts = rng.integers(0, 6, nb, dtype=np.uint32)
    start, count = h.chunk_layers(i)
    return Chunk(index=i, layer_start=start, layer_count=count,
                 steps=(min(3, 16 * h.elems_per_lane) if nb else 0) if steps is None else steps,
                 mu_fingerprint=bytes([i + 1]) * 16, raw_digest=bytes([i + 2]) * 16, aux=aux,
                 states=rng.integers(0, 2**32, (nb, C.LANES), dtype=np.uint32),
                 word_counts=counts,
                 words=rng.integers(0, 2**16, int(counts.sum()), dtype=np.uint16),
                 bits=rng.bytes(int(rng.integers(1, 12))) if bits is None else bits)


def make_stream(h=None, aux=b"\x01\x02", bits=None):
    h = h or make_header()
    return h, [make_chunk(h, i, aux=aux if i == 0 else b"", bits=bits)
               for i in range(h.n_chunks)]


def fix_crcs(buf: bytes) -> bytes:
    """Recompute the crc of the header and of every chunk record that can be walked."""
    b = bytearray(buf)
    if len(b) >= C.HEADER_LEN:
        struct.pack_into("<I", b, 106, zlib.crc32(b[:106]))
    off = C.HEADER_LEN
    while off + 12 <= len(b):
        (rl,) = struct.unpack_from("<Q", b, off + 4)
        if rl < C.CHUNK_OVERHEAD or off + rl > len(b):
            break
        struct.pack_into("<I", b, off + rl - 4, zlib.crc32(b[off:off + rl - 4]))
        off += rl
    return bytes(b)


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
