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
from typing import Any, Collection, Sequence

import numpy as np

from speckv.digests import XXH3_128, digest
from speckv.errors import IntegrityError

from . import container as ct
from .adapt import choose_rounding, choose_shifts
from .model import BF16, E4M3, FP32, Context, ContextTable, FloatFormat, context, fp8_log2_sigma
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
    # format 5, FP8: per layer, whether its chunk codes the engine's codes as rounded toward
    # zero (``mu`` then holds ``toward_zero_mu`` of those layers; None: every layer nearest)
    toward_zero: np.ndarray | None = None
    predicted_mu: np.ndarray | None = None  # mu before ``rounded`` moved it (the fingerprints' mu)

    @property
    def mu_predicted(self) -> np.ndarray:
        """mu as the predictor (and residual model) gave it: what ``mu_fingerprint`` digests."""
        return self.mu if self.predicted_mu is None else self.predicted_mu

    def chunk_counts(self, h: ct.StreamHeader) -> list[int]:
        """Layers of each chunk the plan's arrays hold (they start at a chunk's first layer)."""
        first, n = self.layer0 // h.layers_per_chunk, self.mu.shape[0]
        counts: list[int] = []
        while sum(counts) < n:
            counts.append(h.chunk_layers(first + len(counts))[1])
        return counts

    def chunk_slice(self, h: ct.StreamHeader, i: int) -> slice:
        """Chunk i's layers, relative to the plan's arrays."""
        start, count = h.chunk_layers(i)
        return slice(start - self.layer0, start - self.layer0 + count)

    def aux(self, sl: slice, blocks: bool = True) -> bytes:
        """A coded chunk's aux (FORMAT.md): FP8 scales, then (version 5, a chunk with rANS
        ``blocks`` rounded toward zero) its rounding byte, then (version 4, ``blocks``) its
        sigma shifts."""
        aux = b"" if self.scales is None else self.scales[sl].astype("<f4").tobytes()
        if blocks and self.toward_zero is not None and self.toward_zero[sl].any():
            aux += bytes([ROUND_TOWARD_ZERO])
        if self.shifts is None or not blocks or not self.shifts[sl].any():  # all 0: none written
            return aux
        return aux + self.shifts[sl].astype(np.int8).tobytes()

    def rounded(self, toward_zero: np.ndarray) -> "Plan":
        """This FP8 plan coding the layers flagged in ``toward_zero`` (bool ``(layers,)``) as an
        engine's codes rounded toward zero: their mu moves half an e4m3 step toward zero
        (``toward_zero_mu``), so the nearest-rounding model predicts the truncated code."""
        tz = np.asarray(toward_zero, bool)
        if not tz.any():
            return dataclasses.replace(self, toward_zero=None)
        if tz.all():  # a toward-zero engine's every layer: no masked copy
            mu = toward_zero_mu(self.mu_predicted)
        else:
            mu = self.mu_predicted.copy()
            mu[tz] = toward_zero_mu(mu[tz])
        return dataclasses.replace(self, mu=mu, predicted_mu=self.mu_predicted, toward_zero=tz)

    def shifted(self, shifts: np.ndarray) -> "Plan":
        """This plan coding with ``log2_sigma + shifts`` (int8 ``(layers, 2, heads)``, one per
        group, recorded for ``aux``): shift 0 leaves a group's L as it is."""
        lg = self.log2_sigma + np.asarray(shifts, np.int64)[:, :, :, None]
        return dataclasses.replace(self, log2_sigma=lg, shifts=np.asarray(shifts, np.int8))

    def unshifted(self, sl: slice) -> bool:
        """Whether every group of ``sl`` codes with the checkpoint's own L (shift 0)."""
        return self.shifts is None or not self.shifts[sl].any()


ROUND_TOWARD_ZERO = 1  # the rounding byte of a version 5 FP8 chunk (FORMAT.md); absent = to nearest
E4M3_MIN_EXP, E4M3_MANT = -6, 3  # e4m3: smallest normal binade 2^-6, 3 mantissa bits


@dataclass
class Prepared:
    """Chunks of ``Codec.encode_chunks`` before their rANS pass: the stored ones already written
    (by index), the coded ones' indices and their adapted plan (None when none is coded)."""

    out: dict[int, ct.Chunk]
    coded: list[int]
    plan: Plan | None
    sums: list[tuple[bytes, bytes]] | None = None  # the coded chunks' digests (integrity.Sums), if computed ahead


@dataclass
class Unpacked:
    """A group of chunks of ``Codec.decode`` before its rANS pass: the stored ones' layers (by
    index), the coded chunks and their plan, checked against their mu (None when none is coded)."""

    out: dict[int, np.ndarray]
    coded: list[ct.Chunk]
    plan: Plan | None


