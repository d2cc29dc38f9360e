"""The encoder's chunk records: a batch of raw layers made into records, each as the
list of buffers ``ct.chunk_pieces`` / ``ct.stored_pieces`` return (the sender frames
its message parts straight from them: ``speckv.frames``)."""

from __future__ import annotations

from typing import cast

import numpy as np

from speckv.coder import container as ct
from speckv.coder.stored import stored_record

Layers = list[tuple[np.ndarray, "np.ndarray | None"]]  # each layer's bit patterns and FP8 scales
Records = list[tuple[list[memoryview], bool]]  # each chunk's record and whether it is stored


def _scales(got: Layers) -> np.ndarray | None:
    """The layers' FP8 scales ``(n, 2)``; None for BF16 (one dtype per transfer: every layer
    carries scales, or none does)."""
    return np.stack(cast("list[np.ndarray]", [g[1] for g in got])) if got[0][1] is not None else None


def store_batch(h: ct.StreamHeader, batch: list[int], got: Layers, start: int) -> Records:
    """Chunks ``batch`` stored, straight from their layers (``got`` begins at layer ``start``):
    nothing stacked or copied before the sender frames them."""
    out: Records = []
    for i in batch:
        s, n = h.chunk_layers(i)
        mine = got[s - start:s - start + n]
        out.append((stored_record(h, i, [g[0] for g in mine], _scales(mine)), True))
    return out


def code_batch(codec, h: ct.StreamHeader, idx: range, got: Layers, mu, stored: set[int]) -> Records:
    """Chunks ``idx`` coded (those in ``stored`` stored) in one codec pass, and whether each
    went stored (asked for, or the size guard)."""
    x = np.stack([g[0] for g in got])  # (layers, 2, heads, tokens, dim)
    return [(ct.chunk_pieces(c), ct.is_stored_chunk(h, c))
            for c in codec.encode_chunks(h, idx, x, mu, _scales(got), stored=stored)]
