"""The sidecar process shell: gRPC health and reflection, graceful stop (health
NOT_SERVING first, in-flight transfers finish), and a decoder restarted on the
same port behind an encoder that keeps its cached channel."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
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

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = {"decoder": "speckv.v1.DecoderService", "encoder": "speckv.v1.EncoderService"}
METHODS = {"decoder": {"Transfer", "FetchKV", "GetTransferStatus", "CancelTransfer"}, "encoder": {"Submit"}}


@pytest.mark.parametrize("role", ["decoder", "encoder"])
def test_reflection_lists_the_services(pair, role):
    addr = pair.daddr if role == "decoder" else pair.eaddr
    with grpc.insecure_channel(addr) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        assert set(db.get_services()) == {SERVICES[role], "grpc.health.v1.Health",
                                          "grpc.reflection.v1alpha.ServerReflection"}
        svc = DescriptorPool(db).FindServiceByName(SERVICES[role])
        assert {m.name for m in svc.methods} == METHODS[role]


@pytest.mark.parametrize("role", ["decoder", "encoder"])
def test_health_serving(pair, role):
    addr = pair.daddr if role == "decoder" else pair.eaddr
    with grpc.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICES[role]):
            assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == SERVING
        with pytest.raises(grpc.RpcError) as ei:
            stub.Check(health_pb2.HealthCheckRequest(service="speckv.v1.NoSuchService"), timeout=5)
        assert ei.value.code() == grpc.StatusCode.NOT_FOUND


class Watch:
    """A health Watch stream in a thread, recording every status it reports."""

    def __init__(self, addr: str, service: str = "") -> None:
        self.channel = grpc.insecure_channel(addr)
        self.call = health_pb2_grpc.HealthStub(self.channel).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=WAIT)
        self.seen: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for resp in self.call:
                self.seen.append(resp.status)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)
        self.channel.close()


def test_graceful_stop_goes_not_serving_and_finishes_the_transfer_in_flight(sidecars, prompts):
    p = Pair.start(sidecars)
    ids, kv = prompts("medium")
    r = rid("drain")
    watches = {role: Watch(addr) for role, addr in (("decoder", p.daddr), ("encoder", p.eaddr))}
    gate = None
    try:
        for w in watches.values():
            wait_until(lambda w=w: w.seen == [SERVING], what="health SERVING")
        with ThreadPoolExecutor(3) as pool:
            fetched = pool.submit(p.dec.fetch, r, WAIT, WAIT)
            gate = Gate(submit_list(r, kv, ids, p.daddr), after=9)
            fut, ch = raw_submit_future(p.eaddr, gate)
            wait_until(lambda: (s := status_or_none(p.dec, r)) is not None and s.chunks_received >= 4,
                       what="the transfer to be half way")
            # both sidecars are told to stop while the transfer is in flight
            stops = [pool.submit(sidecars.stop, s, 5.0) for s in (p.encoder, p.decoder)]
            for role, w in watches.items():
                wait_until(lambda w=w: NOT_SERVING in w.seen, what=f"{role} health NOT_SERVING")
                assert w.seen == [SERVING, NOT_SERVING]
                w.close()  # a Watch is an RPC in flight too: let the servers drain
            with pytest.raises(RpcFailed) as ei:  # no new work while draining
                EncoderClient(p.eaddr).submit(rid("late"), kv, ids, p.daddr, MODEL, timeout=5)
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE
            t0 = time.monotonic()
            gate.open()
            resp = fut.result(timeout=WAIT)
            ch.close()
            assert_same_kv(fetched.result(timeout=WAIT), kv)
            assert resp.raw_bytes == kv.numel() * 2
            for s in stops:
                s.result(timeout=WAIT)
            assert time.monotonic() - t0 < 4.5, "stop waited out its grace instead of finishing with the transfer"
        for addr in (p.daddr, p.eaddr):  # and now it is gone
            with grpc.insecure_channel(addr) as c, pytest.raises(grpc.RpcError) as ei:
                health_pb2_grpc.HealthStub(c).Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert ei.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        if gate is not None:
            gate.open()
        for w in watches.values():
            w.close()
        p.stop()


def test_decoder_restarted_on_the_same_port(sidecars, prompts):
    p = Pair.start(sidecars)
    ids, kv = prompts("short")
    try:
        p.roundtrip(rid("before-restart"), kv, ids)
        port = int(p.daddr.rsplit(":", 1)[1])
        sidecars.stop(p.decoder, 0.2)
        p.decoder, addr = sidecars.start("decoder", listen=f"127.0.0.1:{port}")
        assert addr == p.daddr
        # the encoder's cached channel and the engine's DecoderClient both reconnect
        p.roundtrip(rid("after-restart"), kv, ids)
        assert len(p.encoder.service._channels) == 1
    finally:
        p.stop()


def test_decoder_down_then_back(sidecars, prompts):
    """While the decoder is down, Submit fails fast with UNAVAILABLE; once it is back on
    its port, the encoder's channel reconnects (after gRPC's reconnect backoff, about a
    second: a Submit inside that window still fails fast with UNAVAILABLE)."""
    p = Pair.start(sidecars)
    ids, kv = prompts("short")
    try:
        p.roundtrip(rid("before-down"), kv, ids)
        port = int(p.daddr.rsplit(":", 1)[1])
        sidecars.stop(p.decoder, 0.2)
        t0 = time.monotonic()
        with pytest.raises(RpcFailed) as ei:
            p.enc.submit(rid("while-down"), kv, ids, p.daddr, MODEL, timeout=WAIT)
        assert ei.value.code == grpc.StatusCode.UNAVAILABLE and ei.value.details.startswith("decoder: ")
        assert time.monotonic() - t0 < 10
        p.decoder, _ = sidecars.start("decoder", listen=f"127.0.0.1:{port}")
        p.dec = DecoderClient(p.daddr, timeout=WAIT)
        deadline = time.monotonic() + 15
        while True:
            try:
                p.roundtrip(rid("back"), kv, ids)
                break
            except RpcFailed as e:
                assert e.code == grpc.StatusCode.UNAVAILABLE, e
                assert time.monotonic() < deadline, "the encoder never reconnected to the restarted decoder"
                time.sleep(0.2)
    finally:
        p.stop()




DRAIN_SCRIPT = """
import asyncio, sys, grpc
from speckv.server.app import _GRPC_RPC_COROS, _drain_rpc_tasks

