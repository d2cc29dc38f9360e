"""The fused CUDA coder: the whole per-scalar pipeline on the device (CuPy RawModule
of ``coder/kernels/spk_fused.cu``), writing the native CPU coder's bytes.

Lifecycle::

    cu = CudaCoder.load()                                   # NVRTC once per process (CuPy caches it)
    mu2 = cu.prepare_mu(mu, a, b, scales)                   # NativeCoder's signatures, numpy in/out
    parts = cu.encode(x, mu2, L, layer_counts, epl, tables)
    cu.decode(mu2, L, layer_counts, epl, streams, tables, out)
    # device-resident: CuPy arrays, or anything cupy.asarray takes (torch CUDA tensors of
    # the bit patterns: x.view(torch.int16) / torch.uint8; mu as int16 / int32 views)
    mu2 = cu.prepare_mu_device(mu_dev, a, b, scales)
    parts = cu.encode_device(x_dev, mu2, L, layer_counts, epl, tables)   # only words/states/bits come back
    kept = cu.encode_streams(x_dev, mu2, L, layer_counts, epl, tables)   # ... or stay on the device
    parts = cu.to_host(kept)                                             # (pinned host memory)
    cu.decode_device(mu2, L, layer_counts, epl, streams, tables, out_dev)
    cu.decode_streams(kept, mu2, L, layer_counts, epl, tables, out_dev)  # streams already on the device

CuPy is imported inside the class only: ``import speckv.coder.codec`` never imports it.
Host-side bookkeeping (geometry, section offsets, the decoder's checks) is numpy, in
``coder/cuda_host.py``; error statuses map through ``coder/native.py`` (same messages).
"""

from __future__ import annotations

import hashlib
import threading
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from . import cuda_host as host
from .cuda_args import DeviceArgs, DeviceStreams, Request, address
from .cuda_host import FORMATS, Geometry, encode_layout
from .cuda_tuning import DEFAULT, Tuning
from .native import EncodedChunk
from .rans import LANES, RansBlocks
from .tables import CodingTables

SOURCES = ("spk_consts.h", "rans_lane.cuh", "spk_float.cuh", "spk_model.cuh", "spk_device.cuh", "spk_sections.cuh",
           "spk_fused.cu")
KERNELS = ("spk_prepare_mu", "spk_gather", "spk_encode_bits", "spk_encode_rans", "spk_decode_sections") + tuple(
    f"spk_{k}_{f}" for k in ("encode_model", "decode_context", "decode_rans", "decode_values") for f in ("bf16", "fp8"))
# one CTA per block (a thread per element, or a warp per segment of the block; spk_decode_sections: per
# chunk); the others: a warp per block
CTA_KERNELS = ("spk_encode_bits", "spk_decode_sections") + tuple(
    f"spk_{k}_{f}" for k in ("encode_model", "decode_context", "decode_values") for f in ("bf16", "fp8"))


def source_dir() -> Path:
    return Path(str(resources.files("speckv.coder") / "kernels"))


def source() -> str:
    """spk_fused.cu, headed by a digest of every file it includes.
    NOTE: CuPy caches binaries by source text and options, not by included files:
    the digest makes a header change recompile."""
    h = hashlib.sha256(b"".join((source_dir() / n).read_bytes() for n in SOURCES)).hexdigest()[:16]
    return f"// speckv sources {h}\n" + (source_dir() / "spk_fused.cu").read_text()


