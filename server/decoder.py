"""The decoder sidecar: receives compressed transfers, rebuilds the KV bit for
bit, hands it to the local decode engine layer by layer.

Lifecycle of one Transfer call: the header is validated (model, shape, pin,
prompt digest) and a :class:`DecoderTransfer` registered; the predictor starts
on the prompt at once; each chunk record is reassembled from its parts (its
size reserved from the byte budget first), acknowledged, and queued to a
decode task that verifies and publishes its layers (raw bytes reserved
first). FetchKV takes the layers as they appear and gives their bytes back.
When the budget is spent, reading stops: backpressure to the encoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator

import grpc
import numpy as np

from speckv import frames, logs
from speckv.coder import container as ct
from speckv.coder.heads import head_codec, slice_heads
from speckv.coder.plan import chunk_aux
from speckv.coder.stored import unstored_chunk
from speckv.digests import algorithm_of
from speckv.errors import RpcError, TransferDigestError
from speckv.heap import trimmed_beside_pass
from speckv.kv import HeadRange, some_heads
from speckv.status import abort, in_band, integrity_kind, outcome, to_status
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import decoder_pb2_grpc as dgrpc
from speckv.wire import RecordAssembler, dtype_of, fp8_attention_of, heads_of, layer_bytes, shape_of

from . import tracing
from .aio import batch_limit, drain_batch, drain_requests, peer_host
from .auth import authorize, parse_allow
from .budget import ByteBudget
from .config import ServerConfig
from .fetch import FetchService
from .inbox import await_or_fail, events, mu_checks
from .layer_mu import LayerMu
from .local_socket import parse_uids
from .mailbox import Mailboxes
from .metrics import Metrics
from .mu_cache import MuCache
from .runtime import Runtime
from .transfers import DecoderTransfer, S, TransferTable, check_request_id

logger = logging.getLogger(__name__)


class DecoderService(FetchService, dgrpc.DecoderServiceServicer):
    def __init__(self, config: ServerConfig, runtime: Runtime, metrics: Metrics, budget: ByteBudget) -> None:
        self.config, self.rt, self.metrics, self.budget = config, runtime, metrics, budget
        self.table = TransferTable(config.max_transfers, config.lease_s)
        self._fallback_peers: set[str] = set()
        self.allow = parse_allow(config.allow)
        self.mu_cache = MuCache(config.mu_cache_bytes)
        self.mailboxes = None if config.local_socket is None else Mailboxes(
            config.local_socket, parse_uids(config.local_uids))  # local fetches (server/mailbox.py)

    async def close(self) -> None:
        if self.mailboxes is not None:
            self.mailboxes.stop()

    # -- Transfer -----------------------------------------------------------
    async def Transfer(self, request_iterator: AsyncIterator[dpb.TransferRequest],
                       context: grpc.aio.ServicerContext) -> AsyncIterator[dpb.TransferResponse]:
        logs.bind(peer=context.peer() or "?")  # NOTE: on every line of this call, its failure included
        await authorize(context, "Transfer", self.allow)
        t0 = time.perf_counter()
        it = request_iterator.__aiter__()
        t: DecoderTransfer | None = None
        labels = ("?", "?")
        span = tracing.start("speckv.decoder.Transfer", context)
        try:
            first = await anext(it, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "the first message must carry the TransferHeader")
            logs.bind(request_id=first.header.request_id or None)
            tracing.annotate(span, request_id=first.header.request_id)
            h, ids, labels, heads = self._check_header(first.header)
            fp8_attention = fp8_attention_of(first.header.fp8_attention, h.shape[0], first.header.dtype)
            t = DecoderTransfer(first.header.request_id, h.shape[0], h.n_chunks, self.budget.holding(),
                                algorithm_of(h.version), h.shape[2], heads)
            t.prompt, t.tokens = h.prompt_digest, h.shape[3]
            t.codec = self.rt.codec if first.header.model_id != self.rt.model_id else head_codec(self.rt.codec, heads)
            t.layer_bytes = layer_bytes(h.shape, dtype_of_header(h))
            t.peer = context.peer() or "?"
            t.model_id = first.header.model_id
            t.fp8_attention = fp8_attention
            self._check_peer(t.peer)
            await self.table.add(t)
            self._gauges()
            t.wire_bytes = ct.HEADER_LEN
            self.metrics.header(*labels, ct.HEADER_LEN)
            async for ack in self._receive(t, h, ids, it, labels):
                yield ack
            yield dpb.TransferResponse(result=dpb.TransferResult(
                status=pb.Status(code=pb.STATUS_CODE_OK), raw_bytes=t.raw_bytes, wire_bytes=t.wire_bytes,
                chunks=t.chunks_received, predictor_seconds=t.predictor_s, decode_seconds=t.decode_s,
                total_seconds=time.perf_counter() - t0, encoding=t.encoding, fallback=t.fallback,
                stored_chunks=t.stored_chunks, mu_wait_seconds=t.mu_wait_s))
            labels = (labels[0], t.encoding)
            self.metrics.finished("ok", *labels, scalars=t.raw_bytes // dtype_of(h.dtype)[1].itemsize,
                                  wire=t.wire_bytes, fallback_reasons=t.stored_reasons)
            self.metrics.seconds("transfer", time.perf_counter() - t0)
            logger.debug("transfer %s received: %d raw bytes in %d wire bytes (%s), %.3f s", t.request_id,
                         t.raw_bytes, t.wire_bytes, t.encoding, time.perf_counter() - t0)
            tracing.end(span, raw_bytes=t.raw_bytes, wire_bytes=t.wire_bytes, chunks=t.chunks_received,
                        encoding=t.encoding, fallback=t.fallback, predictor_seconds=t.predictor_s,
                        decode_seconds=t.decode_s, mu_wait_seconds=t.mu_wait_s)
        except BaseException as e:  # noqa: BLE001 -- CancelledError too: the transfer must end
            code, msg = to_status(e)
            tracing.end(span, code, msg)
            kind = integrity_kind(e)
            if kind:
                self.metrics.integrity(kind)
            if t is not None:
                await t.end(S.TRANSFER_STATE_CANCELLED if code == grpc.StatusCode.CANCELLED
                            else S.TRANSFER_STATE_FAILED, e)
            self.metrics.finished(outcome(code))
            logger.warning("transfer %s failed: %s %s", logs.bound().get("request_id", "?"), code.name, msg,
                           extra={"code": code.name})
            if isinstance(e, (asyncio.CancelledError, GeneratorExit)):  # the call itself is gone
                raise
            # NOTE: the verdict goes in-band first, then the sender's in-flight messages are
            # drained: a peer still writing when the call ends would see a transport error
            # (INTERNAL) instead of this status
            with contextlib.suppress(Exception):
                yield dpb.TransferResponse(result=dpb.TransferResult(status=in_band(e)))
                await asyncio.wait_for(drain_requests(it), DRAIN_S)
            await abort(context, e)
        finally:
            self._gauges()

    def _check_peer(self, peer: str) -> None:
        host = peer_host(peer)
        n = sum(1 for x in self.table.live() if peer_host(x.peer) == host)
        if n >= self.config.max_transfers_per_peer:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{n} transfers from {host} in progress (max_transfers_per_peer)", reason="PEER_LIMIT")

    def _check_header(self, hdr: dpb.TransferHeader,
                      ) -> tuple[ct.StreamHeader, np.ndarray, tuple[str, str], HeadRange | None]:
        check_request_id(hdr.request_id)
        name, _ = dtype_of(hdr.dtype)
        shape = shape_of(hdr.shape)
        ids = np.asarray(hdr.prompt_token_ids, np.int64)
        heads = heads_of(hdr.heads, shape[2])
        foreign = hdr.model_id != self.rt.model_id  # NOTE: only a stored stream of it is taken (Runtime.check)
        if not foreign:  # the request's own faults first, before its header record's
            self.rt.check(hdr.model_id, shape, ids, self.config.max_tokens, heads=heads)
        h, used = ct.unpack_header(hdr.header_record)
        if used != len(hdr.header_record):
            raise ct.FormatError("header_record has trailing bytes")
        if foreign:
            self.rt.check(hdr.model_id, shape, ids, self.config.max_tokens, stored=h.model == ct.MODEL_STORED)
        if h.shape != shape or h.dtype != (ct.DTYPE_BF16 if name == "bf16" else ct.DTYPE_FP8):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "header_record disagrees with the header's dtype/shape")
        if h.model != ct.MODEL_STORED and hdr.predictor_pin != h.pin:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "predictor_pin disagrees with the header record's pin")
        heads = some_heads(heads)  # all heads, named: the same transfer
        codec = self.rt.codec if foreign else head_codec(self.rt.codec, heads)
        codec.check_header(h, ids)  # NOTE: the one pin check (PinMismatchError: PIN_MISMATCH)
        return h, ids, (name, "stored" if h.model == ct.MODEL_STORED else "speckv"), heads

    async def _receive(self, t: DecoderTransfer, h: ct.StreamHeader, ids: np.ndarray, it: AsyncIterator,
                       labels: tuple[str, str]) -> AsyncIterator[dpb.TransferResponse]:
        """Read the chunk parts, ack each record, and decode them in a task alongside; for a
        speckv stream, run the predictor and send each chunk's PredictorCheck as soon as its
        layers' mu exists (the encoder codes that chunk under the predictor only if it matches)."""
        queue: asyncio.Queue[tuple[ct.Chunk, int] | None] = asyncio.Queue()
        mu, t.mu_hit = (None, False) if h.model == ct.MODEL_STORED else self.mu_cache.take(self.rt, ids,
                                                                                         t.fp8_attention)
        if mu is not None:
            self.metrics.mu_cache(t.mu_hit)
        t.encoding, t.mu = labels[1], mu
        worker = asyncio.ensure_future(self._decode_loop(t, h, mu, queue, labels))
        asm = RecordAssembler(h.n_chunks, min(ct.MAX_CHUNK_BYTES, self.budget.limit))
        trailer = None
        try:
            inbox = contextlib.aclosing(events(it, None if mu is None else mu_checks(h, mu), worker, t))
            async with inbox as reqs:  # NOTE: closed here, before give_back(mu) below, never left to the GC
                async for req in reqs:
                    if isinstance(req, dpb.TransferResponse):  # this side's PredictorCheck
                        yield req
                        continue
                    if trailer is not None:
                        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "nothing may follow the TransferTrailer")
                    if req.WhichOneof("kind") == "trailer":
                        if asm.next_index != h.n_chunks or asm.pending:
                            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                           f"trailer after {asm.next_index} of {h.n_chunks} chunk records")
                        trailer = req.trailer
                        continue
                    chunk = await self._chunk_part(t, h, asm, req, worker)
                    if chunk is None:
                        continue
                    t.chunks_received += 1
                    t.wire_bytes += chunk.record_len
                    queue.put_nowait((chunk, chunk.record_len))
                    yield dpb.TransferResponse(chunk_ack=dpb.ChunkAck(index=chunk.index, bytes_received=t.wire_bytes))
            await self._finish(t, h, asm, trailer, queue, worker, mu)
        finally:
            t.mu = None  # NOTE: the transfer lives on until fetched; its mu must not
            if mu is not None:
                self.mu_cache.give_back(mu)  # NOTE: a pass no transfer needs stops at its next layer
            if not worker.done():
                worker.cancel()
            elif not worker.cancelled():
                worker.exception()  # retrieved: the handler already reports why it ended

    async def _finish(self, t: DecoderTransfer, h: ct.StreamHeader, asm: RecordAssembler,
                      trailer: dpb.TransferTrailer | None, queue: asyncio.Queue, worker: asyncio.Future,
                      mu: LayerMu | None) -> None:
        """The sender half-closed: every chunk and the trailer came, every chunk decodes, and
        the whole-transfer digest matches; then the transfer is READY."""
        if asm.next_index != h.n_chunks or asm.pending:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"stream ended after {asm.next_index} of {h.n_chunks} chunk records")
        if trailer is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "stream ended without its TransferTrailer")
        queue.put_nowait(None)
        await await_or_fail(asyncio.shield(worker), None, t)
        # NOTE: every chunk passed its own digest; this one binds them into the whole KV
        if (t.digest.digest(), t.digest.raw_bytes) != (bytes(trailer.raw_digest), trailer.raw_bytes):
            raise TransferDigestError(f"transfer {t.request_id!r}: whole-transfer digest does not match "
                                      f"({t.digest.raw_bytes} raw bytes decoded, {trailer.raw_bytes} sent)")
        t.verified = t.digest.digest()
        if mu is not None and mu.count == h.shape[0] and not t.mu_hit:
            t.predictor_s = await mu.done()  # a cached pass cost this transfer nothing
            self.metrics.seconds("predictor", t.predictor_s)
            self.metrics.seconds("mu_wait", t.mu_wait_s)
        await t.end(S.TRANSFER_STATE_READY)

    async def _chunk_part(self, t: DecoderTransfer, h: ct.StreamHeader, asm: RecordAssembler,
                          req: dpb.TransferRequest, worker: asyncio.Future) -> ct.Chunk | None:
        """Add one chunk part; the whole chunk once its record is complete, else None."""
        kind = req.WhichOneof("kind")
        if kind != "chunk":
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "only chunk messages may follow the header"
                           + (" (Fallback is retired: format 3 falls back per chunk)" if kind == "fallback" else ""))
        size = asm.first_part_size(req.chunk)
        if size is not None:
            # NOTE: the record AND its decoded layers are reserved up front, so a queued
            # chunk never waits for memory that only a later chunk could free (deadlock)
            raw = layer_bytes(h.shape, dtype_of_header(h)) * h.chunk_layers(req.chunk.index)[1]
            t.stored_reason = req.chunk.stored_reason
            await await_or_fail(t.holding.acquire(size + raw), worker, t)
        rec = asm.add(req.chunk, frames.payload_of(req))  # NOTE: the payload: a view of the bytes received
        if rec is None:
            return None
        chunk = _whole(rec, h, asm.next_index - 1)
        self._count_stored(t, h, chunk, t.stored_reason)
        return chunk

    def _count_stored(self, t: DecoderTransfer, h: ct.StreamHeader, c: ct.Chunk, reason: str) -> None:
        """A speckv stream's stored chunk: counted by the reason its first part gave."""
        stored = h.model != ct.MODEL_STORED and ct.is_stored_chunk(h, c)
        if stored != bool(reason):
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"chunk {c.index}: stored_reason {reason!r} on a {'stored' if stored else 'coded'} chunk")
        if not stored:
            return
        t.stored_chunks += 1
        t.stored_reasons.add(reason)
        self.metrics.fallback(reason)
        if reason == "mu_mismatch":
            t.fallback = True
            host = peer_host(t.peer)
            if host not in self._fallback_peers:  # NOTE: logged once per peer, counted every time
                self._fallback_peers.add(host)
                here = "" if t.mu is None else "; here " + t.mu.describe(c.layer_start, c.layer_start + c.layer_count)
                logger.warning("transfer %s from %s: chunk %d came stored, the predictors disagree on its mu "
                               "(predictor pin %s)%s", t.request_id, t.peer, c.index, self.rt.pin[:12], here)

    async def _decode_loop(self, t: DecoderTransfer, h: ct.StreamHeader, mu: LayerMu | None,
                           queue: asyncio.Queue, labels: tuple[str, str]) -> None:
        """Decode queued chunks; whatever has queued up (``BATCH_BYTES`` at most) in one vectorised pass."""
        lb = layer_bytes(h.shape, dtype_of_header(h))
        while batch := await drain_batch(queue, batch_limit(lb * h.layers_per_chunk)):
            chunks = [c for c, _ in batch]
            for (c, wire), bits in zip(batch, await self._decode(t, h, mu, chunks), strict=True):
                raw = lb * c.layer_count  # reserved with the record; FetchKV releases it per layer
                t.holding.release(wire)
                scales = chunk_aux(h, c)[0]  # FP8 scales (aux also holds a chunk's rounding byte and sigma shifts)
                await t.publish(c.layer_start, bits, scales)
                t.raw_bytes += raw
                self.metrics.chunk(*labels, raw, wire, ct.HEADER_LEN if c.index == 0 else 0)
        self.metrics.seconds("decode", t.decode_s)

    async def _decode(self, t: DecoderTransfer, h: ct.StreamHeader, mu: LayerMu | None,
                      chunks: list[ct.Chunk]) -> list[np.ndarray]:
        """Each chunk's verified layers. Stored chunks alone: each verified where it lies
        (read-only views of the records, which live on with the layers), on the loop."""
        coded = [c for c in chunks if not ct.is_stored_chunk(h, c)]
        d0 = time.perf_counter()
        if not coded:
            out = [unstored_chunk(h, c) for c in chunks]
            t.decode_s += time.perf_counter() - d0
            return out
        # NOTE: only coded chunks need mu, and only their own layers' (no whole-mu gate)
        mu_bits = None if mu is None else await mu.upto(coded[-1].layer_start + coded[-1].layer_count)
        t.mu_wait_s += time.perf_counter() - d0
        d0 = time.perf_counter()
        bits = await asyncio.to_thread(_decode_run, t.codec, h, chunks, slice_heads(mu_bits, t.heads))
        t.decode_s += time.perf_counter() - d0
        first = chunks[0].layer_start
        return [bits[c.layer_start - first:c.layer_start - first + c.layer_count] for c in chunks]

    # -- status and cancel ----------------------------------------------------
    async def GetTransferStatus(self, request: dpb.GetTransferStatusRequest,
                                context: grpc.aio.ServicerContext) -> dpb.GetTransferStatusResponse:
        logs.bind(request_id=request.request_id or None, peer=context.peer() or "?")
        await authorize(context, "GetTransferStatus", self.allow)
        try:
            return dpb.GetTransferStatusResponse(status=self.table.get(request.request_id,
                                                                       heads_of(request.heads)).status())
        except RpcError as e:
            await abort(context, e)

    async def CancelTransfer(self, request: dpb.CancelTransferRequest,
                             context: grpc.aio.ServicerContext) -> dpb.CancelTransferResponse:
        logs.bind(request_id=request.request_id or None, peer=context.peer() or "?")
        await authorize(context, "CancelTransfer", self.allow)
        try:  # NOTE: no heads named: every range of the request
            heads = heads_of(request.heads)
            found = [self.table.get(request.request_id, heads)] if heads else self.table.parts(request.request_id)
            if not found:
                self.table.get(request.request_id)  # NOT_FOUND
        except RpcError as e:
            await abort(context, e)
        for t in found:
            if t.live:
                logger.info("transfer %s cancelled by CancelTransfer", t.request_id)
                # NOTE: ending it wakes its Transfer handler, which reports CANCELLED to the sender
                await t.end(S.TRANSFER_STATE_CANCELLED,
                            RpcError(grpc.StatusCode.CANCELLED, "cancelled by CancelTransfer"))
        self._gauges()
        return dpb.CancelTransferResponse(status=found[0].status())

    def _gauges(self) -> None:
        self.metrics.gauges(len(self.table), self.budget.used, self.budget.limit)


DRAIN_S = 2.0  # after a failure, how long the rest of the sender's messages are read and dropped


def _decode_run(codec: Any, h: ct.StreamHeader, chunks: list[ct.Chunk], mu: Any) -> np.ndarray:
    """``codec.decode_run`` on a worker thread, whose arena then gives its freed scratch back when a
    predictor pass ran beside it (their working sets would otherwise stack; ``trimmed_beside_pass``)."""
    with trimmed_beside_pass():
        return codec.decode_run(h, chunks, mu)


def dtype_of_header(h: ct.StreamHeader) -> int:
    """Element size of a stream's KV."""
    return 1 if h.dtype == ct.DTYPE_FP8 else 2


def _whole(rec: bytes | bytearray | memoryview, h: ct.StreamHeader, index: int) -> ct.Chunk:
    chunk, used = ct.unpack_chunk(rec, h, borrow=True)  # NOTE: rec is the chunk's now: its bits are not copied
    if used != len(rec):
        raise ct.FormatError(f"chunk record of {used} bytes sent as {len(rec)}")
    if chunk.index != index:
        raise ct.FormatError(f"chunk record {chunk.index} sent as chunk {index}")
    return chunk
