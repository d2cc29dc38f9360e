"""Stored streams (FORMAT.md, model 0): chunk records that carry the raw KV bytes
instead of rANS blocks. No predictor is involved; the raw digest still guards
every chunk. The uncoded baseline of the transfer benchmarks.
"""

from __future__ import annotations

import numpy as np

from speckv.digests import DIGEST_BYTES, digest
from speckv.errors import IntegrityError

from . import container as ct
from .integrity import verified
from .rans import LANES


def stored_chunk(h: ct.StreamHeader, i: int, x: np.ndarray, scales: np.ndarray | None) -> ct.Chunk:
    """Chunk i of a stored stream (FORMAT.md, model 0): raw little-endian elements in ``bits``."""
    start, count = h.chunk_layers(i)
    aux = b"" if scales is None else np.asarray(scales, "<f4").tobytes()
    x = np.ascontiguousarray(x)
    raw = x.astype(x.dtype.newbyteorder("<"), copy=False).tobytes()
    return ct.Chunk(index=i, layer_start=start, layer_count=count, steps=0,
                    mu_fingerprint=bytes(DIGEST_BYTES), raw_digest=digest(aux, x), aux=aux,
                    states=np.zeros((0, LANES), np.uint32), word_counts=np.zeros(0, np.uint32),
                    words=np.zeros(0, np.uint16), bits=raw)


def unstored_chunk(h: ct.StreamHeader, c: ct.Chunk) -> np.ndarray:
    """The verified layers ``(layer_count, 2, heads, tokens, dim)`` of a stored chunk."""
    dt = np.dtype("<u2") if h.dtype == ct.DTYPE_BF16 else np.dtype("u1")
    shape = (c.layer_count,) + h.shape[1:]
    need = int(np.prod(shape)) * dt.itemsize
    if len(c.bits) != need:
        raise IntegrityError(f"chunk {c.index}: stored chunk holds {len(c.bits)} bytes, needs {need}")
    if h.dtype == ct.DTYPE_FP8 and len(c.aux) != 8 * c.layer_count:
        raise IntegrityError(f"chunk {c.index}: FP8 scales take {8 * c.layer_count} bytes, not {len(c.aux)}")
    bits = np.frombuffer(c.bits, dt).astype(dt.newbyteorder("="), copy=True).reshape(shape)
    return verified(c, bits)
