"""The digests both ends of a transfer compute: 128-bit fingerprints (of mu, of a chunk's
raw KV, of a whole transfer) and the sha256 of the prompt token ids.

The 128-bit algorithm follows the stream's format version (coder/FORMAT.md): version 2
streams use blake2b-128, version 3 streams XXH3-128 (``xxhash.xxh3_128``, seed 0, its
canonical big-endian 16-byte digest), which hashes ~25x faster. Both guard against
accidental corruption alike (128 bits; neither is relied on against a forger: that is
the transport's TLS). Where no stream version is at hand (FetchKV), the peers name the
algorithm (``DigestAlgorithm`` in speckv.v1, whose values these constants are).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import xxhash

if TYPE_CHECKING:
    # numpy declares ndarray.__buffer__ for Python >= 3.12 only: on 3.10/3.11 an array is a
    # buffer at run time but not to the type checker
    from typing_extensions import Buffer

DIGEST_BYTES = 16  # size of every mu fingerprint, raw checksum and transfer digest
BLAKE2B_128 = 1  # speckv.v1 DIGEST_ALGORITHM_BLAKE2B_128: format version 2
XXH3_128 = 2  # speckv.v1 DIGEST_ALGORITHM_XXH3_128: format version 3
ALGORITHMS = {BLAKE2B_128: "blake2b-128", XXH3_128: "xxh3-128"}


class Hasher(Protocol):
    def update(self, data: "Buffer", /) -> None: ...

    def digest(self) -> bytes: ...


def algorithm_of(version: int) -> int:
    """The 128-bit digest of format version ``version`` streams (FORMAT.md)."""
    return XXH3_128 if version >= 3 else BLAKE2B_128


def hasher(algorithm: int) -> Hasher:
    """A fresh incremental hasher of ``algorithm``; ValueError for an unknown one."""
    if algorithm == XXH3_128:
        return cast(Hasher, xxhash.xxh3_128())
    if algorithm == BLAKE2B_128:
        return cast(Hasher, hashlib.blake2b(digest_size=DIGEST_BYTES))
    raise ValueError(f"unknown digest algorithm {algorithm}")


def _buffer(p: "bytes | bytearray | memoryview | np.ndarray") -> "Buffer":
    """A C-contiguous array hashed in place (no copy), little-endian as every digest is defined."""
    if not isinstance(p, np.ndarray):
        return p
    a = np.ascontiguousarray(p)
    return cast("Buffer", a.astype(a.dtype.newbyteorder("<"), copy=False))


def digest(*parts: "bytes | bytearray | memoryview | np.ndarray", algorithm: int) -> bytes:
    """The ``algorithm`` digest over byte strings or arrays (C-contiguous ones hashed in place)."""
    h = hasher(algorithm)
    for p in parts:
        h.update(_buffer(p))
    return h.digest()


def prompt_digest(ids: np.ndarray) -> bytes:
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).digest()


class KVDigest:
    """The whole-transfer digest (``algorithm``) over the layers in order, each as its FP8
    scales (two little-endian fp32, FP8 only) then its raw little-endian bytes.
    Encoder, decoder and client each compute it as layers pass by."""

    def __init__(self, algorithm: int) -> None:
        self.algorithm = algorithm
        self._h = hasher(algorithm)
        self.raw_bytes = 0

    def update_layer(self, layer: np.ndarray, scales: "np.ndarray | None" = None) -> None:
        if scales is not None:
            self._h.update(np.asarray(scales, "<f4").tobytes())
        a = _buffer(layer)
        self._h.update(a)
        self.raw_bytes += memoryview(a).nbytes

    def digest(self) -> bytes:
        return self._h.digest()
