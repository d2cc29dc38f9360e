"""The go-grpc-prometheus families (``grpc_server_*``, server/grpc_metrics.py) on a live
pair's /metrics: every call counted when it ends, by method and final code (OK, an
abort's code, a client's cancellation, a deadline, the server's stop), messages counted
on both streams, the handling-time histogram in step with the handled counter, and the
service's series present at 0 before any traffic."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import generate_latest
from server_helpers import MODEL, WAIT, Pair, rid, submit_list, wait_until
from test_metrics import samples, scrape, value

from speckv.client.client import RpcFailed
from speckv.client.core import fetch_request, fetch_stub
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import decoder_pb2_grpc as dgrpc

DEC, ENC = "speckv.v1.DecoderService", "speckv.v1.EncoderService"
CODES = ("OK", "Canceled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists",
         "PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented",
         "Internal", "Unavailable", "DataLoss", "Unauthenticated")


def lab(kind: str, service: str, method: str, **more: str) -> dict[str, str]:
    return dict(grpc_type=kind, grpc_service=service, grpc_method=method, **more)


@pytest.fixture(scope="module")
def traffic(sidecars, prompts):
    """A fresh pair's scrapes before and after: 2 transfers, a refused submit, a FetchKV
    not found, one past its deadline, one cancelled by its client, 2 status calls."""
    p = Pair.start(sidecars)
    before = {"decoder": scrape(p.decoder), "encoder": scrape(p.encoder)}
    ids, kv = prompts("short")
    done = [rid("g1"), rid("g2")]
    for request_id in done:
        p.roundtrip(request_id, kv, ids)
    with pytest.raises(RpcFailed) as ei:
        p.enc.submit(rid("g3"), kv, ids, p.daddr, "other-model", timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(RpcFailed) as ei:
        p.dec.fetch(rid("g4"), wait=0.1, timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(RpcFailed) as ei:  # waits 30 s for a transfer; the client's deadline is 0.5 s
        p.dec.fetch(rid("g5"), wait=30, timeout=0.5)
    assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    waiting = fetch_stub(p.dec.channel)(fetch_request(rid("g6"), 30, False), timeout=WAIT)
    fetch = lab("server_stream", DEC, "FetchKV")
    wait_until(lambda: value(samples(scrape(p.decoder)), "grpc_server_started_total", **fetch)
               - value(samples(before["decoder"]), "grpc_server_started_total", **fetch) == 5,
               what="the fifth FetchKV started")
    waiting.cancel()
    stub = dgrpc.DecoderServiceStub(p.dec.channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.GetTransferStatus(dpb.GetTransferStatusRequest(request_id=rid("g7")), timeout=WAIT)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    stub.GetTransferStatus(dpb.GetTransferStatusRequest(request_id=done[0]), timeout=WAIT)
    wait_until(lambda: sum(v for (n, lb), v in samples(scrape(p.decoder)).items()
                           if n == "grpc_server_handled_total" and dict(lb)["grpc_method"] == "FetchKV") == 5,
               what="five FetchKV calls handled")
    after = {"decoder": scrape(p.decoder), "encoder": scrape(p.encoder)}
    yield p, before, after, len(submit_list(rid("g1"), kv, ids, p.daddr, MODEL))
    p.stop()


def test_series_exist_at_zero_before_traffic(traffic):
    _, before, _, _ = traffic
    dec, enc = samples(before["decoder"]), samples(before["encoder"])
    for method, kind in (("Transfer", "bidi_stream"), ("FetchKV", "server_stream"), ("CancelTransfer", "unary"),
                         ("GetTransferStatus", "unary")):
        for code in CODES:
            assert (("grpc_server_handled_total", frozenset(lab(kind, DEC, method, grpc_code=code).items()))
                    in dec), (method, code)
            assert value(dec, "grpc_server_handled_total", **lab(kind, DEC, method, grpc_code=code)) == 0
        assert value(dec, "grpc_server_started_total", **lab(kind, DEC, method)) == 0
        assert value(dec, "grpc_server_handling_seconds_count", **lab(kind, DEC, method)) == 0
    assert (("grpc_server_handled_total", frozenset(lab("client_stream", ENC, "Submit", grpc_code="OK").items()))
            in enc)
    # each sidecar declares its own service only
    assert not any(dict(lb).get("grpc_service") == ENC for (_, lb) in dec)


def _deltas(before: str, after: str, name: str) -> dict[tuple[str, ...], float]:
    """{label values: after - before} of a family's non-zero changes."""
    b, a = samples(before), samples(after)
    out = {}
    for (n, lb), v in a.items():
        if n == name and v - b.get((n, lb), 0.0):
            d = dict(lb)
            out[tuple(d[k] for k in ("grpc_type", "grpc_service", "grpc_method", "grpc_code") if k in d)] = \
                v - b.get((n, lb), 0.0)
    return out


