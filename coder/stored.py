"""Stored chunks (FORMAT.md): chunk records that carry the raw KV bytes instead of
rANS blocks. Every chunk of a stored stream (model 0, the uncoded baseline of the
transfer benchmarks), and from format version 3 any chunk of a coded stream that
goes without the predictor (the sidecars' mu differ on it) or would be larger coded
(the size guard: ``stored_record_len``). No predictor is involved; the raw digest
still guards every chunk.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from speckv.digests import DIGEST_BYTES, algorithm_of, digest
from speckv.errors import IntegrityError
from speckv.kv import bf16_bits

from . import container as ct
from .integrity import verified
from .plan import chunk_rel, fp8_codes
from .rans import LANES


def element_bits(h: ct.StreamHeader, x: np.ndarray) -> np.ndarray:
    """``x`` as the bit patterns ``h`` stores: uint16 BF16 (from uint16/int16) or uint8 e4m3
    codes; TypeError for another dtype."""
    return bf16_bits(x) if h.dtype == ct.DTYPE_BF16 else fp8_codes(x)


def stored_record_len(h: ct.StreamHeader, i: int) -> int:
    """``record_len`` of chunk i in its stored form: no coded chunk of a version 3 stream is
    written larger (the size guard)."""
    count = h.chunk_layers(i)[1]
    aux, size = (0, 2) if h.dtype == ct.DTYPE_BF16 else (8 * count, 1)
    return ct.CHUNK_OVERHEAD + aux + h.chunk_elements(i) * size


def stored_chunk(h: ct.StreamHeader, i: int, x: np.ndarray, scales: np.ndarray | None) -> ct.Chunk:
    """Chunk i stored (FORMAT.md, model 0 or a version 3 stored chunk): raw little-endian
    elements in ``bits``; ``x`` holds its layers' bit patterns, ``scales`` their FP8 scales."""
    start, count = h.chunk_layers(i)
    aux = b"" if scales is None else np.asarray(scales, "<f4").tobytes()
    x = np.ascontiguousarray(x)
    raw = x.astype(x.dtype.newbyteorder("<"), copy=False).tobytes()
    return ct.Chunk(index=i, layer_start=start, layer_count=count, steps=0, mu_fingerprint=bytes(DIGEST_BYTES),
                    raw_digest=digest(aux, x, algorithm=algorithm_of(h.version)), aux=aux,
                    states=np.zeros((0, LANES), np.uint32), word_counts=np.zeros(0, np.uint32),
                    words=np.zeros(0, np.uint16), bits=raw)


def stored_chunks(h: ct.StreamHeader, idx: Iterable[int], x: np.ndarray, scales: np.ndarray | None,
                  start: int) -> dict[int, ct.Chunk]:
    """Chunks ``idx`` stored, by index, from a batch whose ``x`` (bit patterns) and FP8
    ``scales`` begin at layer ``start``."""
    out = {}
    for i in idx:
        r = chunk_rel(h, i, start)
        out[i] = stored_chunk(h, i, element_bits(h, x[r]), None if scales is None else scales[r])
    return out


def stored_record(h: ct.StreamHeader, i: int, layers: Sequence[np.ndarray],
                  scales: np.ndarray | None) -> list[memoryview]:
    """Chunk i's stored record as buffers (``ct.stored_pieces``) straight from its layers'
    bit patterns (``layer_count`` arrays ``(2, heads, tokens, dim)``, native uint16 BF16 or
    uint8 e4m3; ``scales`` their ``(layer_count, 2)`` FP8 scales): joined, it is
    ``pack_chunk(stored_chunk(h, i, np.stack(layers), scales))``; the layers are hashed and
    framed where they lie, never stacked or copied."""
    start, count = h.chunk_layers(i)
    if len(layers) != count or any(tuple(x.shape) != h.shape[1:] for x in layers):
        raise ValueError(f"chunk {i} needs {count} layers of shape {h.shape[1:]}")
    aux = b"" if scales is None else np.asarray(scales, "<f4").tobytes()
    bits = [element_bits(h, x) for x in layers]
    raw_digest = digest(aux, *bits, algorithm=algorithm_of(h.version))
    return ct.stored_pieces(i, start, count, raw_digest, aux, bits)


def unstored_chunk(h: ct.StreamHeader, c: ct.Chunk) -> np.ndarray:
    """The verified layers ``(layer_count, 2, heads, tokens, dim)`` of a stored chunk (a
    read-only view of its bits on a little-endian host: callers copy what they keep)."""
    dt = np.dtype("<u2") if h.dtype == ct.DTYPE_BF16 else np.dtype("u1")
    shape = (c.layer_count,) + h.shape[1:]
    need = int(np.prod(shape)) * dt.itemsize
    if len(c.bits) != need:
        raise IntegrityError(f"chunk {c.index}: stored chunk holds {len(c.bits)} bytes, needs {need}")
    if h.dtype == ct.DTYPE_FP8 and len(c.aux) != 8 * c.layer_count:
        raise IntegrityError(f"chunk {c.index}: FP8 scales take {8 * c.layer_count} bytes, not {len(c.aux)}")
    bits = np.frombuffer(c.bits, dt).astype(dt.newbyteorder("="), copy=False).reshape(shape)
    return verified(c, bits, h.version)
