"""The end-to-end harness's cost model (``benchmarks/e2e.py``'s docstring states it): the
shared-core lower bound ``critical_path`` over per-chunk costs, the earlier even-chunk model
``even_path``, the paced model ``paced_path`` and ``break_even``."""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import numpy as np


def even_path(st: dict[str, float], goodput_Bps: float) -> float:
    """The earlier, even-chunk model of the module docstring (``even_path_s``)."""
    stages = (max(st["prefill_s"], st["mu_s"]), st["encode_s"], st["wire_bytes"] / goodput_Bps, st["decode_s"])
    return max(stages) + (sum(stages) - max(stages)) / max(st["chunks"], 1.0)


def critical_path(costs: dict[str, list[float]], goodput_Bps: float) -> float:
    """The cost model of the module docstring over per-chunk costs P, M, E, D (seconds) and B (bytes)."""
    core0 = core1 = w = d = 0.0
    for p, m, e, dd, b in zip(*(costs[k] for k in "PMEDB"), strict=True):
        core0 += p + m + e  # the prefill node's one core: the engine's layers, the encoder's mu and coding
        w = max(core0, w) + b / goodput_Bps  # the link, one chunk after the other
        core1 += m  # the decode node's one core: the decoder's mu of this chunk, then its decoding
        d = max(w, d, core1) + dd
        core1 += dd
    return d


def increments(times: list[float]) -> list[float]:
    """Per-chunk durations from cumulative times (seconds from the prefill's start)."""
    out, last = [], 0.0
    for t in times:
        out.append(max(t - last, 0.0))
        last = max(last, t)
    return out


def chunk_costs(t: dict[str, Any], speckv: bool, alone: dict[str, Any] | None = None) -> dict[str, list[float]]:
    """The cost model's per-chunk costs of one transfer. ``alone``: ``P``, the engine's per-chunk
    layer times of the stored row (default: this row's own); ``encode_s`` and ``decode_s`` of a
    loopback transfer whose mu both sides had cached (the coder alone on its core; the smaller of
    those and this row's counts)."""
    p, f = t["p"], t["f"]
    tl, alone = p.get("timeline", []), alone or {}
    n = len(tl)
    P = list(alone.get("P") or increments([r[0] for r in tl]))
    M = [0.0] * n
    if speckv:  # the decoder's mu of each chunk, its own core: the predictor's cost alone
        M = increments([r[6] for r in tl])
        busy = f.get("decoder_predictor_s", 0.0)
        M = [m * min(1.0, busy / sum(M)) if sum(M) > 0 else 0.0 for m in M]
    E = min(p["encode_s"], alone.get("encode_s", float("inf")))
    D = min(f.get("decoder_decode_s", 0.0), alone.get("decode_s", float("inf")))
    return {"P": P, "M": M, "E": [E / max(n, 1)] * n, "D": [D / max(n, 1)] * n, "B": [float(r[4]) for r in tl]}


def paced_path(timeline: list[list[float]], st: dict[str, float], goodput_Bps: float) -> float | None:
    """The paced model of the module docstring over one row's chunk timings (rows of [layers_in,
    ready, coded, written, bytes, mu, peer_mu], seconds from the prefill's start; ChunkTiming's
    fields): a chunk's inputs exist at max(layers_in, mu, peer_mu). None without timings."""
    if not timeline:
        return None
    n = len(timeline)
    e = w = d = 0.0
    for layers_in, _, _, _, size, mu, peer in timeline:
        e = max(layers_in, mu, peer, e) + st["encode_s"] / n
        w = max(e, w) + size / goodput_Bps
        d = max(w, d) + st["decode_s"] / n
    return d


def break_even(rows: list[dict[str, Any]], cal: dict[str, dict[str, float]]) -> float | None:
    """Nominal Mbit/s where the fitted speckv and stored models cross (module docstring)."""
    eff = statistics.median(c["ratio"] for c in cal.values())
    fits: dict[str, tuple[dict[str, list[float]], float]] = {}
    for enc in ("stored", "speckv"):
        rs = [r for r in rows if r["encoding"] == enc]
        costs = {k: [statistics.median(c) for c in zip(*(r["costs"][k] for r in rs), strict=True)] for k in "PMEDB"}
        off = statistics.median(r["total_s"] - r["critical_path_s"] for r in rs)
        fits[enc] = (costs, off)

    def gap(mbit: float) -> float:
        g = eff * mbit * 1e6 / 8
        return sum(s * (critical_path(fits[e][0], g) + fits[e][1]) for e, s in (("speckv", 1), ("stored", -1)))

    grid = np.logspace(0, 6, 241)
    for lo, hi in itertools.pairwise(grid):
        if gap(lo) < 0 <= gap(hi):
            for _ in range(60):
                mid = (lo * hi) ** 0.5
                lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
            return float(round(hi, 2))
    return None
