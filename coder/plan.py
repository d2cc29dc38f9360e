"""A stream's symbols before coding: formats, bits, mu and sigma (``Plan``), and
the per-element contexts both sides derive from them.

Lifecycle: ``Codec._plan`` builds a Plan for a range of layers (mu corrected by
the stream's residual model); ``Codec._context`` asks ``bf16_context_table``
(BF16: one gather per element) or ``plan_context`` (FP8: ``model.context``)
for the contexts of one chunk's layers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from speckv.digests import XXH3_128, digest
from speckv.errors import IntegrityError

from . import container as ct
from .model import BF16, Context, ContextTable, FloatFormat, context
from .residual import ResidualModel


@dataclass
class Plan:
    """One stream's symbols: formats, bits, mu, sigma per (layer, kv, head, dim)."""

    fmt: FloatFormat  # of x
    fmt_mu: FloatFormat  # of mu (FP32 mu / scale for FP8 KV)
    x: np.ndarray | None  # (layers, 2, heads, tokens, dim) bit patterns (None when decoding)
    mu: np.ndarray  # same shape, the predictor's bit patterns in fmt_mu
    log2_sigma: np.ndarray  # (layers, 2, heads, dim) int64 fixed point
    scales: np.ndarray | None  # (layers, 2) float32 for fp8
    model: ResidualModel  # tables, sigma and mu correction of the stream's model id
    layer0: int = 0  # absolute index of the plan's first layer (arrays hold a layer range)

    def chunk_slice(self, h: ct.StreamHeader, i: int) -> slice:
        """Chunk i's layers, relative to the plan's arrays."""
        start, count = h.chunk_layers(i)
        return slice(start - self.layer0, start - self.layer0 + count)

    def aux(self, sl: slice) -> bytes:
        return b"" if self.scales is None else self.scales[sl].astype("<f4").tobytes()


TABLES: dict[bytes, ContextTable] = {}  # by sigma digest: codecs of one checkpoint share one
TABLES_LOCK = threading.Lock()  # worker threads (and sidecars) may all ask at once


def bf16_context_table(log2_sigma: np.ndarray) -> ContextTable:
    """The BF16 context table of these sigmas, built once per process (~1.5 s)."""
    key = digest(np.ascontiguousarray(log2_sigma, np.int64), str(log2_sigma.shape).encode(), algorithm=XXH3_128)
    with TABLES_LOCK:
        if key not in TABLES:
            TABLES[key] = ContextTable(BF16, BF16, log2_sigma)
        return TABLES[key]


def mu_float32(mu: np.ndarray) -> np.ndarray:
    """BF16 mu bit patterns (uint16) as exact float32 numpy."""
    return (mu.astype(np.uint32) << 16).view(np.float32)


def fp8_codes(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"FP8 KV codes must be uint8 e4m3 patterns, not {codes.dtype}")
    return np.ascontiguousarray(codes)


def plan_context(plan: Plan, sl: slice) -> Context:
    mu = plan.mu[sl]  # (n_layers, 2, heads, tokens, dim)
    lg = plan.log2_sigma[sl]
    lg = np.broadcast_to(lg[:, :, :, None, :] if lg.ndim == 4 else lg, mu.shape)
    return context(plan.fmt, plan.fmt_mu, mu.ravel(), lg.ravel())


def whole_record(rec: bytes, parsed: tuple[Any, int]) -> Any:
    """The parsed record, which must span all of ``rec`` (nothing may follow a record)."""
    obj, used = parsed
    if used != memoryview(rec).nbytes:
        raise ct.FormatError(f"{memoryview(rec).nbytes - used} trailing bytes after a {used}-byte record")
    return obj


def chunk_rel(h: ct.StreamHeader, i: int, start: int) -> slice:
    """Chunk i's layers relative to layer ``start``."""
    s, n = h.chunk_layers(i)
    return slice(s - start, s - start + n)


def chunk_scales(chunks: Sequence[ct.Chunk]) -> np.ndarray:
    """The FP8 scales ``(layers, 2)`` the chunks carry in ``aux``."""
    parts = []
    for c in chunks:
        if len(c.aux) != 8 * c.layer_count:
            raise IntegrityError(f"chunk {c.index}: FP8 scales take {8 * c.layer_count} bytes, not {len(c.aux)}")
        parts.append(np.frombuffer(c.aux, "<f4").astype(np.float32).reshape(c.layer_count, 2))
    return np.concatenate(parts) if parts else np.zeros((0, 2), np.float32)


def runs(indices: Sequence[int]) -> list[slice]:
    """Positions of the maximal runs of consecutive chunk indices in ``indices`` (the
    backends code and decode consecutive chunks only)."""
    cuts = [p for p in range(1, len(indices)) if indices[p] != indices[p - 1] + 1]
    bounds = [0, *cuts, len(indices)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