async def stream(request, context):
    try:
        yield b"first"
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await asyncio.sleep(0.2)  # cleanup that awaits, as FetchKV's does
        raise

def pending():
    return sum(getattr(t.get_coro(), "__qualname__", "") in _GRPC_RPC_COROS for t in asyncio.all_tasks())

async def main(drain):
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.T", {"S": grpc.unary_stream_rpc_method_handler(stream)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")  # NOTE: left open: closing it yields to the loop
    call = ch.unary_stream("/t.T/S")(b"")
    await call.read()  # a streaming call in flight when the server stops
    await server.stop(0)
    before = pending()
    if drain:
        await _drain_rpc_tasks(5.0)
    print(before, pending())

asyncio.run(main(sys.argv[1] == "drain"))
"""


def test_stop_lets_the_cancelled_calls_finish_before_the_loop_closes(tmp_path):
    # grpc.aio's stop() returns while each cancelled call's task still runs its handler's cleanup;
    # a loop that closes then (asyncio.run cancels what is left) makes grpc log an ERROR with a
    # traceback (a flaky SIGTERM test in CI, when the loop closed while grpc awaited the call's
    # task). The drain waits for exactly those tasks: pending after stop(), none after the drain.
    script = tmp_path / "drain.py"
    script.write_text(DRAIN_SCRIPT)
    out = subprocess.run([sys.executable, str(script), "drain"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert before >= 1 and after == 0, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
