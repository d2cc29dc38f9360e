"""The check every decoded chunk passes: it is only ever returned through
``verified``, which raises IntegrityError unless its raw bytes match the chunk's
blake2b-128 ``raw_digest`` (the digests themselves are ``speckv.digests``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from speckv.digests import digest
from speckv.errors import IntegrityError

from . import container as ct

if TYPE_CHECKING:
    from numpy.typing import DTypeLike


def verified(c: ct.Chunk, bits: np.ndarray, dtype: DTypeLike | None = None) -> np.ndarray:
    """``bits`` (chunk c's decoded layers) as ``dtype``, checked against c's raw_digest."""
    if dtype is not None:
        bits = np.ascontiguousarray(bits, dtype)
    if c.raw_digest != digest(c.aux, bits):
        raise IntegrityError(f"chunk {c.index}: decoded KV fails its checksum")
    return bits