class CudaCoder:
    """The fused kernels on the current CUDA device; arrays in (layers, 2, heads, tokens, dim) order."""

    name = "cuda"
    _lock = threading.Lock()
    _cache: "CudaCoder | None" = None

    def __init__(self, cp: Any, empty_pinned: Any = None, tuning: Tuning = DEFAULT) -> None:
        self.cp, self.tuning = cp, tuning
        self.args = DeviceArgs(cp, empty_pinned)
        # NOTE: FP32 operations must not contract. CuPy appends -ftz=true to these options, so
        # spk_model.cuh keeps subnormals by emulating its float32 operations in float64
        opts = ("-std=c++17", f"-I{source_dir()}", "--fmad=false") + tuning.defines()
        self.module = cp.RawModule(code=source(), options=opts)
        self.k = {n: self.module.get_function(n) for n in KERNELS}
        # kernel name -> device seconds, summed over launches, while a caller profiles (``profiled``)
        self.kernel_s: dict[str, float] | None = None

    @classmethod
    def load(cls) -> "CudaCoder":
        """The process's coder (compiled on first use)."""
        with cls._lock:
            if cls._cache is None:
                import cupy as cp
                import cupyx

                cls._cache = cls(cp, cupyx.empty_pinned)
            return cls._cache

    def _launch(self, name: str, n_blocks: int, args: tuple, smem: int = 0) -> None:
        if n_blocks == 0:
            return
        k = self.k[name]
        if smem:
            k.max_dynamic_shared_size_bytes = smem  # NOTE: the staged tables exceed the default 48 KiB
        # a lane pass: one warp per block, rans_warps to a CTA; the others: one CTA per block
        t = self.tuning
        grid, block = ((n_blocks,), (t.model_cta,)) if name in CTA_KERNELS else ((-(-n_blocks // t.rans_warps),),
                                                                                 (32 * t.rans_warps,))
        prof = self.kernel_s  # NOTE: read once: profiled() in another thread may reset it meanwhile
        if prof is None:
            k(grid, block, args, shared_mem=smem)
            return
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record()
        k(grid, block, args, shared_mem=smem)
        end.record()
        end.synchronize()
        prof[name] = prof.get(name, 0.0) + self.cp.cuda.get_elapsed_time(start, end) / 1e3

    def profiled(self, fn: Any) -> tuple[float, dict[str, float]]:
        """(wall seconds of ``fn()``, device seconds per kernel in it): where a call's time goes.
        NOTE: each launch then waits for its kernel, so the wall time is not the unprofiled one; for
        a benchmark with nothing else coding on the device (other threads' kernels would count)."""
        import time

        self.cp.cuda.Device().synchronize()
        self.kernel_s = {}
        try:
            t0 = time.perf_counter()
            fn()
            self.cp.cuda.Device().synchronize()
            return time.perf_counter() - t0, self.kernel_s
        finally:
            self.kernel_s = None

    # -- mu ------------------------------------------------------------------------------
    def prepare_mu_device(self, mu: Any, a: Any, b: Any, scales: Any) -> Any:
        """NativeCoder.prepare_mu on device arrays; returns a CuPy array (u16, or u32 for FP8)."""
        cp = self.cp
        mu = self.args.bits(mu, 2, "mu")
        layers, _, heads, tokens, dim = mu.shape
        fp8, affine = scales is not None, a is not None
        out = cp.empty(mu.shape, cp.uint32 if fp8 else cp.uint16)
        dummy = cp.zeros(1, cp.float32)
        af = cp.ascontiguousarray(cp.asarray(a), cp.float32) if affine else dummy
        bf = cp.ascontiguousarray(cp.asarray(b), cp.float32) if affine else dummy
        sc = cp.ascontiguousarray(cp.asarray(scales), cp.float32) if fp8 else dummy
        if affine and not af.size == bf.size == layers * 2 * heads * dim:
            raise ValueError("a, b: one value per (layer, kv, head, dim) channel")
        if fp8 and sc.size != layers * 2:
            raise ValueError("scales: one per (layer, kv)")
        if mu.size:
            grid = min(-(-mu.size // 256), 4096)
            self.k["spk_prepare_mu"]((grid,), (256,), (mu, af, bf, sc, np.int32(affine), np.int32(fp8),
                                                       np.int64(mu.size), np.int64(tokens), np.int32(dim),
                                                       np.int32(heads), out))
        return out

    def prepare_mu(self, mu: np.ndarray, a: np.ndarray | None, b: np.ndarray | None,
                   scales: np.ndarray | None) -> np.ndarray:
        """NativeCoder.prepare_mu (numpy in, numpy out)."""
        return self.cp.asnumpy(self.prepare_mu_device(np.ascontiguousarray(mu, np.uint16), a, b, scales))

    # -- encode --------------------------------------------------------------------------
    def encode_streams(self, x: Any, mu: Any, log2_sigma: Any, layer_counts: Sequence[int], elems_per_lane: int,
                       tables: CodingTables) -> DeviceStreams | None:
        """The encode, its streams left in device memory (for a sender that reads them there, such as
        GPUDirect RDMA; ``to_host`` brings them over). None when the KV holds no element."""
        return self.encode_batch_streams([Request(x, mu, log2_sigma, layer_counts)], elems_per_lane, tables)

    def encode_batch_streams(self, requests: Sequence[Request], elems_per_lane: int,
                             tables: CodingTables) -> DeviceStreams | None:
        """``encode_streams`` of several requests (prompts of any lengths) in one launch a pass: their
        chunks one after another in the streams (``DeviceStreams.geometry.by_request`` splits them)."""
        cp = self.cp
        g, geo, _, fp8, held = self.args.requests(requests, elems_per_lane, encode=True)
        nb, sfx = g.n_blocks, "fp8" if fp8 else "bf16"
        if nb == 0:
            return None
        targs = self.args.tables_of(tables)[0]
        counts, host_counts = cp.empty((nb, 4), cp.uint64), self.args.staging((nb, 4), np.uint64)
        ops, raw = cp.empty(g.n_elements, cp.uint32), cp.empty(g.n_elements, cp.uint32)  # NOTE: 8 bytes an element
        self._launch(f"spk_encode_model_{sfx}", nb, geo + targs + (ops, raw, counts))
        cp.asnumpy(counts, out=host_counts, blocking=False)
        counted = cp.cuda.Event()
        counted.record()
        try:
            states, n_words = cp.empty((nb, LANES), cp.uint32), cp.empty(nb, cp.uint32)
            scratch = cp.empty(nb * elems_per_lane * LANES, cp.uint16)
            self._launch("spk_encode_rans", nb, geo[:4] + (ops, states, n_words, scratch))
        finally:
            # NOTE: the one wait mid-call (bit positions need the counts), while the device runs the rANS
            # pass; also on an error: the pinned pool must not take host_counts back with a copy pending
            counted.synchronize()
        del held  # NOTE: read: spk_encode_model has run (the only kernel that reads through req_ptr)
        lay = encode_layout(host_counts, g)
        bits = cp.zeros(lay.total, cp.uint8)
        mant, width = FORMATS[fp8]
        self._launch("spk_encode_bits", nb, geo[:3] + (np.int32(mant), np.int32(width), raw, cp.asarray(lay.start),
                                                       cp.asarray(lay.chunk_byte[g.block_chunk]), bits))
        del ops, raw
        offsets = cp.cumsum(n_words, dtype=cp.uint64) - n_words
        words = cp.empty(scratch.size, cp.uint16)
        self._launch("spk_gather", nb, (scratch, n_words, offsets, np.int32(nb), np.int32(elems_per_lane), words))
        ready = cp.cuda.Event()
        ready.record()
        return DeviceStreams(g, lay, states, n_words, words, bits, ready)

    def to_host(self, s: DeviceStreams) -> list[EncodedChunk]:
        """Per chunk: its blocks' states, counts, words and bits, on the host (through pinned memory
        where CuPy has it: a pageable copy runs at a fraction of the link's speed).
        NOTE: the chunks' words are views of one pinned array, which CuPy's pinned pool takes back
        when the last chunk is dropped (it keeps the pages for the next encode, never the OS)."""
        cp = self.cp
        cp.cuda.get_current_stream().wait_event(s.ready)  # NOTE: this thread's stream may not be the encoder's
        nw, states, bits = (self.args.staging(a.shape, a.dtype) for a in (s.n_words, s.states, s.bits))
        try:
            for a, out in ((s.n_words, nw), (s.states, states), (s.bits, bits)):
                cp.asnumpy(a, out=out, blocking=False)
        finally:  # NOTE: also on an error: no pinned array goes back to the pool with a copy pending
            copied = cp.cuda.Event()
            copied.record()
            copied.synchronize()  # NOTE: two waits: this one, then the words' copy (its size: the counts' sum)
        words = self.args.staging(int(nw.sum(dtype=np.int64)), np.uint16)
        s.words[:len(words)].get(out=words)  # NOTE: blocking: the copy is done on return
        return host.encoded_chunks(s.geometry, s.layout, states, nw, words, bits)

    def encode_device(self, x: Any, mu: Any, log2_sigma: Any, layer_counts: Sequence[int], elems_per_lane: int,
                      tables: CodingTables) -> list[EncodedChunk]:
        """NativeCoder.encode on device arrays: only the streams come back to the host."""
        return self.encode_batch([Request(x, mu, log2_sigma, layer_counts)], elems_per_lane, tables)[0]

    def encode_batch(self, requests: Sequence[Request], elems_per_lane: int,
                     tables: CodingTables) -> list[list[EncodedChunk]]:
        """``encode_device`` of several requests in one launch a pass: per request, its chunks, the
        native coder's bytes for that request alone."""
        s = self.encode_batch_streams(requests, elems_per_lane, tables)
        if s is None:
            empty = RansBlocks(np.zeros((0, LANES), np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.uint16))
            return [[EncodedChunk(empty, b"") for _ in r.layer_counts] for r in requests]
        return s.geometry.by_request(self.to_host(s))

    def encode(self, x: np.ndarray, mu: np.ndarray, log2_sigma: np.ndarray, layer_counts: Sequence[int],
               elems_per_lane: int, tables: CodingTables) -> list[EncodedChunk]:
        """NativeCoder.encode (numpy in; the arrays are copied to the device)."""
        cp = self.cp
        return self.encode_device(cp.asarray(np.ascontiguousarray(x)), cp.asarray(np.ascontiguousarray(mu)),
                                  np.asarray(log2_sigma), layer_counts, elems_per_lane, tables)

    # -- decode --------------------------------------------------------------------------
    def decode_device(self, mu: Any, log2_sigma: Any, layer_counts: Sequence[int], elems_per_lane: int,
                      streams: Sequence[tuple[RansBlocks, bytes]], tables: CodingTables, out: Any) -> None:
        """NativeCoder.decode into a device array ``out`` (u16 BF16 / u8 e4m3 patterns, C-contiguous),
        from streams on the host (copied over through pinned memory, then decoded as ``decode_streams``).

        Raises RansDecodeError or IntegrityError, as the numpy decoder does, on a corrupt stream."""
        _first_error(self.decode_batch([Request(out, mu, log2_sigma, layer_counts)], elems_per_lane, [streams], tables))

    def decode_batch(self, requests: Sequence[Request], elems_per_lane: int,
                     streams: Sequence[Sequence[tuple[RansBlocks, bytes]]],
                     tables: CodingTables) -> list[Exception | None]:
        """``decode_device`` of several requests in one launch a pass, each into its ``Request.kv``
        (a device array); per request, the error decoding it alone raises (RansDecodeError,
        IntegrityError, or ValueError for blocks of the wrong shape) or None: a corrupt stream fails its
        own request only, whose array may then hold part of a KV. Malformed requests (arrays, a list of
        streams of another length) raise."""
        cp = self.cp
        g, geo, chunks, fp8, held = self.args.requests(requests, elems_per_lane, encode=False)
        if len(streams) != len(requests):
            raise ValueError(f"need {len(requests)} requests' streams, not {len(streams)}")
        for r, st in zip(requests, streams, strict=True):
            if len(st) != len(r.layer_counts):
                raise ValueError(f"need a list of {len(r.layer_counts)} chunk streams")
        parts, errors = host.checked_blocks(g, streams)
        keep = [q for q, e in enumerate(errors) if e is None]
        if len(keep) < len(requests):  # NOTE: the others decode without the requests whose blocks failed
            if keep:
                done = self.decode_batch([requests[q] for q in keep], elems_per_lane, [streams[q] for q in keep],
                                         tables)
                for q, e in zip(keep, done, strict=True):
                    errors[q] = e
            return errors
        flat = [c for st in streams for c in st]
        states, counts, words = host.concat_streams([c for p in parts if p is not None for c in p], self.args.staging)
        bits, cbyte, clen = host.concat_bits([c[1] for c in flat], self.args.staging)
        word_lo = np.cumsum(counts, dtype=np.int64) - counts  # NOTE: chunks' words are concatenated in order
        return self._decode(g, (geo, chunks), fp8, tables, (cp.asarray(states), cp.asarray(counts), cp.asarray(word_lo),
                            cp.asarray(words if words.size else np.zeros(1, np.uint16))), cp.asarray(bits), cbyte, clen)

    def decode_streams(self, s: DeviceStreams, mu: Any, log2_sigma: Any, layer_counts: Sequence[int],
                       elems_per_lane: int, tables: CodingTables, out: Any) -> None:
        """NativeCoder.decode of streams in device memory (``encode_streams``'s, or a receiver's laid out
        the same way) into a device array ``out``: only the checks' figures cross to the host."""
        _first_error(self.decode_streams_batch(s, [Request(out, mu, log2_sigma, layer_counts)], elems_per_lane, tables))

    def decode_streams_batch(self, s: DeviceStreams, requests: Sequence[Request], elems_per_lane: int,
                             tables: CodingTables) -> list[Exception | None]:
        """``decode_streams`` of a batch's streams (``encode_batch_streams``'s), as ``decode_batch``."""
        cp = self.cp
        g, geo, chunks, fp8, held = self.args.requests(requests, elems_per_lane, encode=False)
        if not g.same_layout(s.geometry):
            raise ValueError("the streams were coded for another geometry")
        # NOTE: the sections pass reads the bits as u32 words: a misaligned one would end the CUDA context
        if address(s.bits) % 4 or np.any(np.asarray(s.layout.chunk_byte, np.uint64) % np.uint64(4)):
            raise ValueError("bits: each chunk's bytes must start 4-byte aligned in device memory")
        cp.cuda.get_current_stream().wait_event(s.ready)  # NOTE: they may have been coded on another stream
        word_lo = cp.cumsum(s.n_words, dtype=cp.int64) - s.n_words
        return self._decode(g, (geo, chunks), fp8, tables, (s.states, s.n_words, word_lo, s.words), s.bits,
                            s.layout.chunk_byte, s.layout.chunk_len)

    def _decode(self, g: Geometry, geo: tuple, fp8: bool, tables: CodingTables, words: tuple, bits: Any,
                cbyte: np.ndarray, clen: np.ndarray) -> list[Exception | None]:
        """The four passes, queued without a wait: contexts, rANS, sections (the checks, unary codes),
        values; then one wait for the statuses. ``words``: (states, counts, first word, words) on the device;
        ``geo``: the kernels' block arguments (req_ptr last) and the chunks'."""
        cp, nb, nc, sfx = self.cp, g.n_blocks, len(g.chunk_n), "fp8" if fp8 else "bf16"
        geo, chunks = geo
        targs, bucket, smem = self.args.tables_of(tables)
        info = cp.empty(max(g.n_elements, 1), cp.uint32)
        tally, status = cp.empty((nb, 5), cp.uint64), cp.empty(nb, cp.int32)  # NOTE: every block writes its own
        ctxs = cp.empty(max(g.n_elements, 1), cp.uint32)  # NOTE: the contexts, then the unary codes' deltas
        self._launch(f"spk_decode_context_{sfx}", nb, geo + (ctxs,))
        self._launch(f"spk_decode_rans_{sfx}", nb, geo + targs + (bucket, ctxs) + words + (info, tally, status), smem)
        sec, skip = cp.empty((max(nb, 1), 4), cp.uint64), cp.empty(max(nb, 1), cp.uint8)
        rec = cp.empty((max(nc, 1), host.REC), cp.uint64)
        (mant, width), cb = FORMATS[fp8], np.asarray(cbyte, np.uint64)
        self._launch("spk_decode_sections", nc, chunks + (cp.asarray(cb), cp.asarray(np.asarray(clen, np.uint64)),
                      np.int32(nc), np.int32(mant), np.int32(width), tally, status, bits, sec, skip, ctxs, rec))
        flags = cp.zeros((nb, 2), cp.uint32)
        self._launch(f"spk_decode_values_{sfx}", nb, geo + (info, sec, cp.asarray(cb[g.block_chunk]), skip, bits, ctxs,
                                                             flags))
        st = cp.asnumpy(status)  # NOTE: the one wait
        return host.request_errors(g, st, cp.asnumpy(rec), cp.asnumpy(flags))

    def decode(self, mu: np.ndarray, log2_sigma: np.ndarray, layer_counts: Sequence[int], elems_per_lane: int,
               streams: Sequence[tuple[RansBlocks, bytes]], tables: CodingTables, out: np.ndarray) -> None:
        """NativeCoder.decode (numpy in and out; ``out`` is written only on success)."""
        cp = self.cp
        dev = cp.empty(out.shape, out.dtype)
        self.decode_device(cp.asarray(np.ascontiguousarray(mu)), np.asarray(log2_sigma), layer_counts,
                           elems_per_lane, streams, tables, dev)
        self.copy_out(dev, out)

    def copy_out(self, dev: Any, out: np.ndarray) -> None:
        """A decoded device array into the host array ``out``: straight into it where it is a contiguous
        numpy array (one copy, where ``out[...] = asnumpy(dev)`` made a second of the whole KV on the host).
        NOTE: CuPy's get(out=) writes through the array's address, read-only or not: a read-only ``out``
        takes the assignment, which refuses it (ValueError), as the native coder does."""
        if (type(out) is np.ndarray and out.flags.c_contiguous and out.flags.writeable and out.dtype == dev.dtype
                and out.shape == dev.shape):
            dev.get(out=out)  # NOTE: blocking: the copy is done on return
        else:
            out[...] = self.cp.asnumpy(dev)


def _first_error(errors: list[Exception | None]) -> None:
    if errors[0] is not None:
        raise errors[0]
