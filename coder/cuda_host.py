"""The host side of the fused CUDA coder (``coder/cuda.py``), in numpy only: block
geometry, the decoder's lookup tables, the encoder's section offsets, the streams laid
out for the device, and the order of the decoder's checks (``chunk_status`` of
``coder/kernels/spk_decode.h``, same statuses, same precedence) over the figures the
device's section pass records (``coder/kernels/spk_sections.cuh``).
Nothing here imports CuPy; everything is testable on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from speckv.errors import RansDecodeError

from .native import EncodedChunk, FlatTables, _error
from .rans import LANES, PROB_SCALE, RansBlocks, _check_blocks

BUCKET_SHIFT = 7  # spk_consts.h SPK_BUCKET_SHIFT
BUCKETS = PROB_SCALE >> BUCKET_SHIFT
OK, SHORT, UNARY_LONG, PADDING, NO_FINITE, UNARY_COUNT, UNARY_TAIL, ZERO_EXP, NOT_ESCAPED = 0, 4, 5, 6, 7, 8, 9, 10, 11
_U64 = np.uint64
FORMATS = {False: (7, 16), True: (3, 8)}  # fp8 -> (mantissa bits, pattern bits) of x


@dataclass(frozen=True)
class Geometry:
    """Blocks of a batch of requests, each request's chunks consecutive and each request
    (layers, 2, heads, tokens, dim) in C order, one request after another: their tokens differ,
    their heads and dim do not (one model)."""

    heads: int
    dim: int
    epl: int
    req_tokens: np.ndarray  # (requests,) i64
    req_e0: np.ndarray  # (requests,) i64 first element (global)
    req_chunks: np.ndarray  # (requests,) chunks of each request
    chunk_n: np.ndarray  # (chunks,) elements
    chunk_b0: np.ndarray  # (chunks,) first block
    chunk_blocks: np.ndarray  # (chunks,)
    block_e0: np.ndarray  # (blocks,) i64 first element (global)
    block_n: np.ndarray  # (blocks,) i32 elements
    block_chunk: np.ndarray  # (blocks,) i64
    block_req: np.ndarray  # (blocks,) i32
    chunk_req: np.ndarray  # (chunks,) i64

    @property
    def n_blocks(self) -> int:
        return len(self.block_e0)

    @property
    def n_elements(self) -> int:
        return int(self.chunk_n.sum())

    @classmethod
    def of(cls, heads: int, tokens: int, dim: int, epl: int, layer_counts: Sequence[int]) -> "Geometry":
        """One request's."""
        return cls.batch(heads, dim, epl, [(tokens, layer_counts)])

    @classmethod
    def batch(cls, heads: int, dim: int, epl: int, requests: Sequence[tuple[int, Sequence[int]]]) -> "Geometry":
        """``requests``: (tokens, layers of each chunk) of each."""
        if (heads < 1 or dim < 1 or not 1 <= epl <= 65536 or not requests
                or any(t < 0 or any(c < 1 for c in counts) for t, counts in requests)):
            raise ValueError("bad geometry")
        per = LANES * epl
        tok = np.array([t for t, _ in requests], np.int64)
        req_chunks = np.array([len(counts) for _, counts in requests], np.int64)
        chunk_req = np.repeat(np.arange(len(requests)), req_chunks)
        layers = np.array([c for _, counts in requests for c in counts], np.int64).reshape(-1)
        n = layers * 2 * heads * tok[chunk_req] * dim
        nb = -(-n // per)
        b0 = np.cumsum(nb) - nb
        chunk = np.repeat(np.arange(len(n)), nb)
        local = np.arange(int(nb.sum()), dtype=np.int64) - b0[chunk]
        e0 = (np.cumsum(n) - n)[chunk] + local * per
        bn = np.minimum(per, n[chunk] - local * per).astype(np.int32)
        req_n = np.bincount(chunk_req, n, minlength=len(requests)).astype(np.int64)
        return cls(heads, dim, epl, tok, np.cumsum(req_n) - req_n, req_chunks, n, b0, nb, e0, bn, chunk,
                   chunk_req[chunk].astype(np.int32), chunk_req)

    @property
    def req_chunk0(self) -> np.ndarray:
        """(requests,) each request's first chunk."""
        return np.cumsum(self.req_chunks) - self.req_chunks

    def same_layout(self, other: "Geometry") -> bool:
        """Whether streams coded for ``other`` hold this geometry's blocks (requests, tokens, chunks)."""
        if other is self:  # NOTE: the usual case: one request's geometry comes from the coder's cache
            return True
        return (self.heads, self.dim, self.epl) == (other.heads, other.dim, other.epl) and all(
            np.array_equal(a, b) for a, b in ((self.req_tokens, other.req_tokens), (self.req_chunks, other.req_chunks),
                                              (self.chunk_n, other.chunk_n)))

    def by_request(self, items: Sequence[Any]) -> list[list[Any]]:
        """Per-chunk ``items`` (in chunk order), grouped by request."""
        return [list(items[int(c0):int(c0 + n)]) for c0, n in zip(self.req_chunk0, self.req_chunks, strict=True)]


def decode_tables(flat: FlatTables) -> tuple[np.ndarray, np.ndarray]:
    """(cum_pad, bucket) as spk_block.h DecodeTables builds them: each row's cum then a
    PROB_SCALE sentinel (row r at offset[r] + r); bucket[t * BUCKETS + q] = the symbol of
    table t holding slot q << BUCKET_SHIFT."""
    n_tab, n_sym = len(flat.offset), len(flat.cum)
    row = np.repeat(np.arange(n_tab), flat.size)
    cum_pad = np.empty(n_sym + n_tab, np.uint16)
    cum_pad[np.arange(n_sym) + row] = flat.cum
    cum_pad[flat.offset + np.arange(n_tab) + flat.size] = PROB_SCALE
    q = np.arange(BUCKETS, dtype=np.int64) << BUCKET_SHIFT
    bucket = np.empty((n_tab, BUCKETS), np.uint16)
    for r in range(n_tab):
        cum = flat.cum[flat.offset[r]:flat.offset[r] + flat.size[r]]
        bucket[r] = np.clip(np.searchsorted(cum, q, side="right") - 1, 0, max(int(flat.size[r]) - 1, 0))
    return cum_pad, bucket.reshape(-1)


def smem_bytes(flat: FlatTables) -> int:
    """Dynamic shared memory of the table-staging kernels (spk_fused.cu spk_stage)."""
    n_tab, n_sym = len(flat.offset), len(flat.cum)
    return 8 * n_tab + 2 * (n_sym + n_tab) + 2 * n_sym


def _segmented(v: np.ndarray, g: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """Per block, the sums of ``v`` (blocks, k) over the earlier blocks of its chunk; per chunk, totals."""
    # NOTE: a sum before each block and one past the last: a chunk without blocks (a request of no
    # tokens in a batch) totals zero
    before = np.concatenate([np.zeros((1,) + v.shape[1:], _U64), np.cumsum(v, axis=0, dtype=_U64)])
    first = before[g.chunk_b0]
    return before[:-1] - first[g.block_chunk], before[g.chunk_b0 + g.chunk_blocks] - first


@dataclass(frozen=True)
class EncodeLayout:
    start: np.ndarray  # (blocks, 4) u64: bit position of each block's first field per section
    chunk_len: np.ndarray  # (chunks,) bytes of bits
    chunk_byte: np.ndarray  # (chunks,) u64 offset of each chunk's bits in the device buffer (4-aligned)
    total: int  # device buffer bytes


def encode_layout(counts: np.ndarray, g: Geometry) -> EncodeLayout:
    """From each block's bits per section (LOW, ZMAN, ESC, UNARY): where its fields go."""
    rel, tot = _segmented(counts, g)
    size = (tot + _U64(7)) // _U64(8)  # (chunks, 4) bytes per byte-padded section
    sec0 = 8 * (np.cumsum(size, axis=1, dtype=_U64) - size)
    length = size.sum(axis=1, dtype=_U64)
    chunk_byte, total = chunk_spans(length)
    return EncodeLayout(rel + sec0[g.block_chunk], length, chunk_byte, total)


def chunk_spans(length: np.ndarray) -> tuple[np.ndarray, int]:
    """Where chunks of ``length`` bytes go in one buffer: each at a 4-byte aligned offset (the section
    pass reads u32 words), 8 bytes after the last (spk_read_bits reads up to 3 bytes ahead); (offsets,
    buffer bytes)."""
    span = (np.asarray(length, _U64) + _U64(3)) // _U64(4) * _U64(4)
    return np.cumsum(span, dtype=_U64) - span, int(span.sum()) + 8


@dataclass
class ChunkCheck:
    """One chunk's section figures (spk_decode.h ChunkSections), as spk_decode_sections records them."""

    early: int = OK
    detail: int = 0
    pad: tuple[bool, bool, bool] = (False, False, False)  # LOW, ZMAN, ESC
    mu_bad: bool = False
    n_zero: int = 0
    ones: int = 0
    unary_bytes: int = 0
    unary_bits: int = 0

    @classmethod
    def of(cls, rec: np.ndarray) -> "ChunkCheck":
        """From a chunk's REC figures (spk_sections.cuh spk_sections_check / spk_sections_unary)."""
        early, detail, pad, mu_bad, n_zero, ones, unary_bytes, unary_bits = (int(v) for v in rec)
        return cls(early, detail, (bool(pad & 1), bool(pad & 2), bool(pad & 4)), bool(mu_bad), n_zero, ones,
                   unary_bytes, unary_bits)


REC = 8  # u64 figures a chunk (spk_sections.cuh SPK_REC)


def chunk_status(s: ChunkCheck, normal_bad: bool, zero_bad: bool) -> tuple[int, int, int]:
    """(status, figure, figure): the numpy decoder's order of checks (spk_decode.h chunk_status)."""
    if s.early:
        return s.early, s.detail, 0
    if s.pad[0]:
        return PADDING, 0, 0
    if normal_bad:
        return NO_FINITE, 0, 0
    if s.pad[1]:
        return PADDING, 0, 0
    if s.ones != s.n_zero:
        return UNARY_COUNT, s.n_zero, s.ones
    if ((s.unary_bits + 7) // 8 != s.unary_bytes) if s.n_zero else s.unary_bytes != 0:
        return UNARY_TAIL, s.unary_bytes, s.unary_bits
    if zero_bad:
        return ZERO_EXP, 0, 0
    if s.pad[2]:
        return PADDING, 0, 0
    if s.mu_bad:
        return NOT_ESCAPED, 0, 0
    return OK, 0, 0


def request_errors(g: Geometry, status: np.ndarray, recs: np.ndarray, flags: np.ndarray) -> list[Exception | None]:
    """Per request of a decode, the error decoding it alone raises, or None: its first block with a
    rANS status, else its first chunk whose checks fail (``chunk_status``), numbered within it."""
    errors: list[Exception | None] = [None] * len(g.req_chunks)
    c0 = g.req_chunk0
    for b in np.flatnonzero(status):
        q, c = int(g.block_req[b]), int(g.block_chunk[b])
        if errors[q] is None:
            errors[q] = _error(int(status[b]), c - int(c0[q]), int(b - g.chunk_b0[c]), 0, 0)
    for c in range(len(g.chunk_n)):
        q = int(g.chunk_req[c])
        if errors[q] is None:
            blk = slice(int(g.chunk_b0[c]), int(g.chunk_b0[c] + g.chunk_blocks[c]))
            s, f1, f2 = chunk_status(ChunkCheck.of(recs[c]), bool(flags[blk, 0].any()), bool(flags[blk, 1].any()))
            if s:
                errors[q] = _error(s, c - int(c0[q]), -1, f1, f2)
    return errors


def encoded_chunks(g: Geometry, lay: Any, states: np.ndarray, n_words: np.ndarray, words: np.ndarray,
                   bits: np.ndarray) -> list[EncodedChunk]:
    """Per chunk: its blocks' states, counts, words (views of this call's host arrays) and its bytes
    of the bits buffer."""
    out, w0 = [], 0
    for c in range(len(g.chunk_n)):
        blk = slice(int(g.chunk_b0[c]), int(g.chunk_b0[c] + g.chunk_blocks[c]))
        cn = n_words[blk].copy()
        nw = int(cn.sum(dtype=np.int64))
        b0 = int(lay.chunk_byte[c])
        out.append(EncodedChunk(RansBlocks(states[blk], cn, words[w0:w0 + nw]),
                                bits[b0:b0 + int(lay.chunk_len[c])].tobytes()))
        w0 += nw
    return out


def _chunk_blocks(blocks: RansBlocks, n_blocks: int) -> tuple[np.ndarray, ...]:
    """A chunk's (states, counts, words), checked as NativeCoder.decode does (RansDecodeError, ValueError)."""
    states, counts, words = _check_blocks(blocks)
    if states.shape[0] != n_blocks:
        raise ValueError(f"states: {states.nbytes} bytes, expected {int(n_blocks) * LANES * 4}")
    return states, counts, words


def checked_blocks(g: Geometry, streams: Sequence[Sequence[tuple[RansBlocks, bytes]]]) -> tuple[list, list]:
    """Per request, its chunks' (states, counts, words), checked as NativeCoder.decode does, and None;
    or None and the error that check raised (RansDecodeError, ValueError)."""
    parts: list[list[tuple[np.ndarray, ...]] | None] = []
    errors: list[Exception | None] = []
    for q, st in enumerate(streams):
        c0 = int(g.req_chunk0[q])
        try:
            parts.append([_chunk_blocks(blocks, int(nb)) for (blocks, _), nb in
                          zip(st, g.chunk_blocks[c0:c0 + len(st)], strict=True)])
            errors.append(None)
        except (ValueError, RansDecodeError) as e:
            parts.append(None)
            errors.append(e)
    return parts, errors


def concat_streams(parts: Sequence[tuple[np.ndarray, ...]], alloc: Any = np.empty) -> tuple[np.ndarray, ...]:
    """Checked chunks' (``checked_blocks``) states, word counts and words, each in one array (the
    words in ``alloc``'s)."""
    if not parts:
        return np.zeros((0, LANES), np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.uint16)
    words = np.concatenate([p[2] for p in parts], out=alloc(sum(len(p[2]) for p in parts), np.uint16))
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), words


def concat_bits(bits: Sequence[bytes], alloc: Any = np.empty) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The chunks' bytes in one buffer (``alloc``'s), laid out as the encoder's device buffer
    (chunk_spans), the gaps and the tail zeroed; (buffer, offsets, lengths)."""
    length = np.array([len(b) for b in bits], np.uint64)
    offset, total = chunk_spans(length)
    buf = alloc(total, np.uint8)
    ends = [int(o) + len(b) for b, o in zip(bits, offset, strict=True)]
    for b, o, e, nxt in zip(bits, offset, ends, list(offset[1:]) + [total], strict=True):
        buf[int(o):e] = np.frombuffer(b, np.uint8)
        buf[e:int(nxt)] = 0
    return buf, offset, length
