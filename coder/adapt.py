"""Forward-adaptive sigma (format version 4): the encoder's choice of each chunk's
sigma shifts, computed here only, in numpy, whatever backend codes the chunk; and
(format version 5, FP8) of each chunk's rounding, to nearest or toward zero
(``choose_rounding``).

A coded chunk of a version 4 stream carries one signed shift per (layer, kv, head)
in its ``aux`` (FORMAT.md); both sides code the group's scalars with the fixed-point
``L + shift`` (1/8 octaves) in place of the checkpoint's ``L``. Shift 0 codes exactly
as version 3 does. Why: when the engine's KV is not bit-equal to the sidecar's own
recomputation (other kernels: eager attention, vLLM), layers the predictor computes
exactly (``hybrid:K``, sigma calibrated to a residual of ~0) see rounding-level
residuals that escape at ~15 bits a scalar; a shift of ~+12 octaves codes them in ~3.

The choice (deterministic: the same shifts, so the same bytes, on every backend):

1. every group's exact coded cost at shift 0 (integer 1/256 bits: the rANS symbol's
   ``15 - log2 freq`` plus its raw bits) on a sample of its tokens, and its *surprises*:
   escapes, and symbols of probability below 2^-SURPRISE_BITS (under a calibrated sigma
   they are the Gaussian's tail beyond ~3 sigma, ~0.3% of the scalars);
2. groups whose sample has more than 1 surprise in ``SEARCH_SURPRISES`` (the model's
   sigma is far too small for this KV) are searched: the costs at every ``SEARCH_SHIFTS`` value,
   then at the best one ``+- REFINE``; the cheapest wins (ties: the earlier candidate,
   0 first);
3. then every group tries its shift ``+- FINE_STEP`` (a quarter octave), and a group where one
   step paid tries ``FINE_FURTHER`` steps the same way; each step is taken only where it saves
   more than ``FINE_MARGIN`` of the group's sampled cost. A KV whose residual is a little wider
   or narrower than calibrated (another engine's rounding in every layer, an FP8 cache its
   attention reads) gets its sigma nudged. Measured (2048 tokens of tinyshakespeare, FP8 codes
   of the fp8cache engine stand-in): w8a8 3.011 -> 2.848 bits an element, the fp8 rung 2.955 ->
   2.897, the shipped w8a8x:4 2.788 -> 2.602; on the sidecars' own KV 0.000-0.012 bits less
   (RESULTS.md, "Quarter-octave sigma steps"). The margin keeps a 32-token sample's noise from
   moving a group that the calibration fits.

The search set is the encoder's policy, not the format: a decoder accepts any shift
with ``|shift| <= SHIFT_MAX``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Protocol

import numpy as np

from .model import Context, FloatFormat, classify, context, low_bits
from .rans import PROB_BITS, PROB_SCALE
from .tables import SHIFT_MAX, CodingTables

SAMPLE_TOKENS = 32  # tokens per group the cost sample takes (every stride-th token)
SURPRISE_BITS = 12  # a symbol costing this many bits or more (or escaped) is a surprise
SEARCH_SURPRISES = 64  # a group whose sample has more than 1 surprise in this many is searched
SEARCH_SHIFTS = tuple(range(8, 121, 8))  # coarse candidates (1/8 octaves) of a searched group
REFINE = 4  # then the best coarse candidate +- this
FINE_STEP = 2  # then every group's shift +- this (1/8 octaves: a quarter octave)
FINE_FURTHER = (2, 3, 4)  # and where one step paid, these many steps the same way
FINE_MARGIN = (3, 1000)  # a fine step is taken where cost * (1000 + 3) < the cost it replaces * 1000
COST_FRAC_BITS = 8  # costs in 1/256 bits
assert max(SEARCH_SHIFTS) + REFINE <= SHIFT_MAX  # the fine steps are clipped to +-SHIFT_MAX


@cache
def symbol_cost() -> np.ndarray:
    """Integer cost of a symbol of frequency f: ``PROB_BITS - log2 f`` in 1/256 bits, exactly
    rounded down from integers alone (``floor(256 log2 f)`` is the bit length of f^256, less 1),
    so every machine computes the same table."""
    one = 1 << COST_FRAC_BITS
    out = np.zeros(PROB_SCALE + 1, np.int64)
    out[1:] = [PROB_BITS * one - ((f ** one).bit_length() - 1) for f in range(1, PROB_SCALE + 1)]
    return out


def element_costs(fx: FloatFormat, tab: CodingTables, ctx: Context, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cost in 1/256 bits, surprise) of coding each element ``x`` in context ``ctx``: what
    ``model.symbolize`` would emit, priced (rANS symbol plus raw LOW / ZMAN + UNARY / ESC bits);
    a surprise is an escape or a symbol costing SURPRISE_BITS or more."""
    _, d, radius, mag, esc, zero = classify(fx, tab, ctx, x)
    j = np.where(esc, 2 * radius + 1, d + radius)
    freq = tab.gauss.freq[tab.gauss.offset[ctx.t] + j]
    e_x = (x.astype(np.int32) >> fx.mant) & fx.exp_mask
    raw = np.where(esc, fx.bits, np.where(zero, fx.mant + ctx.k + fx.bias - e_x,  # mant + delta + 1
                                          np.maximum(low_bits(fx, np.maximum(mag, 1)), 0)))
    sym = symbol_cost()[freq]
    return sym + (raw.astype(np.int64) << COST_FRAC_BITS), esc | (sym >= SURPRISE_BITS << COST_FRAC_BITS)


