"""The codec's numpy reference path: a plan's chunks to rANS blocks and back, in one
vectorised pass (the native and CUDA backends write the same bytes; ``backends``).

Encoding: ``chunk_ops`` turns one chunk's symbols into rANS ops (the Gaussian table's
start and frequency per element, no-op ops on the padding lanes) and ``encode_chunks``
codes the ops of every chunk at once. Decoding: ``run_decoder`` runs the rANS loop over
the blocks of every live chunk at once and ``decode_chunks`` maps the symbols back to
bit patterns. Blocks never span chunks. The work is split over ``threads`` with
``thread_map`` (numpy releases the GIL inside each step's array operations).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence, TypeVar

import numpy as np

from . import container as ct
from .model import Context, desymbolize, symbolize
from .plan import Plan
from .rans import LANES, RansBlocks, concat_blocks, rans_encode, split_blocks
from .tables import NOOP_TABLE, CodingTables, decode_symbols

T = TypeVar("T")
R = TypeVar("R")
ContextOf = Callable[[Plan, slice], Context]  # the contexts of a plan's layers (``Codec._context``)


def thread_map(threads: int, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(i) for i in items]``, on ``threads`` threads when there is more than one item."""
    items = list(items)
    if threads == 1 or len(items) < 2:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


def chunk_ops(plan: Plan, h: ct.StreamHeader, i: int, context: ContextOf) -> tuple[np.ndarray, np.ndarray, bytes]:
    """(blocks, steps, LANES) start/freq of chunk i (padding lanes: no-op), raw bits."""
    sl = plan.chunk_slice(h, i)
    assert plan.x is not None  # an encoding plan
    ctx, n = context(plan, sl), h.chunk_elements(i)
    sym = symbolize(plan.fmt, plan.model.tables, ctx, plan.x[sl].ravel())
    g = plan.model.tables.gauss
    size = h.chunk_blocks(i) * h.elems_per_lane * LANES
    idx = np.full(size, g.offset[NOOP_TABLE], np.int64)
    idx[:n] = g.offset[ctx.t] + sym.j
    grid = (h.chunk_blocks(i), h.elems_per_lane, LANES)  # element = block, step, lane
    return g.cum[idx].reshape(grid), g.freq[idx].reshape(grid), sym.bits


def encode_chunks(plan: Plan, h: ct.StreamHeader, idx: Sequence[int], context: ContextOf,
                  threads: int) -> list[tuple[RansBlocks, bytes]]:
    """Each chunk of ``idx``: its rANS blocks and raw bits, all coded in one pass."""
    parts = thread_map(threads, lambda i: chunk_ops(plan, h, i, context), idx)
    start = np.concatenate([p[0] for p in parts])
    freq = np.concatenate([p[1] for p in parts])
    groups = np.array_split(np.arange(len(start)), threads)
    coded = thread_map(threads, lambda g: rans_encode(start[g], freq[g], validate=False), groups)
    blocks = concat_blocks(coded)  # ops come from verified tables: no range checks
    spans = [len(p[0]) for p in parts]
    return [(rb, p[2]) for rb, p in zip(split_blocks(blocks, spans), parts, strict=True)]


def run_decoder(live: Sequence[ct.Chunk], ctxs: Sequence[Context], el: int, coding: CodingTables,
                threads: int) -> list[np.ndarray]:
    """The rANS loop: one Gaussian-table op per element; blocks split across threads."""
    blocks = concat_blocks([RansBlocks(c.states, c.word_counts, c.words) for c in live])
    nb = len(blocks.word_counts)
    tables: np.ndarray = np.full(nb * el * LANES, NOOP_TABLE, np.int32)
    pos = 0
    for c, ctx in zip(live, ctxs, strict=True):
        tables[pos:pos + len(ctx.t)] = ctx.t
        pos += c.n_blocks * el * LANES
    tables = tables.reshape(nb, el, LANES)  # element = block, step, lane
    groups = [g for g in np.array_split(np.arange(nb), threads) if len(g)]
    parts = thread_map(threads, lambda a: decode_symbols(coding, a[0], tables[a[1][0]:a[1][-1] + 1], el),
                       list(zip(split_blocks(blocks, [len(g) for g in groups]), groups, strict=True)))
    js = np.concatenate(parts)
    return [p.ravel() for p in np.split(js, np.cumsum([c.n_blocks for c in live])[:-1])]


def decode_chunks(plan: Plan, h: ct.StreamHeader, live: Sequence[ct.Chunk], context: ContextOf,
                  threads: int) -> list[np.ndarray]:
    """Bit patterns of each chunk of ``live`` (all with rANS blocks), decoded in one pass."""
    ctxs = thread_map(threads, lambda c: context(plan, plan.chunk_slice(h, c.index)), live)
    js = run_decoder(live, ctxs, h.elems_per_lane, plan.model.tables, threads) if live else []
    tables = plan.model.tables
    return thread_map(threads, lambda a: desymbolize(plan.fmt, tables, a[1], a[2][:len(a[1].t)], a[0].bits),
                      list(zip(live, ctxs, js, strict=True)))
