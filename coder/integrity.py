"""Checksums of the stream's content: blake2b-128 fingerprints of mu and of the raw
KV of each chunk, and the sha256 prompt digest. A decoded chunk is only ever
returned through ``verified``, which raises IntegrityError on any mismatch.
"""

from __future__ import annotations

import hashlib

import numpy as np

from . import container as ct
from .errors import IntegrityError

DIGEST_BYTES = 16  # blake2b digest size of mu fingerprints and raw checksums


def digest(*parts: "bytes | np.ndarray") -> bytes:
    """blake2b-128 over byte strings or C-contiguous arrays (hashed in place, no copy)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for p in parts:
        h.update(np.ascontiguousarray(p) if isinstance(p, np.ndarray) else p)
    return h.digest()


def prompt_digest(ids: np.ndarray) -> bytes:
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).digest()


def verified(c: ct.Chunk, bits: np.ndarray, dtype: type | None = None) -> np.ndarray:
    """``bits`` (chunk c's decoded layers) as ``dtype``, checked against c's raw_digest."""
    if dtype is not None:
        bits = np.ascontiguousarray(bits, dtype)
    if c.raw_digest != digest(c.aux, bits):
        raise IntegrityError(f"chunk {c.index}: decoded KV fails its checksum")
    return bits


class KVDigest:
    """The whole-transfer digest: blake2b-128 over the layers in order, each as its
    FP8 scales (two little-endian fp32, FP8 only) then its raw little-endian bytes.
    Encoder, decoder and client each compute it as layers pass by."""

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=DIGEST_BYTES)
        self.raw_bytes = 0

    def update_layer(self, layer: np.ndarray, scales: "np.ndarray | None" = None) -> None:
        if scales is not None:
            self._h.update(np.asarray(scales, "<f4").tobytes())
        a = np.ascontiguousarray(layer)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        self._h.update(a)
        self.raw_bytes += a.nbytes

    def digest(self) -> bytes:
        return self._h.digest()
