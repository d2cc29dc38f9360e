"""OpenTelemetry spans of a live pair (server/tracing.py), recorded by the SDK's in-memory
exporter: the encoder's Submit span continues the engine's trace (W3C traceparent in
its call's metadata), the decoder's Transfer span is its child (carried in the Transfer
call's metadata), FetchKV has its own; figures and status codes on the spans; and
without opentelemetry the module is inert."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from server_helpers import FETCH_WAIT, WAIT, Pair, rid, submit_list

from speckv.client.client import RpcFailed
from speckv.server import tracing
from speckv.v1 import encoder_pb2_grpc as egrpc

sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk (the test extra) not installed")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

ENGINE_TRACE, ENGINE_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(sidecars, prompts):
    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    mp = pytest.MonkeyPatch()
    mp.setattr(tracing, "_provider", provider)
    p = Pair.start(sidecars)
    ids, kv = prompts("short")
    r = {"ok": rid("tr-ok"), "engine": rid("tr-engine"), "refused": rid("tr-refused")}
    res = p.roundtrip(r["ok"], kv, ids)
    with grpc.insecure_channel(p.eaddr) as ch:  # an engine whose call carries its trace context
        with ThreadPoolExecutor(1) as pool:
            fetched = pool.submit(p.dec.fetch, r["engine"], FETCH_WAIT, WAIT)
            egrpc.EncoderServiceStub(ch).Submit(iter(submit_list(r["engine"], kv, ids, p.daddr)), timeout=WAIT,
                                                metadata=(("traceparent", f"00-{ENGINE_TRACE}-{ENGINE_SPAN}-01"),))
            fetched.result(WAIT)
    with pytest.raises(RpcFailed):
        p.enc.submit(r["refused"], kv, ids, p.daddr, "other-model", timeout=WAIT)
    p.stop()
    mp.undo()
    provider.shutdown()
    spans = exporter.get_finished_spans()
    yield {(s.name, s.attributes.get("speckv.request_id")): s for s in spans}, r, res


def test_transfer_spans_share_a_trace(traced):
    spans, r, res = traced
    submit, transfer = spans["speckv.encoder.Submit", r["ok"]], spans["speckv.decoder.Transfer", r["ok"]]
    fetch = spans["speckv.decoder.FetchKV", r["ok"]]
    assert submit.parent is None and submit.kind == SpanKind.SERVER  # no engine context: a new trace
    assert transfer.context.trace_id == submit.context.trace_id
    assert transfer.parent.span_id == submit.context.span_id
    assert fetch.context.trace_id != submit.context.trace_id  # the decode engine's call, no context
    for span in (submit, transfer):
        a = span.attributes
        assert (a["speckv.raw_bytes"], a["speckv.wire_bytes"], a["speckv.encoding"]) == (
            res.raw_bytes, res.wire_bytes, "speckv"), a
        assert a["rpc.grpc.status_code"] == 0 and span.status.status_code == StatusCode.UNSET
        assert a["speckv.predictor_seconds"] > 0 and a["speckv.chunks"] == res.chunks
    assert submit.attributes["rpc.service"] == "speckv.v1.EncoderService"
    assert transfer.attributes["rpc.service"] == "speckv.v1.DecoderService"
    assert fetch.attributes["speckv.raw_bytes"] == res.raw_bytes and fetch.attributes["speckv.layers"] == 30


def test_the_engine_trace_continues(traced):
    spans, r, _ = traced
    submit, transfer = spans["speckv.encoder.Submit", r["engine"]], spans["speckv.decoder.Transfer", r["engine"]]
    assert f"{submit.context.trace_id:032x}" == ENGINE_TRACE and f"{submit.parent.span_id:016x}" == ENGINE_SPAN
    assert f"{transfer.context.trace_id:032x}" == ENGINE_TRACE and transfer.parent.span_id == submit.context.span_id


def test_a_failed_call_is_an_error_span(traced):
    spans, r, _ = traced
    span = spans["speckv.encoder.Submit", r["refused"]]
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description.startswith("FAILED_PRECONDITION: model 'other-model' is not served here")
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    # refused before any call to the decoder
    assert not [k for k in spans if k[0] == "speckv.decoder.Transfer" and k[1] == r["refused"]]


def test_without_opentelemetry_tracing_is_inert():
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from speckv.server import tracing\n"
            "assert not tracing.available()\n"
            "assert tracing.start('speckv.encoder.Submit', None) is None and tracing.outgoing(None) is None\n"
            "tracing.annotate(None, request_id='x'); tracing.end(None)\n"
            "print('inert')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "inert\n", proc.stderr