def test_handled_by_method_and_code(traffic):
    _, before, after, _ = traffic
    assert _deltas(before["encoder"], after["encoder"], "grpc_server_handled_total") == {
        ("client_stream", ENC, "Submit", "OK"): 2,
        ("client_stream", ENC, "Submit", "FailedPrecondition"): 1,
    }
    assert _deltas(before["decoder"], after["decoder"], "grpc_server_handled_total") == {
        ("bidi_stream", DEC, "Transfer", "OK"): 2,
        ("server_stream", DEC, "FetchKV", "OK"): 2,
        ("server_stream", DEC, "FetchKV", "NotFound"): 1,
        ("server_stream", DEC, "FetchKV", "DeadlineExceeded"): 1,
        ("server_stream", DEC, "FetchKV", "Canceled"): 1,
        ("unary", DEC, "GetTransferStatus", "NotFound"): 1,
        ("unary", DEC, "GetTransferStatus", "OK"): 1,
    }


@pytest.mark.parametrize("role", ["encoder", "decoder"])
def test_started_and_histogram_agree_with_handled(traffic, role):
    _, before, after, _ = traffic
    handled: dict[tuple[str, ...], float] = {}
    for key, v in _deltas(before[role], after[role], "grpc_server_handled_total").items():
        handled[key[:3]] = handled.get(key[:3], 0) + v
    assert _deltas(before[role], after[role], "grpc_server_started_total") == handled
    assert _deltas(before[role], after[role], "grpc_server_handling_seconds_count") == handled
    a = samples(after[role])
    for key in handled:  # the cumulative buckets end at +Inf with the count
        labels = dict(zip(("grpc_type", "grpc_service", "grpc_method"), key, strict=True))
        assert value(a, "grpc_server_handling_seconds_bucket", **labels, le="+Inf") == \
            value(a, "grpc_server_handling_seconds_count", **labels)


def test_messages_counted(traffic):
    _, before, after, submit_msgs = traffic
    enc = _deltas(before["encoder"], after["encoder"], "grpc_server_msg_received_total")
    # two whole submits; the refused one was read at least up to its header
    assert 2 * submit_msgs + 1 <= enc[("client_stream", ENC, "Submit")] <= 3 * submit_msgs
    assert _deltas(before["encoder"], after["encoder"], "grpc_server_msg_sent_total") == {
        ("client_stream", ENC, "Submit"): 2}
    dec_sent = _deltas(before["decoder"], after["decoder"], "grpc_server_msg_sent_total")
    # a short prompt's layer fits one message: 30 layers and FetchKVDone per fetch
    assert dec_sent[("server_stream", DEC, "FetchKV")] == 2 * 31
    assert dec_sent[("unary", DEC, "GetTransferStatus")] == 1  # the failed one sent nothing
    dec_recv = _deltas(before["decoder"], after["decoder"], "grpc_server_msg_received_total")
    assert dec_recv[("server_stream", DEC, "FetchKV")] == 5
    assert dec_recv[("unary", DEC, "GetTransferStatus")] == 2
    assert dec_recv[("bidi_stream", DEC, "Transfer")] >= 2 * 2  # a header and chunks per transfer


def test_server_stop_counts_the_calls_it_cancels(sidecars):
    dec, daddr = sidecars.start("decoder")
    channel = grpc.insecure_channel(daddr)
    try:
        call = fetch_stub(channel)(fetch_request(rid("stop"), 30, False), timeout=WAIT)
        fetch = lab("server_stream", DEC, "FetchKV")
        wait_until(lambda: value(samples(scrape(dec)), "grpc_server_started_total", **fetch) == 1,
                   what="FetchKV started")
        sidecars.stop(dec, 0.1)
        with pytest.raises(grpc.RpcError):
            list(call)
        snap = samples(generate_latest(dec.metrics.registry).decode())
        ended = {dict(lb)["grpc_code"]: v for (n, lb), v in snap.items()
                 if n == "grpc_server_handled_total" and dict(lb)["grpc_method"] == "FetchKV" and v}
        assert ended == {"Canceled": 1}
    finally:
        channel.close()
