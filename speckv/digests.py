"""The digests both ends of a transfer compute: blake2b-128 fingerprints (of mu, of a
chunk's raw KV, of a whole transfer) and the sha256 of the prompt token ids."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, cast

import numpy as np

if TYPE_CHECKING:
    # numpy declares ndarray.__buffer__ for Python >= 3.12 only: on 3.10/3.11 an array is a
    # buffer at run time but not to the type checker
    from typing_extensions import Buffer

DIGEST_BYTES = 16  # blake2b digest size of mu fingerprints and raw checksums


def digest(*parts: "bytes | np.ndarray") -> bytes:
    """blake2b-128 over byte strings or C-contiguous arrays (hashed in place, no copy)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for p in parts:
        h.update(cast("Buffer", np.ascontiguousarray(p)) if isinstance(p, np.ndarray) else p)
    return h.digest()


def prompt_digest(ids: np.ndarray) -> bytes:
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).digest()


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
        self._h.update(cast("Buffer", a))
        self.raw_bytes += a.nbytes

    def digest(self) -> bytes:
        return self._h.digest()
