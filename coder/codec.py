"""The codec: a KV cache + its prompt <-> container records, bit-exact.

Lifecycle::

    codec = Codec.from_predictor(predictor)          # tables + sigma from the pinned checkpoint
    records = list(codec.encode(kv, ids))            # header record, then one per chunk
    kv_back = codec.decode(records, ids)             # checks pin, prompt, mu, checksums

``kv`` is BF16 ``(layers, 2, kv_heads, tokens, head_dim)`` or :class:`Fp8KV`
(e4m3 codes + one fp32 scale per (layer, kv)). mu comes from the predictor on
``ids`` unless given. Chunks group ``layers_per_chunk`` layers; each holds
whole rANS blocks of ``LANES * elems_per_lane`` elements, so it decodes on its
own. The numpy path (``reference``) codes many chunks in one vectorised pass; a
backend (``backends``) writes the same bytes. A chunk may go stored instead (raw
bytes, ``stored``): on request, or when coded it would be larger.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial
from typing import TYPE_CHECKING, Any, Collection, Iterable, Iterator, Sequence, cast

import numpy as np

from speckv.digests import DIGEST_BYTES, digest, prompt_digest
from speckv.errors import IntegrityError
from speckv.kv import Fp8KV, bf16_bits

from . import container as ct
from . import reference
from .backends import select_backend
from .config import MAX_ELEMS_PER_LANE, CodecConfig
from .integrity import Ahead, Sums, check_header, check_mu, chunk_sums, verified_all
from .interfaces import CheckpointLike, MuSource
from .lookahead import Lookahead, runs_ahead
from .model import BF16, E4M3, Context, ContextTable, FloatFormat
from .plan import (
    Plan,
    Prepared,
    Unpacked,
    adapted_plan,
    bf16_context_table,
    build_plan,
    chunk_rounding,
    chunk_scales,
    chunk_shifts,
    element_groups,
    plan_context,
    runs,
    stored_of,
    whole_record,
)
from .rans import RansBlocks, concat_blocks, split_blocks
from .residual import MODEL_NAMES, MODEL_SEED, ResidualModel, models_of
from .stored import stored_chunk, stored_chunks, stored_record_len, unstored_chunk
from .tables import CodingTables

if TYPE_CHECKING:  # pragma: no cover
    import torch


logger = logging.getLogger(__name__)
# NOTE: a whole stream is coded at most this many elements at a time (element_groups), 4 MB of BF16
# (SmolLM2-135M, 2,048 tokens: one 2-layer chunk of 1.57 M), so its peak holds one group's prepared
# mu, sampled costs and native scratch (4 bytes an element in decode), not the stream's. Halved from
# 1 << 22 with the same decode speed here; a decoder's 2048-token peak fell ~15 MiB (RESULTS.md)
GROUP_ELEMENTS = 1 << 21

class Codec:
    """Encoder and decoder of KV caches under one pinned predictor."""

    def __init__(self, tables: CodingTables, log2_sigma: np.ndarray, pin: str,
                 predictor: "MuSource | None" = None, config: CodecConfig | None = None,
                 models: dict[int, ResidualModel] | None = None) -> None:
        """``tables`` and ``log2_sigma``: the seed model's; ``models``: every model id the
        checkpoint supports (default: the seed's alone)."""
        self.tables = tables
        self.log2_sigma = log2_sigma.astype(np.int64)  # (layers, 2, kv_heads, head_dim)
        self.models = models or {MODEL_SEED: ResidualModel(MODEL_SEED, tables, self.log2_sigma)}
        self.pin = pin  # lower-case hex, as checkpoints and configs spell it
        self.pin_bytes = bytes.fromhex(pin)  # as streams carry it
        self.predictor = predictor
        self.config = config or CodecConfig()
        self.model_id = self._encode_model(self.config.model)
        self._bf16_tables: dict[int, ContextTable] = {}  # by model id, built on first use
        self.backend = select_backend(self.config.coder, self.config.threads)  # None: the numpy reference

    def _encode_model(self, name: str) -> int:
        if name == "auto":
            return max(self.models)
        if MODEL_NAMES[name] not in self.models:
            raise ValueError(f"this checkpoint has no {name!r} residual model (rebuild it)")
        return MODEL_NAMES[name]

    @property
    def bf16_contexts(self) -> ContextTable:
        """The BF16 context table of the model this codec encodes with."""
        return self._bf16_table(self.models[self.model_id])

    def warm(self) -> None:
        """Build before serving what this codec's path will need: the numpy reference's BF16
        context table (tens of MB; the native and CUDA backends compute each context in place
        and never build it)."""
        if self.backend is None:
            self.bf16_contexts  # noqa: B018

    def _bf16_table(self, model: ResidualModel) -> ContextTable:
        """The BF16 context table of ``model``'s sigma (shared per process, kept per codec)."""
        if model.model_id not in self._bf16_tables:
            self._bf16_tables[model.model_id] = bf16_context_table(model.log2_sigma)
        return self._bf16_tables[model.model_id]

    @classmethod
    def from_checkpoint(cls, ck: CheckpointLike, config: CodecConfig | None = None,
                        predictor: "MuSource | None" = None, pin: str | None = None) -> "Codec":
        """A codec with every residual model of ``ck`` (``pin``: override, for tests)."""
        return cls(ck.seed_tables, ck.calib.sigma_log2_q, pin or ck.pin, predictor, config, models_of(ck))

    @classmethod
    def from_predictor(cls, predictor: MuSource, config: CodecConfig | None = None) -> "Codec":
        return cls.from_checkpoint(predictor.checkpoint, config, predictor)

    # -- encode -------------------------------------------------------------
    def encode(self, kv: "torch.Tensor | Fp8KV", ids: np.ndarray,
               mu: "torch.Tensor | None" = None) -> Iterator[bytes]:
        """Header record, then one record per chunk (a chunk larger coded than stored is stored),
        coded ``GROUP_ELEMENTS`` at a time (``encode_chunks``: the same bytes as one pass)."""
        mu_bits = bf16_bits(self._predicted(ids) if mu is None else mu)
        x, scales = (kv.codes, np.asarray(kv.scales)) if isinstance(kv, Fp8KV) else (bf16_bits(kv), None)
        header = self.stream_header(scales is None, mu_bits.shape, ids)
        yield ct.pack_header(header)
        every = range(header.n_chunks)
        groups = element_groups(header, every, GROUP_ELEMENTS)

        ahead, backend, hold = self._helper_backend()

        ahead = runs_ahead(ahead, len(groups))  # NOTE: else the digest thread overlaps the pass (Ahead)

        def prepare(g: slice) -> Prepared:  # NOTE: ahead, the digests too, on the core the helper holds
            a, b = header.chunk_layers(every[g][0])[0], sum(header.chunk_layers(every[g][-1]))
            p = self._prepare(header, every[g], x[a:b], mu_bits, None if scales is None else scales[a:b],
                              backend=backend)
            return p if p.plan is None or not ahead else dataclasses.replace(
                p, sums=[chunk_sums(p.plan, header, i) for i in p.coded])

        with Lookahead(prepare, groups, ahead, hold) as prepared:
            for g, p in zip(groups, prepared, strict=True):
                for chunk in self._code(p, header, every[g]):
                    yield ct.pack_chunk(chunk)

    def stream_header(self, bf16: bool, shape: Sequence[int], ids: np.ndarray,
                      layers_per_chunk: int | None = None, stored: bool = False) -> ct.StreamHeader:
        """The header of a stream this codec writes (``stored``: not entropy-coded)."""
        shape = tuple(int(s) for s in shape)
        lpc = layers_per_chunk or self.config.layers_per_chunk
        return ct.StreamHeader(
            dtype=ct.DTYPE_BF16 if bf16 else ct.DTYPE_FP8,
            model=ct.MODEL_STORED if stored else self.model_id,
            pin=self.pin_bytes, shape=cast("tuple[int, int, int, int, int]", shape),  # length checked there
            prompt_digest=prompt_digest(ids),
            elems_per_lane=self.config.elems_per_lane, layers_per_chunk=min(lpc, max(shape[0], 1)))

    def encode_chunk(self, h: ct.StreamHeader, i: int, x: np.ndarray, mu: "torch.Tensor | np.ndarray | None",
                     scales: np.ndarray | None = None) -> ct.Chunk:
        """Code chunk ``i`` alone (streaming): ``x`` holds only its layers' bit patterns
        ``(layer_count, 2, heads, tokens, dim)`` (uint16 BF16 / uint8 e4m3), ``scales``
        their ``(layer_count, 2)`` FP8 scales; ``mu`` is the whole stream's (None when stored)."""
        return self.encode_chunks(h, range(i, i + 1), x, mu, scales)[0]

    def encode_chunks(self, h: ct.StreamHeader, idx: range, x: np.ndarray,
                      mu: "torch.Tensor | np.ndarray | None", scales: np.ndarray | None = None,
                      stored: Collection[int] = ()) -> list[ct.Chunk]:
        """Code consecutive chunks ``idx`` (a streaming encoder batches whatever is ready); ``x``
        and ``scales`` hold exactly their layers. Chunks of ``idx`` in ``stored`` (every chunk of a
        stored stream) are written stored, never coded: their mu is not read, and ``mu`` may be
        None when no chunk is coded. A coded chunk larger than its stored form goes stored too."""
        return self._code(self._prepare(h, idx, x, mu, scales, stored), h, idx)

    def _prepare(self, h: ct.StreamHeader, idx: range, x: np.ndarray, mu: "torch.Tensor | np.ndarray | None",
                 scales: np.ndarray | None = None, stored: Collection[int] = (), backend: Any = None) -> Prepared:
        """``encode_chunks`` up to the rANS pass: the stored chunks written, the coded ones' plan
        built and adapted (``_code`` codes it) on ``backend`` (default: the codec's)."""
        backend = self.backend if backend is None else backend
        start = h.chunk_layers(idx[0])[0]
        keep = stored_of(h, idx, x, scales, stored)
        out = stored_chunks(h, sorted(keep), x, scales, start)
        coded = [i for i in idx if i not in keep]
        if not coded:
            return Prepared(out, coded, None)
        if mu is None:
            raise ValueError(f"chunks {coded} are coded: they need mu")
        part = slice(h.chunk_layers(coded[0])[0] - start, sum(h.chunk_layers(coded[-1])) - start)
        kv = Fp8KV(x[part], scales[part]) if scales is not None and h.dtype == ct.DTYPE_FP8 else x[part]
        plan = self._plan(kv, None, mu, layers=slice(part.start + start, part.stop + start), model_id=h.model,
                          backend=backend)
        return Prepared(out, coded, adapted_plan(plan, h, backend))

    def _code(self, p: Prepared, h: ct.StreamHeader, idx: range) -> list[ct.Chunk]:
        """The chunks of a ``_prepare``: its plan coded, in ``idx``'s order."""
        if p.plan is not None:
            p.out.update((c.index, c) for c in self._encode_chunks(p.plan, h, p.coded, p.sums))
        return [p.out[i] for i in idx]

    def _encode_chunks(self, plan: Plan, h: ct.StreamHeader, idx: Sequence[int],
                       summed: list[Sums] | None = None) -> list[ct.Chunk]:
        """Chunks ``idx`` coded in one vectorised rANS pass (blocks never span chunks; a backend
        codes each run of consecutive chunks in one pass); ``summed``: their digests, if known."""
        if not idx:
            return []
        if self.backend is not None:  # the same bytes (tests/coder/test_native.py)
            assert plan.x is not None  # an encoding plan
            with Ahead(self.config.threads, [] if summed else [partial(chunk_sums, plan, h, i) for i in idx]) as sums:
                coded = []  # NOTE: the digests run meanwhile, cancelled if this raises
                for run in (idx[r] for r in runs(idx)):
                    sl = slice(plan.chunk_slice(h, run[0]).start, plan.chunk_slice(h, run[-1]).stop)
                    coded += self.backend.encode(plan.x[sl], plan.mu[sl], plan.log2_sigma[sl], [h.chunk_layers(i)[1]
                                                 for i in run], h.elems_per_lane, plan.model.tables)
            return self._map(lambda a: self._chunk_record(plan, h, a[0], a[1].blocks, a[1].bits, a[2]),
                             list(zip(idx, coded, summed or sums.result(), strict=True)))
        coded_np = reference.encode_chunks(plan, h, idx, self._context, self.config.threads)
        summed = summed or [chunk_sums(plan, h, i) for i in idx]
        return [self._chunk_record(plan, h, i, rb, bits, s)
                for i, (rb, bits), s in zip(idx, coded_np, summed, strict=True)]

    def _helper_backend(self) -> tuple[bool, Any, Any]:
        """(ahead, the backend a lookahead helper prepares with, the ``hold`` it takes a core with).
        NOTE: group g + 1 is prepared on a helper thread while g is coded (``lookahead.py``), its
        native calls on one thread: with the rANS pass holding the extension's pool, they would
        start threads of their own at each call (measured: slower than preparing in series). Not on
        the CUDA coder, whose device work stays on the caller's thread."""
        ahead = self.config.threads > 1 and hasattr(self.backend, "with_threads")
        if not ahead:
            return False, self.backend, None
        return True, self.backend.with_threads(1), self.backend.hold_core

    def _map(self, fn, items):
        return reference.thread_map(self.config.threads, fn, items)

    def _chunk_record(self, plan: Plan, h: ct.StreamHeader, i: int, rb: RansBlocks,
                      bits: bytes, sums: Sums) -> ct.Chunk:
        sl, blocks = plan.chunk_slice(h, i), h.chunk_blocks(i) > 0  # NOTE: rb's blocks, as chunk_sums assumes
        assert plan.x is not None and blocks == (len(rb.word_counts) > 0)  # an encoding plan
        mu_fingerprint, raw_digest = sums
        start, count = h.chunk_layers(i)
        c = ct.Chunk(index=i, layer_start=start, layer_count=count, steps=h.elems_per_lane if blocks else 0,
                     mu_fingerprint=mu_fingerprint, raw_digest=raw_digest, aux=plan.aux(sl, blocks=blocks),
                     states=rb.states, word_counts=rb.word_counts, words=rb.words, bits=bits,
                     borrowed=self.backend is not None)  # NOTE: a backend's words: a view of its own bytes,
        # not copied (~1.2 MB a chunk); the reference's are views of one array for the whole pass
        if h.version >= 3 and c.record_len > stored_record_len(h, i):  # the size guard (FORMAT.md)
            return stored_chunk(h, i, plan.x[sl], None if plan.scales is None else plan.scales[sl])
        return c

    def _predicted(self, ids: np.ndarray) -> "torch.Tensor | np.ndarray":
        if self.predictor is None:
            raise ValueError("no mu given and no predictor to compute it")
        return self.predictor.mu(np.asarray(ids))

    def _plan(self, kv, ids, mu, fmt: FloatFormat | None = None, scales=None,
              layers: slice | None = None, model_id: int | None = None, backend: Any = None) -> Plan:
        """``plan.build_plan`` under ``model_id`` (default: the one this codec encodes with);
        mu from ``ids`` when None."""
        mu = self._predicted(ids) if mu is None else mu
        # NOTE: uint16 bits stay as given, a view too (a rank's heads): build_plan copies only its layers
        mu = mu if isinstance(mu, np.ndarray) and mu.dtype == np.uint16 else bf16_bits(mu)
        model = self.models[self.model_id if model_id is None else model_id]
        return build_plan(model, self.backend if backend is None else backend, kv, mu, fmt, scales, layers)

    # -- decode -------------------------------------------------------------
    def decode(self, records: Iterable[bytes], ids: np.ndarray,
               mu: "torch.Tensor | None" = None) -> "np.ndarray | Fp8KV":
        """KV bits (uint16 for BF16) or Fp8KV, verified; NOTE: chunks read ``records`` in place until this returns."""
        it = iter(records)
        first = next(it, None)
        if first is None:
            raise ct.TruncatedError("empty stream: no header record")
        header = whole_record(first, ct.unpack_header(first))
        self._check_header(header, ids)
        chunks = [whole_record(r, ct.unpack_chunk(r, header, borrow=True)) for r in it]
        return self.decode_chunks(header, chunks, ids, mu)

    def _check_header(self, h: ct.StreamHeader, ids: np.ndarray) -> None:
        check_header(h, ids, self.pin, sorted(self.models), self.log2_sigma.shape)

    def decode_chunks(self, h: ct.StreamHeader, chunks: Sequence[ct.Chunk], ids: np.ndarray,
                      mu: "torch.Tensor | None" = None) -> "np.ndarray | Fp8KV":
        """Decode a whole stream's chunks (all of them, in index order)."""
        if [c.index for c in chunks] != list(range(h.n_chunks)):
            raise IntegrityError(f"stream has chunks {[c.index for c in chunks]}, "
                                 f"expected 0..{h.n_chunks - 1}")
        scales = chunk_scales(h, chunks) if h.dtype == ct.DTYPE_FP8 else None
        out = self._decode_layers(h, chunks, ids, mu)
        return out if scales is None else Fp8KV(out, scales)  # scales: FP8 streams only

    def decode_chunk(self, h: ct.StreamHeader, c: ct.Chunk,
                     mu: "torch.Tensor | np.ndarray | None") -> np.ndarray:
        """Decode one chunk alone (streaming) and verify it: its layers' bit patterns
        ``(layer_count, 2, heads, tokens, dim)``. ``h`` must have passed the header checks
        (``check_header``); ``mu`` is the whole stream's (None when stored)."""
        return self.decode_run(h, [c], mu)

    def decode_run(self, h: ct.StreamHeader, chunks: Sequence[ct.Chunk],
                   mu: "torch.Tensor | np.ndarray | None") -> np.ndarray:
        """Decode and verify consecutive chunks in one pass (a streaming decoder batches
        whatever has arrived): the bit patterns of their layers, in order. ``mu`` is the
        whole stream's; None when every chunk is stored (``ct.is_stored_chunk``)."""
        if [c.index for c in chunks] != list(range(chunks[0].index, chunks[0].index + len(chunks))):
            raise IntegrityError(f"chunks {[c.index for c in chunks]} are not consecutive")
        return self._decode_layers(h, chunks, None, mu)

    def _decode_layers(self, h: ct.StreamHeader, chunks: Sequence[ct.Chunk], ids: np.ndarray | None,
                       mu: "torch.Tensor | np.ndarray | None") -> np.ndarray:
        """The verified layers of consecutive chunks (mu from ``ids`` when None), into one array,
        each group of at most ``GROUP_ELEMENTS`` elements decoded in one pass."""
        if mu is None and ids is not None and not all(ct.is_stored_chunk(h, c) for c in chunks):
            mu = self._predicted(ids)
        groups = element_groups(h, [c.index for c in chunks], GROUP_ELEMENTS)
        ahead, backend, hold = self._helper_backend()  # group g + 1's plan and mu check while g decodes
        out, at = None, 0
        prepare = partial(self._decode_prepare, h, mu=mu, backend=backend, serial=ahead)
        with Lookahead(lambda g: prepare(chunks[g]), groups, ahead, hold) as prepared:
            for g, p in zip(groups, prepared, strict=True):
                for part in self._decode_group(h, chunks[g], p):  # each chunk's layers, copied once
                    if out is None:  # NOTE: not before a group has checked the header's shape against real bytes
                        out = np.empty((sum(c.layer_count for c in chunks),) + part.shape[1:], part.dtype)
                    out[at:at + len(part)], at = part, at + len(part)
        empty = (0,) + h.shape[1:]
        return out if out is not None else np.empty(empty, np.uint16 if h.dtype == ct.DTYPE_BF16 else np.uint8)

    def _decode_prepare(self, h: ct.StreamHeader, chunks: Sequence[ct.Chunk], mu: "torch.Tensor | np.ndarray | None",
                        backend: Any, serial: bool) -> Unpacked:
        """A group before its rANS pass (``serial``: its mu check on this thread alone)."""
        out = {c.index: unstored_chunk(h, c) for c in chunks if ct.is_stored_chunk(h, c)}
        coded = [c for c in chunks if c.index not in out]
        if not coded:
            return Unpacked(out, coded, None)
        if mu is None:
            raise ValueError(f"chunks {[c.index for c in coded]} are coded: decoding them needs mu")
        fmt = BF16 if h.dtype == ct.DTYPE_BF16 else E4M3
        span = [c for c in chunks if coded[0].index <= c.index <= coded[-1].index]
        scales = chunk_scales(h, span) if fmt is E4M3 else None
        shifts = chunk_shifts(h, span)  # checked before anything is decoded
        layers = slice(h.chunk_layers(coded[0].index)[0], sum(h.chunk_layers(coded[-1].index)))
        plan = self._plan(None, None, mu, fmt, scales, layers=layers, model_id=h.model, backend=backend)
        if fmt is E4M3 and h.version >= 5:
            plan = plan.rounded(chunk_rounding(h, span))
        if shifts is not None:
            plan = plan.shifted(shifts)
        check_mu(plan, h, coded, 1 if serial else self.config.threads)
        return Unpacked(out, coded, plan)

    def _decode_group(self, h: ct.StreamHeader, chunks: Sequence[ct.Chunk], p: Unpacked) -> list[np.ndarray]:
        """Each chunk's layers: stored chunks from their raw bytes, the coded ones (``p``, from
        ``_decode_prepare``) decoded in one pass and verified."""
        if p.plan is not None:
            bits = verified_all(h, p.coded, self._decode_batch(p.plan, h, p.coded), self.config.threads)
            p.out.update(zip([c.index for c in p.coded], bits, strict=True))
        return [p.out[c.index] for c in chunks]

    check_header = _check_header  # public name for streaming decoders

    def _decode_batch(self, plan: Plan, h: ct.StreamHeader, chunks: Sequence[ct.Chunk]) -> list[np.ndarray]:
        """Bit patterns of each chunk's elements; all live chunks in one rANS pass."""
        el = h.elems_per_lane
        live = [c for c in chunks if c.n_blocks]
        for c in live:
            if c.steps != el:
                raise IntegrityError(f"chunk {c.index}: {c.steps} steps, expected {el}")
        for c in chunks:
            if not c.n_blocks and c.bits:
                raise IntegrityError(f"chunk {c.index}: raw bits without elements")
        if self.backend is not None and live:
            return [b for r in runs([c.index for c in chunks]) for b in self._decode_backend(plan, h, chunks[r])]
        bits = reference.decode_chunks(plan, h, live, self._context, self.config.threads)
        out = {c.index: b for c, b in zip(live, bits, strict=True)}
        return [out.get(c.index, np.zeros(0, np.int64)) for c in chunks]

    def _decode_backend(self, plan: Plan, h: ct.StreamHeader, chunks: Sequence[ct.Chunk]) -> list[np.ndarray]:
        """The backend decodes consecutive chunks (all live) into one array; per-chunk views."""
        sl = slice(plan.chunk_slice(h, chunks[0].index).start, plan.chunk_slice(h, chunks[-1].index).stop)
        out = np.empty(plan.mu[sl].shape, np.uint16 if plan.fmt is BF16 else np.uint8)
        streams = [(RansBlocks(c.states, c.word_counts, c.words), c.bits) for c in chunks]
        self.backend.decode(plan.mu[sl], plan.log2_sigma[sl], [c.layer_count for c in chunks], h.elems_per_lane,
                            streams, plan.model.tables, out)
        return [out[plan.chunk_slice(h, c.index).start - sl.start:][:c.layer_count] for c in chunks]

    def _context(self, plan: Plan, sl: slice) -> Context:
        if plan.fmt is BF16 and plan.unshifted(sl):  # NOTE: shifted levels: computed, not tabulated
            table = self._bf16_table(plan.model)
            ab = slice(sl.start + plan.layer0, sl.stop + plan.layer0)  # level_index holds all layers
            lidx = table.level_index[ab][:, :, :, None, :]  # (n, 2, heads, 1, dim)
            return table.lookup(plan.mu[sl], lidx)
        return plan_context(plan, sl)


__all__ = ["Codec", "CodecConfig", "Fp8KV", "bf16_bits", "digest", "prompt_digest", "DIGEST_BYTES",
           "stored_chunk", "unstored_chunk", "concat_blocks", "split_blocks", "MAX_ELEMS_PER_LANE"]
