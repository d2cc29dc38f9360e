"""The fused CUDA coder's arguments on the device (``coder/cuda.py``), each checked: bit patterns,
sigma levels, the tables and the block geometry (on the device once each), a batch's requests
(``Request``), and the streams an encode leaves there (``DeviceStreams``). CuPy comes in as ``cp``:
nothing here imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .cuda_host import Geometry, decode_tables, smem_bytes
from .native import FlatTables
from .tables import CodingTables


class DeviceArgs:
    """A coder's device copies of its calls' arguments, and the caches that keep them there."""

    def __init__(self, cp: Any, empty_pinned: Any = None) -> None:
        self.cp = cp
        self.empty_pinned = empty_pinned  # cupyx.empty_pinned: host arrays the device copies into at full speed
        self._tables: dict[int, tuple[CodingTables, tuple[Any, ...], Any, int]] = {}
        self._geo: dict[tuple, tuple[Geometry, tuple[Any, ...], tuple[Any, ...]]] = {}

    def bits(self, a: Any, itemsize: int, name: str) -> Any:
        """A contiguous unsigned view of bit patterns (int16 views of BF16 tensors welcome)."""
        a = self.cp.ascontiguousarray(self.cp.asarray(a))
        if a.dtype.kind not in "iu" or a.dtype.itemsize != itemsize:
            raise ValueError(f"{name}: expected {8 * itemsize}-bit bit patterns, not {a.dtype}")
        return a.view(f"u{itemsize}")

    def levels(self, log2_sigma: Any, n: int) -> Any:
        # NOTE: a host array is checked on the host: on the device, min and max would cost two waits a call
        lg = log2_sigma if isinstance(log2_sigma, np.ndarray) else self.cp.asarray(log2_sigma)
        if lg.size != n:
            raise ValueError(f"L: {lg.size} values, expected {n}")
        if lg.size and (int(lg.min()) < -(1 << 30) or int(lg.max()) >= 1 << 30):
            raise ValueError("log2 sigma out of range")
        return self.cp.ascontiguousarray(self.cp.asarray(lg), self.cp.int32)

    def tables_of(self, tables: CodingTables) -> tuple[tuple[Any, ...], Any, int]:
        """(kernel table args, bucket, shared bytes), on the device once per tables object."""
        # NOTE: the entry holds its tables: a freed object's id, reused by another, never finds its entry
        hit = self._tables.get(id(tables))
        if hit is None or hit[0] is not tables:
            cp, flat = self.cp, FlatTables.of(tables)
            cum_pad, bucket = decode_tables(flat)
            args = (cp.asarray(cum_pad), cp.asarray(flat.freq), cp.asarray(flat.offset), cp.asarray(flat.radius),
                    np.int32(len(flat.offset)), np.int32(len(flat.cum)))
            hit = self._tables[id(tables)] = (tables, args, cp.asarray(bucket), smem_bytes(flat))
        return hit[1:]

    def geometry(self, shapes: Sequence[Sequence[int]], epl: int,
                  layer_counts: Sequence[Sequence[int]]) -> tuple[Geometry, tuple, tuple]:
        """(geometry, the kernels' block arguments, spk_decode_sections' chunk arguments) of a batch
        of requests' arrays, on the device once."""
        heads, dim = int(shapes[0][2]), int(shapes[0][4])
        if any(len(s) != 5 or int(s[2]) != heads or int(s[4]) != dim for s in shapes):
            raise ValueError("a batch's requests: (layers, 2, heads, tokens, dim) arrays of one heads and dim")
        reqs = tuple((int(s[3]), tuple(int(c) for c in lc)) for s, lc in zip(shapes, layer_counts, strict=True))
        key = (heads, dim, epl, reqs)
        if key not in self._geo:
            if len(self._geo) > 64:
                self.cp.cuda.Device().synchronize()  # NOTE: no kernel may still read what the pool takes back
                self._geo.clear()
            g = Geometry.batch(heads, dim, epl, reqs)
            cp = self.cp
            args = (cp.asarray(g.block_e0), cp.asarray(g.block_n), np.int32(g.n_blocks), np.int32(epl),
                    cp.asarray(g.block_req), cp.asarray(g.req_e0), cp.asarray(g.req_tokens), np.int32(dim))
            e0 = np.cumsum(g.chunk_n) - g.chunk_n
            chunks = tuple(cp.asarray(np.asarray(a, np.int64)) for a in (g.chunk_b0, g.chunk_blocks, e0))
            self._geo[key] = (g, args, chunks)
        g = self._geo[key][0]
        for q, s in enumerate(shapes):
            n = int(g.req_e0[q + 1] if q + 1 < len(shapes) else g.n_elements) - int(g.req_e0[q])
            if int(np.prod(s)) != n:
                raise ValueError(f"{tuple(s)} does not hold layers {list(layer_counts[q])}")
        return self._geo[key]

    def requests(self, reqs: Sequence["Request"], epl: int, encode: bool) -> tuple:
        """A batch's arrays checked: (geometry, kernel block arguments + req_ptr, chunk arguments, fp8,
        the arrays req_ptr points at: held until the call's kernels are queued)."""
        if not reqs:
            raise ValueError("a batch needs at least one request")
        cp, held, ptrs = self.cp, [], []
        kvs = [cp.asarray(r.kv) for r in reqs]  # NOTE: views of torch CUDA tensors, never copies
        fp8 = kvs[0].dtype.itemsize == 1
        for r, kv in zip(reqs, kvs, strict=True):
            if (kv.dtype.itemsize == 1) != fp8:
                raise ValueError("a batch's requests: one KV dtype (BF16 or FP8)")
            if encode:
                kv = self.bits(kv, 1 if fp8 else 2, "x")
            elif not kv.flags.c_contiguous:
                raise ValueError("out must be C-contiguous")
            mu = self.bits(r.mu, 4 if fp8 else 2, "mu")
            if mu.size != kv.size:
                raise ValueError(f"mu: {mu.size} values, expected {kv.size}")
            L = self.levels(r.log2_sigma, channels(kv.shape))
            held.append((kv, mu, L))
            ptrs += [address(kv), address(mu), address(L)]  # NOTE: spk_device.cuh SPK_REQ_PTRS order
        g, geo, chunks = self.geometry([h[0].shape for h in held], epl, [r.layer_counts for r in reqs])
        return g, geo + (cp.asarray(np.array(ptrs, np.uint64)),), chunks, fp8, held

    def staging(self, shape: Any, dtype: Any) -> np.ndarray:
        """A host array the device copies from at full speed (pinned where CuPy has it)."""
        return np.empty(shape, dtype) if self.empty_pinned is None else self.empty_pinned(shape, dtype)


