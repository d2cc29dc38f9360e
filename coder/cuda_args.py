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
        self._ptrs: dict[tuple[int, ...], Any] = {}  # request pointer tables by their addresses

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
        of requests' arrays (shapes checked by ``requests``); a request alone's on the device once.
        NOTE: a batch's is made for its call only: batches of prompts seldom repeat, and a full cache
        drains the device before it empties."""
        heads, dim = int(shapes[0][2]), int(shapes[0][4])
        reqs = tuple((int(s[3]), tuple(int(c) for c in lc)) for s, lc in zip(shapes, layer_counts, strict=True))
        key = (heads, dim, epl, reqs)
        hit = self._geo.get(key)  # NOTE: read once: another thread may empty the cache meanwhile
        if hit is None:
            hit = self._geometry_on_device(Geometry.batch(heads, dim, epl, reqs))
            if len(reqs) == 1:
                if len(self._geo) > 64:
                    self.cp.cuda.Device().synchronize()  # NOTE: no kernel may still read what the pool takes back
                    self._geo.clear()
                self._geo[key] = hit
        return hit

    def _geometry_on_device(self, g: Geometry) -> tuple[Geometry, tuple, tuple]:
        cp = self.cp
        args = (cp.asarray(g.block_e0), cp.asarray(g.block_n), np.int32(g.n_blocks), np.int32(g.epl),
                cp.asarray(g.block_req), cp.asarray(g.req_e0), cp.asarray(g.req_tokens), np.int32(g.dim))
        e0 = np.cumsum(g.chunk_n) - g.chunk_n
        return g, args, tuple(cp.asarray(np.asarray(a, np.int64)) for a in (g.chunk_b0, g.chunk_blocks, e0))

    def requests(self, reqs: Sequence["Request"], epl: int, encode: bool) -> tuple:
        """A batch's arrays checked: (geometry, kernel block arguments + req_ptr, chunk arguments, fp8,
        the arrays req_ptr points at: the caller holds them until the call's kernels have read them)."""
        if not reqs:
            raise ValueError("a batch needs at least one request")
        cp, held, ptrs = self.cp, [], []
        kvs = [self._kv(r.kv, encode) for r in reqs]
        fp8, (heads, dim) = kvs[0].dtype.itemsize == 1, (kvs[0].shape[2], kvs[0].shape[4])
        device = cp.cuda.Device().id
        for r, kv in zip(reqs, kvs, strict=True):
            if (kv.dtype.itemsize == 1) != fp8:
                raise ValueError("a batch's requests: one KV dtype (BF16 or FP8)")
            if (kv.shape[2], kv.shape[4]) != (heads, dim):
                raise ValueError("a batch's requests: (layers, 2, heads, tokens, dim) arrays of one heads and dim")
            if sum(int(c) for c in r.layer_counts) != kv.shape[0]:
                raise ValueError(f"{tuple(kv.shape)} does not hold layers {list(r.layer_counts)}")
            mu = self.bits(r.mu, 4 if fp8 else 2, "mu")
            if mu.size != kv.size:
                raise ValueError(f"mu: {mu.size} values, expected {kv.size}")
            L = self.levels(r.log2_sigma, channels(kv.shape))
            for a in (kv, mu, L):  # NOTE: a kernel reads req_ptr's addresses as the current device's
                if getattr(getattr(a, "device", None), "id", device) != device:
                    raise ValueError(f"an array on device {a.device.id}: this coder runs on device {device}")
            held.append((kv, mu, L))
            ptrs += [address(kv), address(mu), address(L)]  # NOTE: spk_device.cuh SPK_REQ_PTRS order
        g, geo, chunks = self.geometry([h[0].shape for h in held], epl, [r.layer_counts for r in reqs])
        return g, geo + (self._pointers(tuple(ptrs)),), chunks, fp8, held

    def _pointers(self, ptrs: tuple[int, ...]) -> Any:
        """req_ptr on the device, once per set of addresses.
        NOTE: a table is its addresses only: right whatever the arrays at them hold now."""
        tab = self._ptrs.get(ptrs)
        if tab is None:
            if len(self._ptrs) > 256:
                self.cp.cuda.Device().synchronize()  # NOTE: no kernel may still read what the pool takes back
                self._ptrs.clear()
            tab = self._ptrs[ptrs] = self.cp.asarray(np.array(ptrs, np.uint64))
        return tab

    def _kv(self, kv: Any, encode: bool) -> Any:
        """A request's KV (encode: its bit patterns, on the device) or the device array it decodes into."""
        if encode:
            a = self.cp.asarray(kv)  # NOTE: a view of a torch CUDA tensor; a host array is copied over
            a = self.bits(a, 1 if a.dtype.itemsize == 1 else 2, "x")
        else:
            # NOTE: a host array would be copied to the device, decoded into there and dropped: refused
            if not hasattr(kv, "__cuda_array_interface__"):
                raise ValueError("out must be a device array (CuPy, or a torch CUDA tensor's int16 / uint8 view)")
            a = self.cp.asarray(kv)
            if address(a) != address(kv) or a.dtype.kind not in "iu" or a.dtype.itemsize not in (1, 2):
                raise ValueError(f"out: expected 16- or 8-bit bit patterns in place, not {a.dtype}")
            if not a.flags.c_contiguous:
                raise ValueError("out must be C-contiguous")
        if a.ndim != 5:
            raise ValueError(f"expected (layers, 2, heads, tokens, dim) arrays, not {tuple(a.shape)}")
        return a

    def staging(self, shape: Any, dtype: Any) -> np.ndarray:
        """A host array the device copies from at full speed (pinned where CuPy has it)."""
        return np.empty(shape, dtype) if self.empty_pinned is None else self.empty_pinned(shape, dtype)


def address(a: Any) -> int:
    """Device address of an array's first byte: a CuPy array's data pointer, else its
    __cuda_array_interface__ (as torch gives it)."""
    ptr = getattr(getattr(a, "data", None), "ptr", None)  # NOTE: CuPy's; the interface builds a dict a call
    return int(ptr) if ptr is not None else int(a.__cuda_array_interface__["data"][0])


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
