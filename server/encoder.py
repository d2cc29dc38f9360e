"""The encoder sidecar: takes a request's raw KV from the prefill engine, codes
it under the pinned predictor and streams it to the destination decoder.

Lifecycle of one Submit call: the header is validated and the predictor
starts on the prompt at once; a Transfer call to the decoder opens and gets
the stream header; raw layers are reassembled from their parts (each layer's
bytes reserved from the byte budget first); as soon as a chunk's layers are
all in, a sender task codes it (off the event loop) and writes its record in
parts, while the next layers keep arriving. ``await call.write`` is where the
decoder's backpressure reaches us; the budget is where ours reaches the
engine. A failure anywhere cancels the decoder call and ends Submit with a
precise status (the decoder's own, prefixed "decoder: ").
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, cast

import grpc
import numpy as np

from speckv.coder import container as ct
from speckv.digests import KVDigest, digest
from speckv.errors import RpcError
from speckv.status import abort, from_in_band, outcome, to_status
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import decoder_pb2_grpc as dgrpc
from speckv.v1 import encoder_pb2 as epb
from speckv.v1 import encoder_pb2_grpc as egrpc
from speckv.wire import LayerAssembler, bad, dtype_of, layer_bytes, parts, shape_of

from .aio import drain_batch, peer_host, watched
from .auth import authorize, parse_allow
from .budget import ByteBudget, Holding
from .config import ServerConfig
from .metrics import Metrics
from .runtime import Runtime
from .tls import KEEPALIVE, channel_credentials
from .transfers import check_request_id

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    """One Submit in progress."""

    header: epb.SubmitHeader
    h: ct.StreamHeader
    ids: np.ndarray
    labels: tuple[str, str]  # (dtype, encoding)
    holding: Holding
    layers: dict[int, tuple[np.ndarray, np.ndarray | None]] = field(default_factory=dict)
    raw_bytes: int = 0
    wire_bytes: int = 0
    chunks: int = 0
    predictor_s: float = 0.0
    encode_s: float = 0.0
    first_send: float | None = None
    message_bytes: int = 0  # serialized TransferRequests written
    fallback: bool = False  # switched to a stored stream after a predictor mismatch
    digest: KVDigest = field(default_factory=KVDigest)  # whole-transfer digest, layer by layer


# HOST:PORT: a DNS name or IPv4 address, or a bracketed IPv6 address; grpc would fail
# to create a channel for anything else (e.g. "x:1##") with an opaque UNKNOWN
ADDRESS = re.compile(r"(?:\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9][A-Za-z0-9._-]{0,252}):([0-9]{1,5})")


def valid_address(addr: str) -> bool:
    m = ADDRESS.fullmatch(addr)
    return m is not None and 1 <= int(m.group(1)) <= 65535


class EncoderService(egrpc.EncoderServiceServicer):
    def __init__(self, config: ServerConfig, runtime: Runtime, metrics: Metrics, budget: ByteBudget) -> None:
        self.config, self.rt, self.metrics, self.budget = config, runtime, metrics, budget
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._fallback_peers: set[str] = set()
        self._per_peer: dict[str, int] = {}
        self.allow = parse_allow(config.allow)
        self.active = 0

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def Submit(self, request_iterator: AsyncIterator[epb.SubmitRequest],
                     context: grpc.aio.ServicerContext) -> epb.SubmitResponse:
        await authorize(context, "Submit", self.allow)
        host = peer_host(context.peer() or "?")
        if self._per_peer.get(host, 0) >= self.config.max_transfers_per_peer:
            await abort(context, RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self._per_peer[host]} submits from "
                                          f"{host} in progress (max_transfers_per_peer)", reason="PEER_LIMIT"))
        self._per_peer[host] = self._per_peer.get(host, 0) + 1
        t0 = time.perf_counter()
        it = request_iterator.__aiter__()
        job: _Job | None = None
        self.active += 1
        self._gauges()
        try:
            job = self._start(await anext(it, None))
            resp = await self._run(job, it, context, t0)
            self.metrics.finished("ok", *job.labels, scalars=job.raw_bytes // dtype_of(job.header.dtype)[1].itemsize,
                                  wire=job.wire_bytes)
            self.metrics.seconds("transfer", time.perf_counter() - t0)
            return resp
        except BaseException as e:  # noqa: BLE001 -- CancelledError too
            code, msg = to_status(e)
            self.metrics.finished(outcome(code))
            logger.info("submit %s failed: %s %s", job.header.request_id if job else "?", code.name, msg)
            if isinstance(e, asyncio.CancelledError):
                raise
            await abort(context, e)
        finally:
            if job is not None:
                job.holding.close()
            self.active -= 1
            self._per_peer[host] -= 1
            self._gauges()

    def _start(self, first: epb.SubmitRequest | None) -> _Job:
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
        self.rt.check(hdr.model_id, shape, ids, self.config.max_tokens)
        if hdr.encoding not in (epb.ENCODING_UNSPECIFIED, epb.ENCODING_SPECKV, epb.ENCODING_STORED):
            raise bad(f"unknown encoding {hdr.encoding}")
        stored = hdr.encoding == epb.ENCODING_STORED
        lb = layer_bytes(shape, dt.itemsize)
        if 2 * lb > self.budget.limit:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"one layer ({lb} bytes) needs more than half the in-flight cap ({self.budget.limit})")
        lpc = max(1, min(self.config.layers_per_chunk, self.budget.limit // (2 * max(lb, 1))))
        h = self.rt.codec.stream_header(name == "bf16", shape, ids, lpc, stored)
        return _Job(hdr, h, ids, (name, "stored" if stored else "speckv"), self.budget.holding())

    async def _run(self, job: _Job, it: AsyncIterator, context: grpc.aio.ServicerContext,
                   t0: float) -> epb.SubmitResponse:
        mu = None if job.h.model == ct.MODEL_STORED else asyncio.ensure_future(self.rt.mu(job.ids))
        call = self._open(job, context)
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        check: asyncio.Future = asyncio.get_running_loop().create_future()  # the decoder's mu digest
        acks = asyncio.ensure_future(_read_result(call, check))
        sender = asyncio.ensure_future(self._send_loop(job, mu, call, queue, check))
        watch = (acks, sender)
        try:
            await _write(job, call, dpb.TransferRequest(header=_transfer_header(job)))
            job.wire_bytes = ct.HEADER_LEN
            self.metrics.header(*job.labels, ct.HEADER_LEN)
            await self._receive(job, it, queue, watch)
            queue.put_nowait(None)
            await watched(sender, watch)
            await _write(job, call, dpb.TransferRequest(trailer=dpb.TransferTrailer(
                raw_digest=job.digest.digest(), raw_bytes=job.digest.raw_bytes)))
            await call.done_writing()
            result = await watched(acks, watch)
            if (result.raw_bytes, result.wire_bytes, result.encoding) != (job.raw_bytes, job.wire_bytes,
                                                                           job.labels[1]):
                raise RpcError(grpc.StatusCode.DATA_LOSS,
                               f"decoder reports {result.raw_bytes} raw / {result.wire_bytes} wire bytes, "
                               f"encoder sent {job.raw_bytes} / {job.wire_bytes}")
        except BaseException:
            call.cancel()
            raise
        finally:
            for f in (mu, sender, acks):
                if f is not None and not f.done():
                    f.cancel()
        self.metrics.seconds("encode", job.encode_s)
        now = time.perf_counter()
        return epb.SubmitResponse(
            status=pb.Status(code=pb.STATUS_CODE_OK), raw_bytes=job.raw_bytes, wire_bytes=job.wire_bytes,
            chunks=job.chunks, predictor_seconds=job.predictor_s, encode_seconds=job.encode_s,
            transfer_seconds=now - (job.first_send or now), total_seconds=now - t0,
            message_bytes=job.message_bytes, encoding=job.labels[1], fallback=job.fallback)

    def _open(self, job: _Job, context: grpc.aio.ServicerContext):
        addr = job.header.decoder_address
        if addr not in self._channels:
            options = [("grpc.max_receive_message_length", self.config.max_receive_bytes),
                       ("grpc.max_send_message_length", self.config.max_receive_bytes),
                       # a restarted decoder is reached again within ~0.1-1 s, not gRPC's 1-120 s backoff
                       ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                       ("grpc.max_reconnect_backoff_ms", 1000), *KEEPALIVE]
            creds = channel_credentials(self.config)
            self._channels[addr] = (grpc.aio.secure_channel(addr, creds, options=options) if creds
                                    else grpc.aio.insecure_channel(addr, options=options))
        remaining = context.time_remaining()
        timeout = min(self.config.transfer_timeout_s, remaining if remaining is not None else float("inf"))
        return dgrpc.DecoderServiceStub(self._channels[addr]).Transfer(timeout=timeout)

    async def _receive(self, job: _Job, it: AsyncIterator, queue: asyncio.Queue, watch) -> None:
        """Reassemble raw layers; queue each chunk once its layers are all in."""
        asm = LayerAssembler(job.header.dtype, job.h.shape)
        next_chunk = 0
        while (req := await watched(anext(it, None), watch)) is not None:
            if req.WhichOneof("kind") != "layer":
                raise bad("only layer messages may follow the header")
            if asm.starting:
                await watched(job.holding.acquire(asm.layer_size), watch)  # backpressure on the engine
            done = asm.add(req.layer)
            if done is None:
                continue
            layer, arr, scales = done
            job.layers[layer] = (arr, scales)
            job.digest.update_layer(arr, scales)
            start, count = job.h.chunk_layers(next_chunk)
            if layer == start + count - 1:
                queue.put_nowait(next_chunk)
                next_chunk += 1
        if not asm.done:
            raise bad(f"stream ended after {asm.next_layer} of {job.h.shape[0]} layers")

    async def _send_loop(self, job: _Job, mu_task, call, queue: asyncio.Queue, check: asyncio.Future) -> None:
        """Code ready chunks (all that queued up, in one pass) and write their records."""
        mu = None
        if mu_task is not None:
            mu, job.predictor_s = await mu_task
            self.metrics.seconds("predictor", job.predictor_s)
            # NOTE: no chunk leaves before the decoder's predictor agrees with ours
            if await check != digest(mu):
                await self._fall_back(job, call)
                mu = None  # a stored stream needs no mu
        lb = layer_bytes(job.h.shape, dtype_of(job.header.dtype)[1].itemsize)
        while batch := await drain_batch(queue):
            start = job.h.chunk_layers(batch[0])[0]
            stop = sum(job.h.chunk_layers(batch[-1]))
            got = [job.layers.pop(k) for k in range(start, stop)]
            x = np.stack([g[0] for g in got])  # (layers, 2, heads, tokens, dim)
            # one dtype per transfer: every layer carries FP8 scales, or none does
            sc = np.stack(cast("list[np.ndarray]", [g[1] for g in got])) if got[0][1] is not None else None
            del got
            e0 = time.perf_counter()
            recs = await asyncio.to_thread(_encode, self.rt.codec, job.h, range(batch[0], batch[-1] + 1), x, mu, sc)
            job.encode_s += time.perf_counter() - e0
            del x
            for i, rec in zip(batch, recs, strict=True):
                await self._send(job, call, i, rec, lb * job.h.chunk_layers(i)[1])

    async def _fall_back(self, job: _Job, call) -> None:
        """Switch the transfer to a stored stream (same chunking): still bit-exact."""
        h = job.h
        job.h = self.rt.codec.stream_header(h.dtype == ct.DTYPE_BF16, h.shape, job.ids, h.layers_per_chunk, True)
        job.labels, job.fallback = (job.labels[0], "stored"), True
        await _write(job, call, dpb.TransferRequest(fallback=dpb.Fallback(
            header_record=ct.pack_header(job.h), reason="mu_mismatch")))
        job.wire_bytes += ct.HEADER_LEN
        self.metrics.header(*job.labels, ct.HEADER_LEN)
        self.metrics.fallback("mu_mismatch")
        peer = job.header.decoder_address
        if peer not in self._fallback_peers:  # NOTE: logged once per peer, counted every time
            self._fallback_peers.add(peer)
            logger.warning("decoder %s computes another mu than this encoder (predictor %s): transfers to it "
                           "fall back to stored streams", peer, self.rt.pin[:12])
        return None

    async def _send(self, job: _Job, call, i: int, rec: bytes, raw: int) -> None:
        keep = min(raw, len(rec))  # the record inherits its layers' reservation
        job.holding.release(raw - keep)
        job.first_send = job.first_send or time.perf_counter()
        for off, ln in parts(len(rec), self.config.message_bytes):
            await _write(job, call, dpb.TransferRequest(chunk=dpb.Chunk(
                index=i, record=rec[off:off + ln], byte_offset=off, record_bytes=len(rec))))
        job.holding.release(keep)
        job.raw_bytes += raw
        job.wire_bytes += len(rec)
        job.chunks += 1
        self.metrics.chunk(*job.labels, raw, len(rec), ct.HEADER_LEN if i == 0 else 0)

    def _gauges(self) -> None:
        self.metrics.gauges(self.active, self.budget.used, self.budget.limit)


async def _write(job: _Job, call, req: dpb.TransferRequest) -> None:
    job.message_bytes += req.ByteSize()
    await call.write(req)  # NOTE: awaits HTTP/2 flow control: the decoder's backpressure


def _encode(codec, h: ct.StreamHeader, idx: range, x: np.ndarray, mu, scales) -> list[bytes]:
    return [ct.pack_chunk(c) for c in codec.encode_chunks(h, idx, x, mu, scales)]


def _transfer_header(job: _Job) -> dpb.TransferHeader:
    hdr = job.header
    return dpb.TransferHeader(request_id=hdr.request_id, predictor_pin=job.h.pin,
                              model_id=hdr.model_id, dtype=hdr.dtype, shape=hdr.shape,
                              prompt_token_ids=hdr.prompt_token_ids, header_record=ct.pack_header(job.h))


async def _read_result(call, check: asyncio.Future) -> dpb.TransferResult:
    """Drain the decoder's messages: its PredictorCheck (into ``check``), acks, and its
    TransferResult (or its gRPC error)."""
    result = None
    async for resp in call:
        kind = resp.WhichOneof("kind")
        if kind == "predictor" and not check.done():
            check.set_result(bytes(resp.predictor.mu_digest))
        elif kind == "result":
            result = resp.result
            if result.status.code != pb.STATUS_CODE_OK:  # the decoder's verdict, in-band
                raise from_in_band(result.status)
    if result is None:
        raise RpcError(grpc.StatusCode.INTERNAL, "decoder ended the transfer without a result")
    return result