def address(a: Any) -> int:
    """Device address of an array's first byte (__cuda_array_interface__, as CuPy and torch give it)."""
    return int(a.__cuda_array_interface__["data"][0])


def channels(shape: Sequence[int]) -> int:
    """Values of L: one per (layer, kv, head, dim) channel."""
    return int(shape[0]) * int(shape[1]) * int(shape[2]) * int(shape[4])


@dataclass(frozen=True)
class Request:
    """One request (a prompt) of a batched call: ``kv`` its KV (encode: BF16 or e4m3 bit patterns, or
    a torch CUDA tensor's int16 / uint8 view) or the C-contiguous array it decodes into (decode);
    ``mu`` prepared (``prepare_mu_device``), ``log2_sigma`` (L) and its chunks' layer counts, as the
    one-request calls take them."""

    kv: Any
    mu: Any
    log2_sigma: Any
    layer_counts: Sequence[int]


@dataclass(frozen=True)
class DeviceStreams:
    """An encode's streams in device memory: per block final states (blocks, LANES) and word counts,
    the words of all blocks in order, the chunks' bit sections at ``layout.chunk_byte``; complete
    once ``ready`` (a CUDA event) has passed: a reader on another stream waits on it first."""

    geometry: Geometry
    layout: Any  # cuda_host.encode_layout's
    states: Any
    n_words: Any
    words: Any
    bits: Any
    ready: Any