def toward_zero_mu(mu: np.ndarray) -> np.ndarray:
    """FP32 mu bit patterns (uint32, in e4m3 units: mu / scale) moved half an e4m3 step toward
    zero: ``sign(mu) max(|mu| - 2^(E - 4), 0)``, E = max(exponent of |mu|, -6) (the e4m3 step in
    mu's binade is ``2^(E - 3)``, subnormals ``2^-9``); non-finite mu as it is.

    NOTE: exact in IEEE fp32 (no rounding): 2^(E - 4) is a multiple of |mu|'s ULP and the
    difference keeps at least |mu| / 2 or cancels below 2^(E - 3) (Sterbenz), or goes under 0
    and is clamped; so every backend and machine moves mu to the same bits."""
    bits = np.asarray(mu, np.uint32)
    # 2^(E - 4) as fp32 bits: the exponent field clamped at the smallest normal binade, minus 4
    half = (bits >> 23) & np.uint32(0xFF)
    np.maximum(half, np.uint32(E4M3_MIN_EXP + 127), out=half)
    half -= np.uint32(E4M3_MANT + 1)
    half <<= 23
    mag = bits & np.uint32(0x7FFFFFFF)  # |mu|
    finite = mag < np.uint32(0x7F800000)
    with np.errstate(invalid="ignore"):
        np.subtract(mag.view(np.float32), half.view(np.float32), out=mag.view(np.float32))
    np.maximum(mag.view(np.float32), np.float32(0), out=mag.view(np.float32))
    mag |= bits & np.uint32(0x80000000)
    return np.where(finite, mag, bits)


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


def chunk_aux(h: ct.StreamHeader, c: ct.Chunk) -> tuple[np.ndarray | None, np.ndarray | None, bool]:
    """(FP8 scales ``(layer_count, 2)`` float32 or None for BF16, sigma shifts ``(layer_count,
    2, kv_heads)`` int8 or None, rounded toward zero) of chunk ``c``'s ``aux`` (FORMAT.md): the
    scales of an FP8 stream; then in a version 5 FP8 stream's chunks with rANS blocks
    (``n_blocks > 0``: neither stored nor empty) nothing (to nearest) or the rounding byte
    ``ROUND_TOWARD_ZERO``; then in a version 4+ stream's such chunks either nothing (every
    shift 0) or one shift per (layer, kv, head). IntegrityError unless ``aux`` has exactly one
    of those lengths, the rounding byte is ``ROUND_TOWARD_ZERO`` and every shift is within
    ``+-SHIFT_MAX``."""
    n = c.layer_count
    n_scales = 8 * n if h.dtype == ct.DTYPE_FP8 else 0
    n_round = 1 if h.version >= 5 and n_scales and c.n_blocks > 0 else 0
    n_shifts = n * 2 * h.shape[2] if h.version >= 4 and c.n_blocks > 0 else 0
    lengths = {n_scales + r + s for r in {0, n_round} for s in {0, n_shifts}}
    if len(c.aux) not in lengths:
        what = f"{n_scales} bytes of FP8 scales" if n_scales else "no FP8 scales"
        extra = (", then nothing or a rounding byte" if n_round else "") + (
            f", then nothing or {n_shifts} bytes of sigma shifts" if n_shifts else "")
        raise IntegrityError(f"chunk {c.index}: aux holds {what}{extra}, not {len(c.aux)} bytes")
    aux = bytes(c.aux)
    scales = np.frombuffer(aux, "<f4", count=2 * n).astype(np.float32).reshape(n, 2) if n_scales else None
    toward_zero = bool(n_round) and len(aux) - n_scales in (1, 1 + n_shifts)
    if toward_zero and aux[n_scales] != ROUND_TOWARD_ZERO:
        raise IntegrityError(f"chunk {c.index}: aux rounding byte {aux[n_scales]}, not {ROUND_TOWARD_ZERO}")
    at = n_scales + int(toward_zero)
    if not n_shifts:
        return scales, None, toward_zero
    if len(aux) == at:  # every shift 0
        return scales, np.zeros((n, 2, h.shape[2]), np.int8), toward_zero
    shifts = np.frombuffer(aux, np.int8, offset=at).reshape(n, 2, h.shape[2])
    if (shifts < -SHIFT_MAX).any():
        raise IntegrityError(f"chunk {c.index}: a sigma shift outside +-{SHIFT_MAX}")
    return scales, shifts, toward_zero


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


def chunk_rounding(h: ct.StreamHeader, chunks: Sequence[ct.Chunk]) -> np.ndarray:
    """Per layer of consecutive chunks, whether its chunk's codes are rounded toward zero."""
    return np.concatenate([np.full(c.layer_count, chunk_aux(h, c)[2]) for c in chunks]) if chunks \
        else np.zeros(0, bool)


def runs(indices: Sequence[int]) -> list[slice]:
    """Positions of the maximal runs of consecutive chunk indices in ``indices`` (the
    backends code and decode consecutive chunks only)."""
    cuts = [p for p in range(1, len(indices)) if indices[p] != indices[p - 1] + 1]
    bounds = [0, *cuts, len(indices)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]



