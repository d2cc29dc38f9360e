"""The encoder sidecar: takes a request's raw KV from the prefill engine, codes
it under the pinned predictor and streams it to the destination decoder.

Lifecycle of one Submit call: the header is validated and the predictor
starts on the prompt at once (its mu arrives layer by layer); a Transfer call
to the decoder opens and gets the stream header, so the decoder's predictor
starts too; raw layers are reassembled from their parts (each layer's bytes
reserved from the byte budget first); as soon as a chunk's layers are all in,
and both sides' mu of those layers exist, a sender task compares its mu digest
with the decoder's PredictorCheck for that chunk, codes it (off the event loop;
stored when the digests differ) and writes its record in parts, while the next
layers keep arriving. ``await call.write`` is where the decoder's backpressure
reaches us; the budget is where ours reaches the engine. A failure anywhere
cancels the decoder call and ends Submit with a precise status (the decoder's
own, prefixed "decoder: ").
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import replace
from typing import AsyncIterator

import grpc
import numpy as np

from speckv import frames, logs
from speckv.coder import container as ct
from speckv.coder.heads import head_codec, slice_heads
from speckv.errors import RpcError
from speckv.kv import some_heads
from speckv.status import abort, outcome, to_status
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import encoder_pb2 as epb
from speckv.v1 import encoder_pb2_grpc as egrpc
from speckv.wire import LayerAssembler, bad, dtype_of, fp8_attention_of, heads_of, layer_bytes, shape_of

from . import tracing
from .aio import batch_limit, drain_batch, peer_host, watched
from .auth import authorize, parse_allow
from .budget import ByteBudget
from .channels import DecoderChannels
from .config import ServerConfig
from .encoder_job import STORED_VERSION, TRANSFER, Job, local_part, transfer_header, write
from .handoff import Handoffs, parse_uids
from .metrics import Metrics
from .mu_cache import MuCache
from .mu_recheck import Rechecker
from .records import code_batch, store_batch
from .replies import Checks, first_reply, older_version, read_result, stored_fallback
from .runtime import Runtime
from .token_ranges import TokenRanges
from .transfers import check_request_id

logger = logging.getLogger(__name__)


# HOST:PORT: a DNS name or IPv4 address, or a bracketed IPv6 address; grpc would fail
# to create a channel for anything else (e.g. "x:1##") with an opaque UNKNOWN
ADDRESS = re.compile(r"(?:\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9][A-Za-z0-9._-]{0,252}):([0-9]{1,5})")


def valid_address(addr: str) -> bool:
    m = ADDRESS.fullmatch(addr)
    return m is not None and 1 <= int(m.group(1)) <= 65535


class EncoderService(egrpc.EncoderServiceServicer):
    def __init__(self, config: ServerConfig, runtime: Runtime, metrics: Metrics, budget: ByteBudget) -> None:
        self.config, self.rt, self.metrics, self.budget = config, runtime, metrics, budget
        self._channels = DecoderChannels(config)
        self._fallback_peers: set[str] = set()
        self._per_peer: dict[str, int] = {}
        self.allow = parse_allow(config.allow)
        self.mu_cache = MuCache(config.mu_cache_bytes)
        self.rechecks = Rechecker(runtime, self.mu_cache, metrics)
        self.active = 0
        self.handoffs = None if config.local_socket is None else Handoffs(
            config.local_socket, parse_uids(config.local_uids), config.local_handle_ttl_s,
            config.local_max_handles, config.max_inflight_bytes)

    async def close(self) -> None:
        await self._channels.close()
        if self.handoffs is not None:
            self.handoffs.stop()

    async def Submit(self, request_iterator: AsyncIterator[epb.SubmitRequest],
                     context: grpc.aio.ServicerContext) -> epb.SubmitResponse:
        logs.bind(peer=context.peer() or "?")  # NOTE: on every line of this call, its failure included
        await authorize(context, "Submit", self.allow)
        host = peer_host(context.peer() or "?")
        if self._per_peer.get(host, 0) >= self.config.max_transfers_per_peer:
            await abort(context, RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self._per_peer[host]} submits from "
                                          f"{host} in progress (max_transfers_per_peer)", reason="PEER_LIMIT"))
        self._per_peer[host] = self._per_peer.get(host, 0) + 1
        t0 = time.perf_counter()
        it = request_iterator.__aiter__()
        job: Job | None = None
        self.active += 1
        self._gauges()
        span = tracing.start("speckv.encoder.Submit", context)
        try:
            first = await anext(it, None)
            if first is not None and first.WhichOneof("kind") == "header":
                logs.bind(request_id=first.header.request_id or None, decoder=first.header.decoder_address or None)
                tracing.annotate(span, request_id=first.header.request_id, decoder=first.header.decoder_address)
            job = self._start(first)
            job.span = span
            resp = await self._run(job, it, context, t0)
            self.metrics.finished("ok", *job.labels, scalars=job.raw_bytes // dtype_of(job.header.dtype)[1].itemsize,
                                  wire=job.wire_bytes, fallback_reasons=job.stored_reasons)
            self.metrics.seconds("transfer", time.perf_counter() - t0)
            logger.debug("submit %s sent: %d raw bytes in %d wire bytes (%s), %.3f s", job.header.request_id,
                         job.raw_bytes, job.wire_bytes, job.labels[1], time.perf_counter() - t0)
            tracing.end(span, raw_bytes=resp.raw_bytes, wire_bytes=resp.wire_bytes, chunks=resp.chunks,
                        encoding=resp.encoding, fallback=resp.fallback, predictor_seconds=resp.predictor_seconds,
                        encode_seconds=resp.encode_seconds, mu_wait_seconds=resp.mu_wait_seconds,
                        wire_wait_seconds=resp.wire_wait_seconds)
            return resp
        except BaseException as e:  # noqa: BLE001 -- CancelledError too
            code, msg = to_status(e)
            tracing.end(span, code, msg)
            self.metrics.finished(outcome(code))
            logger.warning("submit %s failed: %s %s", logs.bound().get("request_id", "?"), code.name, msg,
                           extra={"code": code.name})
            if isinstance(e, asyncio.CancelledError):
                raise
            await abort(context, e)
        finally:
            if job is not None:
                job.holding.close()
                if self.handoffs is not None:
                    self.handoffs.release(job)  # NOTE: the memfds this call claimed are closed now
            self.active -= 1
            self._per_peer[host] -= 1
            self._gauges()

    def _start(self, first: epb.SubmitRequest | None) -> Job:
        if first is None or first.WhichOneof("kind") != "header":
            raise bad("the first message must carry the SubmitHeader")
        hdr = first.header
        check_request_id(hdr.request_id)
        if not valid_address(hdr.decoder_address):
            raise bad(f"decoder_address must be HOST:PORT, not {hdr.decoder_address[:300]!r}")
        if len(hdr.fp8_scales):  # NOTE: deprecated field; the scales travel with each layer
            raise bad("SubmitHeader.fp8_scales is deprecated and must be empty: set KVLayer.fp8_scales")
        if hdr.expected_predictor_pin and hdr.expected_predictor_pin != self.rt.codec.pin_bytes:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"predictor pin mismatch: caller expects {hdr.expected_predictor_pin.hex()}, "
                           f"this encoder has {self.rt.pin}", reason="PIN_MISMATCH")
        name, dt = dtype_of(hdr.dtype)
        shape = shape_of(hdr.shape)
        ids = np.asarray(hdr.prompt_token_ids, np.int64)
        heads = heads_of(hdr.heads, shape[2])
        self.rt.check(hdr.model_id, shape, ids, self.config.max_tokens, heads=heads)
        if hdr.encoding not in (epb.ENCODING_UNSPECIFIED, epb.ENCODING_SPECKV, epb.ENCODING_STORED):
            raise bad(f"unknown encoding {hdr.encoding}")
        stored = hdr.encoding == epb.ENCODING_STORED
        lb = layer_bytes(shape, dt.itemsize)
        if 2 * lb > self.budget.limit:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"one layer ({lb} bytes) needs more than half the in-flight cap ({self.budget.limit})")
        lpc = max(1, min(self.config.layers_per_chunk, self.budget.limit // (2 * max(lb, 1))))
        h = self.rt.codec.stream_header(name == "bf16", shape, ids, lpc, stored)
        if stored:  # NOTE: a stored stream is the same in every version since 3: any such decoder reads it
            h = replace(h, version=min(h.version, STORED_VERSION))
        job = Job(hdr, h, ids, (name, "stored" if stored else "speckv"), self.budget.holding())
        job.fp8_attention = fp8_attention_of(hdr.fp8_attention, shape[0], hdr.dtype)
        job.heads = some_heads(heads)  # all heads, named: a plain Submit
        job.codec = head_codec(self.rt.codec, job.heads)
        return job

    async def _run(self, job: Job, it: AsyncIterator, context: grpc.aio.ServicerContext,
                   t0: float) -> epb.SubmitResponse:
        job.t0 = t0
        job.mu, job.mu_hit = (None, False) if job.h.model == ct.MODEL_STORED else self.mu_cache.take(
            self.rt, job.ids, job.fp8_attention)
        if job.mu is not None:
            self.metrics.mu_cache(job.mu_hit)
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        call, checks, acks = await self._start_transfer(job, context)
        sender: asyncio.Future[None] | None = None
        try:
            call, checks, acks = await self._handshake(job, context, call, checks, acks)
            sender = asyncio.ensure_future(self._send_loop(job, call, queue, checks))
            watch = (acks, sender)
            await self._receive(job, it, queue, watch)
            queue.put_nowait(None)
            await watched(sender, watch)
            await write(job, call, dpb.TransferRequest(trailer=dpb.TransferTrailer(
                raw_digest=job.digest.digest(), raw_bytes=job.digest.raw_bytes)))
            await call.done_writing()
            result = await watched(acks, watch)
            if (result.raw_bytes, result.wire_bytes, result.stored_chunks) != (
                    job.raw_bytes, job.wire_bytes, job.stored_chunks):
                raise RpcError(grpc.StatusCode.DATA_LOSS,
                               f"decoder reports {result.raw_bytes} raw / {result.wire_bytes} wire bytes / "
                               f"{result.stored_chunks} stored chunks, encoder sent {job.raw_bytes} / "
                               f"{job.wire_bytes} / {job.stored_chunks}")
        except BaseException:
            call.cancel()
            raise
        finally:
            for f in (sender, acks):
                if f is not None and not f.done():
                    f.cancel()
            if job.mu is not None:  # NOTE: a sender cancelled inside a recheck gives back its second pass itself
                self.mu_cache.give_back(job.mu)  # a pass no transfer needs stops at its next layer
        self.metrics.seconds("encode", job.encode_s)
        self.metrics.seconds("wire_wait", job.wire_wait_s)
        if job.h.model != ct.MODEL_STORED:
            self.metrics.seconds("mu_wait", job.mu_wait_s)
        now = time.perf_counter()
        return epb.SubmitResponse(
            status=pb.Status(code=pb.STATUS_CODE_OK), raw_bytes=job.raw_bytes, wire_bytes=job.wire_bytes,
            chunks=job.chunks, predictor_seconds=job.predictor_s, encode_seconds=job.encode_s,
            transfer_seconds=now - (job.first_send or now), total_seconds=now - t0,
            message_bytes=job.message_bytes, encoding=job.labels[1], fallback=job.fallback,
            stored_chunks=job.stored_chunks, mu_wait_seconds=job.mu_wait_s, wire_wait_seconds=job.wire_wait_s,
            chunk_timings=[job.timeline[i] for i in sorted(job.timeline)])

    async def _start_transfer(self, job: Job, context: grpc.aio.ServicerContext):
        """Open the Transfer call, start reading its replies, send the header."""
        call = self._open(job, context)
        checks = Checks(job.h.n_chunks)  # the decoder's per-chunk mu digests
        acks = asyncio.ensure_future(read_result(call, checks))
        try:
            await write(job, call, dpb.TransferRequest(header=transfer_header(job)))
        except BaseException:
            acks.cancel()
            call.cancel()
            raise
        job.wire_bytes = ct.HEADER_LEN
        self.metrics.header(*job.labels, ct.HEADER_LEN)
        return call, checks, acks

    async def _handshake(self, job: Job, context: grpc.aio.ServicerContext, call, checks: Checks, acks):
        """A speckv stream waits for the decoder's first reply (``replies``): a refusal of its
        format version gets the stream again one version older, one of its predictor pin or of
        the model gets it stored (each logged once per peer); any other refusal fails the transfer."""
        while job.mu is not None and (refused := await first_reply(checks, acks)) is not None:
            call.cancel()
            if (older := older_version(refused, job.h.version)) is not None:
                self._once(job, "version", f"reads stream format {older} at most: its streams are written so")
                job.h = replace(job.h, version=older)
            elif (why := stored_fallback(refused)) is not None:
                lacks = (f"another predictor than this encoder's ({self.rt.pin[:12]})" if why == "pin_mismatch"
                         else f"another model than {job.header.model_id!r}")
                self._once(job, why, f"holds {lacks}: its transfers go stored")
                self.mu_cache.give_back(job.mu)
                job.mu = None
                h = job.h
                stored = self.rt.codec.stream_header(h.dtype == ct.DTYPE_BF16, h.shape, job.ids, h.layers_per_chunk,
                                                     True)
                job.h = replace(stored, version=min(h.version, STORED_VERSION))
                job.labels, job.fallback, job.stream_fallback = (job.labels[0], "stored"), True, why
            else:
                raise refused
            call, checks, acks = await self._start_transfer(job, context)
        return call, checks, acks

    def _once(self, job: Job, kind: str, what: str) -> None:
        """Log a peer's handshake outcome once per peer (it is counted per chunk)."""
        key = f"{kind} {job.header.decoder_address}"
        if key not in self._fallback_peers:
            self._fallback_peers.add(key)
            logger.warning("decoder %s %s", job.header.decoder_address, what)

    def _open(self, job: Job, context: grpc.aio.ServicerContext):
        channel = self._channels.get(job.header.decoder_address)
        remaining = context.time_remaining()
        timeout = min(self.config.transfer_timeout_s, remaining if remaining is not None else float("inf"))
        # NOTE: DecoderService.Transfer with a serializer that passes the pre-serialised chunk parts through
        return channel.stream_stream(TRANSFER, request_serializer=frames.serialize,
                                                  response_deserializer=dpb.TransferResponse.FromString)(
            timeout=timeout, metadata=tracing.outgoing(job.span))

    async def _receive(self, job: Job, it: AsyncIterator, queue: asyncio.Queue, watch) -> None:
        """Reassemble raw layers (whole, or in token ranges); queue each chunk once its layers are all in."""
        asm: LayerAssembler | TokenRanges = LayerAssembler(job.header.dtype, job.h.shape, borrow=True)
        next_chunk = 0  # NOTE: one-part layers (above): no copy
        while (req := await watched(anext(it, None), watch)) is not None:
            kind = req.WhichOneof("kind")
            if kind not in ("layer", "local_layer"):
                raise bad("only layer messages may follow the header")
            if kind == "layer" and req.layer.token_count and isinstance(asm, LayerAssembler):
                asm = await self._ranged(job, asm, watch)
            if isinstance(asm, TokenRanges):
                if kind == "local_layer":
                    raise bad("LocalLayer carries whole layers: not among token ranges")
                done = asm.add(req.layer, frames.payload_of(req))
            else:
                if asm.starting:
                    await watched(job.holding.acquire(asm.layer_size), watch)  # backpressure on the engine
                if kind == "local_layer":  # NOTE: a view of the client's sealed memfd: nothing copied
                    if self.handoffs is None:
                        raise bad("LocalLayer needs an encoder with a local socket (local_socket)")
                    if not asm.starting:
                        raise bad(f"LocalLayer {req.local_layer.layer} inside layer {asm.next_layer}'s parts")
                    one = asm.add(*local_part(job, req.local_layer, self.handoffs))
                    self.metrics.local(req.local_layer.layer_bytes)
                else:
                    one = asm.add(req.layer, frames.payload_of(req))  # NOTE: the payload: a view of the bytes
                done = [] if one is None else [one]
            for layer, arr, scales in done:
                job.layers[layer] = (arr, scales)
                job.digest.update_layer(arr, scales)
                start, count = job.h.chunk_layers(next_chunk)
                if layer == start + count - 1:
                    job.mark(next_chunk, "layers_in_seconds")
                    queue.put_nowait(next_chunk)
                    next_chunk += 1
        if not asm.done:
            raise bad(f"stream ended after {asm.next_layer} of {job.h.shape[0]} layers")

    async def _ranged(self, job: Job, asm: LayerAssembler, watch) -> TokenRanges:
        """Switch a Submit to token ranges, reserving the rest of its KV at once (``TokenRanges.need``)."""
        whole = TokenRanges.need(asm, self.budget.limit)
        await watched(job.holding.acquire(whole), watch)
        return TokenRanges(job.header.dtype, job.h.shape)

    async def _send_loop(self, job: Job, call, queue: asyncio.Queue, checks: Checks) -> None:
        """Code ready chunks (what queued up, BATCH_BYTES at most, in one pass) and write their records."""
        lb = layer_bytes(job.h.shape, dtype_of(job.header.dtype)[1].itemsize)
        limit = batch_limit(lb * job.h.layers_per_chunk)  # NOTE: the decoder starts on the first meanwhile
        while batch := await drain_batch(queue, limit):
            start = job.h.chunk_layers(batch[0])[0]
            stop = sum(job.h.chunk_layers(batch[-1]))
            w0 = time.perf_counter()
            mismatched = set() if job.mu is None else await self.rechecks.mismatched(job, batch, checks)
            job.mu_wait_s += time.perf_counter() - w0
            mu = job.mu  # NOTE: after _mismatched, which may have replaced it (server/mu_recheck.py)
            if mu is None:
                job.mark(batch, "ready_seconds")
            got = [job.layers.pop(k) for k in range(start, stop)]
            e0 = time.perf_counter()
            if job.h.model == ct.MODEL_STORED or (job.h.version >= 3 and mismatched.issuperset(batch)):
                recs = store_batch(job.h, batch, got, start)  # NOTE: no coder, no stacking: inline
            else:
                recs = await asyncio.to_thread(code_batch, job.codec, job.h, range(batch[0], batch[-1] + 1), got,
                                               None if mu is None else slice_heads(mu.bits, job.heads), mismatched)
            job.encode_s += time.perf_counter() - e0
            job.mark(batch, "coded_seconds")
            del got
            for i, (rec, stored) in zip(batch, recs, strict=True):
                reason = "" if not stored or job.h.model == ct.MODEL_STORED else \
                    "mu_mismatch" if i in mismatched else "larger_than_stored"
                await self._send(job, call, i, rec, lb * job.h.chunk_layers(i)[1], reason)
        mu = job.mu
        if mu is not None and not job.fallback:
            self.rechecks.agreed(job.header.decoder_address)
        if mu is not None and mu.count == job.h.shape[0] and not job.mu_hit:
            job.predictor_s = await mu.done()  # a cached pass cost this transfer nothing
            self.metrics.seconds("predictor", job.predictor_s)

    async def _send(self, job: Job, call, i: int, rec: list[memoryview], raw: int, stored_reason: str) -> None:
        """Write chunk i's record (as buffers: ``ct.chunk_pieces``) in parts, each framed once."""
        size = sum(len(p) for p in rec)
        keep = min(raw, size)  # the record inherits its layers' reservation
        job.holding.release(raw - keep)
        job.first_send = job.first_send or time.perf_counter()
        for off, _, views in frames.record_slices(rec, self.config.message_bytes):
            await write(job, call, frames.chunk_part(i, views, off, size, stored_reason if off == 0 else ""))
        job.holding.release(keep)
        job.mark(i, "written_seconds")
        job.timeline[i].wire_bytes = size
        job.raw_bytes += raw
        job.wire_bytes += size
        job.chunks += 1
        if stored_reason:
            job.stored_chunks += 1
            job.stored_reasons.add(stored_reason)
            self.metrics.fallback(stored_reason)
        elif job.stream_fallback:  # NOTE: a stored stream: the decoder counts no stored chunks of it
            job.stored_reasons.add(job.stream_fallback)
            self.metrics.fallback(job.stream_fallback)
        self.metrics.chunk(*job.labels, raw, size, ct.HEADER_LEN if i == 0 else 0)

    def _gauges(self) -> None:
        self.metrics.gauges(self.active, self.budget.used, self.budget.limit)
