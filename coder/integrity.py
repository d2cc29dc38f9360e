"""The check every decoded chunk passes: it is only ever returned through
``verified``, which raises IntegrityError unless its raw bytes match the chunk's
``raw_digest``, computed as the stream's format version defines it (blake2b-128 in
version 2, XXH3-128 in version 3; the digests themselves are ``speckv.digests``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from speckv.digests import algorithm_of, digest
from speckv.errors import IntegrityError

from . import container as ct

if TYPE_CHECKING:
    from numpy.typing import DTypeLike


def verified(c: ct.Chunk, bits: np.ndarray, version: int, dtype: DTypeLike | None = None) -> np.ndarray:
    """``bits`` (chunk c's decoded layers, from a format ``version`` stream) as ``dtype``,
    checked against c's raw_digest."""
    if dtype is not None:
        bits = np.ascontiguousarray(bits, dtype)
    if c.raw_digest != digest(c.aux, bits, algorithm=algorithm_of(version)):
        raise IntegrityError(f"chunk {c.index}: decoded KV fails its checksum")
    return bits
