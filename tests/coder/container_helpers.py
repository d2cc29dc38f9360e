"""Builders of valid headers, chunks and streams for the container tests."""

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