def element_groups(h: ct.StreamHeader, indices: Sequence[int], limit: int) -> list[slice]:
    """Positions of consecutive chunk ``indices`` in groups of at most ``limit`` elements each (a
    larger chunk alone): what a codec prepares and codes at once, so coding a whole stream needs
    neither its whole mu prepared nor the native coder's per-element scratch for all of it."""
    per_layer = int(np.prod(h.shape[1:]))
    bounds, size = [0], 0
    for p, i in enumerate(indices):
        n = h.chunk_layers(i)[1] * per_layer
        if p > bounds[-1] and size + n > limit:
            bounds.append(p)
            size = 0
        size += n
    bounds.append(len(indices))
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def stored_of(h: ct.StreamHeader, idx: range, x: np.ndarray, scales: np.ndarray | None,
              stored: Collection[int]) -> set[int]:
    """Which of consecutive chunks ``idx`` a ``Codec.encode_chunks`` call writes stored (all of a
    stored stream's, else those in ``stored``), once its inputs are checked: ``x`` holds exactly
    their layers, FP8 KV has a ``(layers, 2)`` scale each, a coded stream stores chunks only from
    format version 3 (ValueError otherwise)."""
    start, stop = h.chunk_layers(idx[0])[0], sum(h.chunk_layers(idx[-1]))
    want = (stop - start,) + h.shape[1:]
    if tuple(x.shape) != want:
        raise ValueError(f"chunks {idx.start}..{idx.stop - 1} need KV of shape {want}, not {tuple(x.shape)}")
    if h.dtype == ct.DTYPE_FP8 and (scales is None or np.shape(scales) != (stop - start, 2)):
        raise ValueError(f"chunks {idx.start}..{idx.stop - 1} need FP8 scales of shape ({stop - start}, 2)")
    keep = set(idx) if h.model == ct.MODEL_STORED else set(idx).intersection(stored)
    if keep and h.model != ct.MODEL_STORED and h.version < 3:
        raise ValueError(f"stored chunks in a coded stream need format version 3, not {h.version}")
    return keep


def adapted_plan(plan: Plan, h: ct.StreamHeader, backend: Any) -> Plan:
    """An encoding plan with a version 5 FP8 stream's rounding per chunk
    (``adapt.choose_rounding``) and a version 4+ stream's sigma shifts
    (``adapt.choose_shifts``, on the rounded mu), their costs priced by the native backend
    where it runs (the same integers as numpy's, so the same choices and bytes on every
    backend)."""
    if h.version < 4:
        return plan
    x = plan.x
    assert x is not None  # an encoding plan
    coster = backend if hasattr(backend, "group_costs") else None
    base: list[tuple[np.ndarray, np.ndarray]] = []  # the rounding's costs at shift 0: choose_shifts's first
    if h.version >= 5 and plan.fmt is E4M3:
        plan = plan.rounded(choose_rounding(plan.fmt, plan.fmt_mu, plan.model.tables, x, plan.mu,
                                            toward_zero_mu, plan.log2_sigma, plan.chunk_counts(h),
                                            coster, base_out=base))
    return plan.shifted(choose_shifts(plan.fmt, plan.fmt_mu, plan.model.tables, x, plan.mu,
                                      plan.log2_sigma, coster, base=base[0] if base else None))


def build_plan(model: ResidualModel, backend: Any, kv: Any, mu: np.ndarray, fmt: FloatFormat | None = None,
               scales: Any = None, layers: slice | None = None) -> Plan:
    """Symbols of ``layers`` (default all) under ``model``: ``kv`` (BF16 tensor or bits, ``Fp8KV``,
    or None to decode) and ``scales`` hold only those layers, ``mu`` (BF16 bits) the whole
    stream's; its correction and the FP8 division natively where ``backend`` runs."""
    from speckv.kv import Fp8KV, bf16_bits

    layers = layers or slice(0, mu.shape[0])
    lg, layer0 = model.log2_sigma[layers], layers.start
    fp8 = isinstance(kv, Fp8KV) or fmt is E4M3
    if fp8:
        scales = np.ascontiguousarray(kv.scales if isinstance(kv, Fp8KV) else scales, np.float32)
    if backend is not None:  # mu correction and the FP8 division, natively
        a = None if model.mu_scale is None else model.mu_scale[layers]
        b = None if model.mu_shift is None else model.mu_shift[layers]
        mu = backend.prepare_mu(mu[layers], a, b, scales if fp8 else None)
    else:
        mu = model.correct(mu[layers], layers)
        if fp8:
            # NOTE: one IEEE fp32 division per scalar (correctly rounded on every backend);
            # scales come from the stream: 0, inf or NaN give inf/NaN mu, which escape
            with np.errstate(all="ignore"):
                mu = (mu_float32(mu) / scales[:, :, None, None, None]).view(np.uint32)
    if fp8:
        log2_sigma = fp8_log2_sigma(lg, scales.view(np.uint32)[:, :, None, None])
        x = fp8_codes(kv.codes) if isinstance(kv, Fp8KV) else None
        return Plan(E4M3, FP32, x, mu, log2_sigma, scales, model, layer0)
    x = bf16_bits(kv) if kv is not None else None
    return Plan(BF16, BF16, x, mu, lg, None, model, layer0)
