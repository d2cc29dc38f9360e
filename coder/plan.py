"""A stream's symbols before coding: formats, bits, mu and sigma (``Plan``), and
the per-element contexts both sides derive from them.

Lifecycle: ``Codec._plan`` builds a Plan for a range of layers (mu corrected by
the stream's residual model); ``Codec._context`` asks ``bf16_context_table``
(BF16: one gather per element) or ``plan_context`` (FP8: ``model.context``)
for the contexts of one chunk's layers.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from speckv.digests import XXH3_128, digest
from speckv.errors import IntegrityError

from . import container as ct
from .model import BF16, Context, ContextTable, FloatFormat, context
from .residual import ResidualModel
from .tables import SHIFT_MAX


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
    # format 4: int8 sigma shifts per (layer, kv, head), already added into log2_sigma
    # (None: a version 2/3 stream, whose aux carries none)
    shifts: np.ndarray | None = None

    def chunk_slice(self, h: ct.StreamHeader, i: int) -> slice:
        """Chunk i's layers, relative to the plan's arrays."""
        start, count = h.chunk_layers(i)
        return slice(start - self.layer0, start - self.layer0 + count)

    def aux(self, sl: slice, blocks: bool = True) -> bytes:
        """A coded chunk's aux (FORMAT.md): FP8 scales, then (version 4, a chunk with rANS
        ``blocks``) its sigma shifts."""
        scales = b"" if self.scales is None else self.scales[sl].astype("<f4").tobytes()
        if self.shifts is None or not blocks or not self.shifts[sl].any():  # all 0: none written
            return scales
        return scales + self.shifts[sl].astype(np.int8).tobytes()

    def shifted(self, shifts: np.ndarray) -> "Plan":
        """This plan coding with ``log2_sigma + shifts`` (int8 ``(layers, 2, heads)``, one per
        group, recorded for ``aux``): shift 0 leaves a group's L as it is."""
        lg = self.log2_sigma + np.asarray(shifts, np.int64)[:, :, :, None]
        return dataclasses.replace(self, log2_sigma=lg, shifts=np.asarray(shifts, np.int8))

    def unshifted(self, sl: slice) -> bool:
        """Whether every group of ``sl`` codes with the checkpoint's own L (shift 0)."""
        return self.shifts is None or not self.shifts[sl].any()


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


def chunk_aux(h: ct.StreamHeader, c: ct.Chunk) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(FP8 scales ``(layer_count, 2)`` float32 or None for BF16, sigma shifts ``(layer_count,
    2, kv_heads)`` int8 or None) of chunk ``c``'s ``aux`` (FORMAT.md): the scales of an FP8
    stream, then in a version 4 stream's chunks with rANS blocks (``n_blocks > 0``: neither
    stored nor empty) either nothing (every shift 0) or one shift per (layer, kv, head).
    IntegrityError unless ``aux`` has exactly one of those lengths and every shift is within
    ``+-SHIFT_MAX``."""
    n = c.layer_count
    n_scales = 8 * n if h.dtype == ct.DTYPE_FP8 else 0
    n_shifts = n * 2 * h.shape[2] if h.version >= 4 and c.n_blocks > 0 else 0
    if len(c.aux) not in (n_scales, n_scales + n_shifts):
        what = f"{n_scales} bytes of FP8 scales" if n_scales else "no FP8 scales"
        extra = f", then nothing or {n_shifts} bytes of sigma shifts" if n_shifts else ""
        raise IntegrityError(f"chunk {c.index}: aux holds {what}{extra}, not {len(c.aux)} bytes")
    aux = bytes(c.aux)
    scales = np.frombuffer(aux, "<f4", count=2 * n).astype(np.float32).reshape(n, 2) if n_scales else None
    if not n_shifts:
        return scales, None
    if len(aux) == n_scales:  # every shift 0
        return scales, np.zeros((n, 2, h.shape[2]), np.int8)
    shifts = np.frombuffer(aux, np.int8, offset=n_scales).reshape(n, 2, h.shape[2])
    if (shifts < -SHIFT_MAX).any():
        raise IntegrityError(f"chunk {c.index}: a sigma shift outside +-{SHIFT_MAX}")
    return scales, shifts


def chunk_scales(h: ct.StreamHeader, chunks: Sequence[ct.Chunk]) -> np.ndarray:
    """The FP8 scales ``(layers, 2)`` the chunks carry in ``aux`` (checked by ``chunk_aux``)."""
    parts = [chunk_aux(h, c)[0] for c in chunks]
    return np.concatenate(parts) if parts else np.zeros((0, 2), np.float32)  # type: ignore[arg-type]


def chunk_shifts(h: ct.StreamHeader, chunks: Sequence[ct.Chunk]) -> np.ndarray | None:
    """The sigma shifts ``(layers, 2, kv_heads)`` of consecutive chunks' layers (zero for a
    stored chunk's), or None for a stream before version 4."""
    parts = [chunk_aux(h, c)[1] for c in chunks]  # NOTE: checks every version's aux (BF16: empty before 4)
    if h.version < 4:
        return None
    return np.concatenate([np.zeros((c.layer_count, 2, h.shape[2]), np.int8) if p is None else p
                           for c, p in zip(chunks, parts, strict=True)])


def runs(indices: Sequence[int]) -> list[slice]:
    """Positions of the maximal runs of consecutive chunk indices in ``indices`` (the
    backends code and decode consecutive chunks only)."""
    cuts = [p for p in range(1, len(indices)) if indices[p] != indices[p - 1] + 1]
    bounds = [0, *cuts, len(indices)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