def sample_tokens(tokens: int) -> slice:
    """The tokens the chooser prices: every stride-th, about SAMPLE_TOKENS of them."""
    return slice(0, tokens, max(1, tokens // SAMPLE_TOKENS))


class GroupCoster(Protocol):
    """A backend's ``group_costs``: the numbers ``_group_costs`` computes, natively."""

    def group_costs(self, x: np.ndarray, mu: np.ndarray, levels: np.ndarray,
                    tables: CodingTables) -> tuple[np.ndarray, np.ndarray]: ...


def _group_costs(fx: FloatFormat, fm: FloatFormat, tab: CodingTables, x: np.ndarray, mu: np.ndarray,
                 log2_sigma: np.ndarray, shifts: np.ndarray,
                 backend: GroupCoster | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per group (rows of ``x``: ``(groups, tokens, dim)``), the summed cost and surprises under
    ``log2_sigma + shifts`` (``log2_sigma``: ``(groups, dim)``, ``shifts``: ``(groups,)``), in numpy
    or by ``backend`` (the same integers)."""
    L = np.broadcast_to((log2_sigma + shifts[:, None])[:, None, :], x.shape)
    if backend is not None:
        return backend.group_costs(x, mu, L, tab)
    ctx = context(fx, fm, mu.ravel(), L.ravel())
    cost, surprise = element_costs(fx, tab, ctx, x.ravel())
    return cost.reshape(len(x), -1).sum(axis=1), surprise.reshape(len(x), -1).sum(axis=1)


def choose_shifts(fx: FloatFormat, fm: FloatFormat, tab: CodingTables, x: np.ndarray, mu: np.ndarray,
                  log2_sigma: np.ndarray, backend: GroupCoster | None = None,
                  base: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """The shift of each (layer, kv, head) group: int8 ``(layers, 2, heads)`` for KV bit
    patterns ``x`` ``(layers, 2, heads, tokens, dim)``, mu as coded (``fm``) and the model's
    ``log2_sigma`` ``(layers, 2, heads, dim)`` (in x's units); costs priced in numpy, or by a
    native ``backend`` (the same integers, so the same shifts). ``base``: each group's sampled
    (cost, surprises) at shift 0 under this mu, when already priced (``choose_rounding``)."""
    out = np.zeros(x.shape[:3], np.int8)
    if x.size == 0:
        return out
    tok = sample_tokens(x.shape[3])
    xs = x[:, :, :, tok].reshape(-1, len(range(*tok.indices(x.shape[3]))), x.shape[4])
    ms = mu[:, :, :, tok].reshape(xs.shape)
    lg = np.asarray(log2_sigma, np.int64).reshape(-1, x.shape[4])
    cost0, surprises = _group_costs(fx, fm, tab, xs, ms, lg, np.zeros(len(xs), np.int64), backend) \
        if base is None else base
    best, best_cost = np.zeros(len(xs), np.int64), np.asarray(cost0, np.int64).copy()
    hot = np.flatnonzero(surprises * SEARCH_SURPRISES > xs.shape[1] * xs.shape[2])
    if len(hot):
        s = Sample(fx, fm, tab, xs[hot], ms[hot], lg[hot], backend)
        b, c = s.consider(best[hot], best_cost[hot], [np.full(len(hot), v, np.int64) for v in SEARCH_SHIFTS])
        b, c = s.consider(b, c, [np.where(b != 0, b + r, 0) for r in (-REFINE, REFINE)])
        best[hot], best_cost[hot] = b, c
    start = best.copy()
    s = Sample(fx, fm, tab, xs, ms, lg, backend)
    best, best_cost = s.consider(best, best_cost, [_step(start, -FINE_STEP), _step(start, FINE_STEP)], FINE_MARGIN)
    moved = np.flatnonzero(best != start)  # on: the same direction, further (few groups, usually)
    if len(moved):
        way = np.sign(best[moved] - start[moved])
        s = Sample(fx, fm, tab, xs[moved], ms[moved], lg[moved], backend)
        best[moved], _ = s.consider(best[moved], best_cost[moved],
                                    [_step(start[moved], way * k * FINE_STEP) for k in FINE_FURTHER], FINE_MARGIN)
    out.reshape(-1)[:] = best
    return out


def _step(shifts: np.ndarray, by: "np.ndarray | int") -> np.ndarray:
    return np.clip(shifts + by, -SHIFT_MAX, SHIFT_MAX)


class Sample:
    """The groups' sampled elements, priced under candidate shifts."""

    def __init__(self, fx: FloatFormat, fm: FloatFormat, tab: CodingTables, xs: np.ndarray, ms: np.ndarray,
                 lg: np.ndarray, backend: GroupCoster | None) -> None:
        self.fx, self.fm, self.tab, self.xs, self.ms, self.lg, self.backend = fx, fm, tab, xs, ms, lg, backend

    def consider(self, best: np.ndarray, best_cost: np.ndarray, cands: list[np.ndarray],
                 margin: tuple[int, int] = (0, 1)) -> tuple[np.ndarray, np.ndarray]:
        """The candidates in order, priced in one call (each a copy of the sample: one call wakes
        the threads once, not once per candidate); a candidate replaces the best so far where
        cost * (den + num) < best cost * den (``margin`` num / den; NOTE: strict: ties keep the
        earlier candidate). Integers only: every backend makes the same choice."""
        k, (num, den) = len(cands), margin
        if not k:
            return best, best_cost
        costs, _ = _group_costs(self.fx, self.fm, self.tab, np.concatenate([self.xs] * k),
                                np.concatenate([self.ms] * k), np.concatenate([self.lg] * k),
                                np.concatenate(cands), self.backend)
        for cand, cost in zip(cands, costs.reshape(k, -1), strict=True):
            better = cost * (den + num) < best_cost * den
            best, best_cost = np.where(better, cand, best), np.where(better, cost, best_cost)
        return best, best_cost


def choose_rounding(fx: FloatFormat, fm: FloatFormat, tab: CodingTables, x: np.ndarray, mu: np.ndarray,
                    move: Callable[[np.ndarray], np.ndarray], log2_sigma: np.ndarray, chunk_layers: list[int],
                    backend: GroupCoster | None = None,
                    base_out: list[tuple[np.ndarray, np.ndarray]] | None = None) -> np.ndarray:
    """Format 5, FP8: per layer (bool ``(layers,)``, the same for a chunk's layers), whether its
    chunk codes cheaper with ``move(mu)`` (mu moved toward zero: the engine rounded its codes
    toward zero, as vLLM's CPU cache writer does) than with ``mu`` (rounded to nearest). Each
    chunk's sampled cost at shift 0 under both (ties: to nearest), priced as ``choose_shifts``
    prices (numpy, or the same integers natively).

    NOTE: ``move`` runs on the sampled tokens only: moving the whole mu cost 6x the native
    encode itself (1.4 s of a 2048-token FP8 encode), for a choice that reads SAMPLE_TOKENS of each group's tokens.
    ``base_out``: receives each group's sampled (cost, surprises) at shift 0 under the chosen
    rounding, ``choose_shifts``'s ``base`` (the same sample: one pricing fewer)."""
    out = np.zeros(x.shape[0], bool)
    if x.size == 0:
        return out
    tok = sample_tokens(x.shape[3])
    xs = x[:, :, :, tok].reshape(-1, len(range(*tok.indices(x.shape[3]))), x.shape[4])
    lg = np.asarray(log2_sigma, np.int64).reshape(-1, x.shape[4])
    zero = np.zeros(len(xs), np.int64)
    ms = np.ascontiguousarray(mu[:, :, :, tok]).reshape(xs.shape)
    priced = [_group_costs(fx, fm, tab, xs, m, lg, zero, backend) for m in (ms, move(ms))]
    per_layer = [cost.reshape(x.shape[0], -1).sum(axis=1) for cost, _ in priced]
    start = 0
    for n in chunk_layers:
        sl = slice(start, start + n)
        out[sl] = per_layer[1][sl].sum() < per_layer[0][sl].sum()  # NOTE: strict: ties stay nearest
        start += n
    if base_out is not None:
        moved = np.repeat(out, len(xs) // x.shape[0])  # groups are layer-major
        (c0, s0), (c1, s1) = priced
        base_out.append((np.where(moved, c1, c0), np.where(moved, s1, s0)))
    return out
