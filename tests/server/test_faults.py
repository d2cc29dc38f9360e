"""Fault injection against real sidecars on loopback: the decoder killed mid-transfer,
the encoder->decoder connection dropped (a TCP proxy that is cut), bits flipped on the
wire (a server interceptor), a stream stalled past its deadline. Every failure is
reported with a precise gRPC status, nothing corrupt is ever served, memory is given
back, and a retry under the same request id delivers the KV bit for bit."""
from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from server_helpers import (
    MODEL,
    WAIT,
    Gate,
    Pair,
    assert_same_kv,
    raw_submit_future,
    rid,
    status_or_none,
    submit_list,
    wait_until,
)

from speckv.client.client import DecoderClient, EncoderClient, RpcFailed
from speckv.v1 import decoder_pb2 as dpb

S = dpb.TransferState
FAILED_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}


class Proxy:
    """A TCP forwarder to ``target`` that can be cut (every connection closed at once)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.cut_event = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.cut_event.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            u = socket.create_connection(self.target)
            self.conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        self.cut_event.set()
        for s in [self.sock, *self.conns]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def _gated_submit(eaddr, r, kv, ids, daddr, after):
    gate = Gate(submit_list(r, kv, ids, daddr), after=after)
    fut, ch = raw_submit_future(eaddr, gate)
    return gate, fut, ch


def _fails_precisely(fut) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fut.result(timeout=WAIT)
    assert e.value.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.OK)
    return e.value.code()


def test_decoder_killed_mid_transfer_then_retry(sidecars, prompts):
    ids, kv = prompts("long")
    dec, daddr = sidecars.start("decoder")
    enc, eaddr = sidecars.start("encoder")
    r = rid("killed")
    try:
        gate, fut, ch = _gated_submit(eaddr, r, kv, ids, daddr, after=1 + 12)  # header + 12 layer parts
        with DecoderClient(daddr) as d:
            wait_until(lambda: (s := status_or_none(d, r)) is not None and s.chunks_received >= 1, WAIT,
                       what="a chunk at the decoder")
        sidecars.stop(dec, 0.0)  # killed: no grace
        gate.open()
        assert _fails_precisely(fut) in FAILED_CODES
        ch.close()
        dec, _ = sidecars.start("decoder", listen=daddr)  # restarted on the same port
        with EncoderClient(eaddr) as e, DecoderClient(daddr) as d, ThreadPoolExecutor(1) as pool:
            got = pool.submit(d.fetch, r, WAIT, WAIT)
            res = e.submit(r, kv, ids, daddr, MODEL, timeout=WAIT, retries=4, backoff_s=0.2)
            assert_same_kv(got.result(WAIT), kv)
        assert res.raw_bytes == kv.numel() * 2
        wait_until(lambda: enc.service.budget.used == 0 and dec.service.budget.used == 0, 10)
    finally:
        for s in (enc, dec):
            if s in sidecars.running:
                sidecars.stop(s, 0.1)


def test_connection_dropped_mid_transfer_then_retry(sidecars, prompts):
    ids, kv = prompts("long")
    p = Pair.start(sidecars)
    proxy = Proxy(p.daddr)
    r = rid("dropped")
    try:
        gate, fut, ch = _gated_submit(p.eaddr, r, kv, ids, proxy.address, after=1 + 12)
        wait_until(lambda: (s := status_or_none(p.dec, r)) is not None and s.chunks_received >= 1, WAIT)
        proxy.cut()
        gate.open()
        assert _fails_precisely(fut) in FAILED_CODES
        ch.close()
        # the decoder noticed: the stale transfer ended and gave its memory back
        wait_until(lambda: p.dec.status(r).state in (S.TRANSFER_STATE_CANCELLED, S.TRANSFER_STATE_FAILED), WAIT)
        wait_until(lambda: p.decoder.service.budget.used == 0 and p.encoder.service.budget.used == 0, 10)
        with pytest.raises(RpcFailed):
            p.dec.fetch(r, wait=1, timeout=WAIT)  # nothing partial is served
        proxy2 = Proxy(p.daddr)
        try:
            with ThreadPoolExecutor(1) as pool:
                got = pool.submit(p.dec.fetch, r, WAIT, WAIT)
                p.enc.submit(r, kv, ids, proxy2.address, MODEL, timeout=WAIT, retries=2)
                assert_same_kv(got.result(WAIT), kv)
        finally:
            proxy2.cut()
    finally:
        proxy.cut()
        p.stop()


class FlipBits(grpc.aio.ServerInterceptor):
    """Flips one bit of the n-th chunk part arriving at the decoder (a corrupting wire)."""

    def __init__(self, nth: int, byte: int) -> None:
        self.nth, self.byte = nth, byte

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if details.method != "/speckv.v1.DecoderService/Transfer":
            return handler
        inner, nth, byte = handler.stream_stream, self.nth, self.byte

        # NOTE: the sidecar parses requests itself (server/handlers.py), so an interceptor
        # sees the serialized bytes as they came off the wire
        async def flipped(requests):
            n = 0
            async for data in requests:
                req = dpb.TransferRequest.FromString(data)
                if req.WhichOneof("kind") == "chunk":
                    n += 1
                    if n == nth:
                        rec = bytearray(req.chunk.record)
                        rec[min(byte, len(rec) - 1)] ^= 0x04
                        req.chunk.record = bytes(rec)
                        data = req.SerializeToString()
                yield data

        async def wrapped(requests, context):
            async for resp in inner(flipped(requests), context):
                yield resp

        return grpc.stream_stream_rpc_method_handler(wrapped, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)


@pytest.mark.parametrize("nth,byte", [(1, 200), (3, 5000), (5, 90)])
def test_bits_flipped_on_the_wire_are_data_loss_and_never_served(sidecars, prompts, nth, byte):
    ids, kv = prompts("long")
    dec, daddr = sidecars.start("decoder", interceptors=[FlipBits(nth, byte)])
    enc, eaddr = sidecars.start("encoder")
    r = rid("flip")
    try:
        with EncoderClient(eaddr) as e, DecoderClient(daddr) as d:
            with pytest.raises(RpcFailed) as err:
                e.submit(r, kv, ids, daddr, MODEL, timeout=WAIT)
            assert err.value.code == grpc.StatusCode.DATA_LOSS and "decoder:" in err.value.details
            with pytest.raises(RpcFailed) as fe:
                d.fetch(r, wait=1, timeout=WAIT)
            assert fe.value.code == grpc.StatusCode.FAILED_PRECONDITION
        wait_until(lambda: dec.service.budget.used == 0 and enc.service.budget.used == 0, 10)
    finally:
        sidecars.stop(enc, 0.1)
        sidecars.stop(dec, 0.1)


def test_stream_stalled_past_its_deadline(sidecars, prompts):
    ids, kv = prompts("long")
    p = Pair.start(sidecars)
    r = rid("stalled")
    try:
        gate = Gate(submit_list(r, kv, ids, p.daddr), after=1 + 8, timeout=20)
        t0 = time.monotonic()
        fut, ch = raw_submit_future(p.eaddr, gate, timeout=1.5)
        assert _fails_precisely(fut) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 10
        gate.open()
        ch.close()
        wait_until(lambda: (s := status_or_none(p.dec, r)) is None or s.state != S.TRANSFER_STATE_RECEIVING, WAIT)
        wait_until(lambda: p.decoder.service.budget.used == 0 and p.encoder.service.budget.used == 0, 10)
    finally:
        p.stop()
