"""Failures end with one precise gRPC status, leave no transfer half alive and
give all their memory back: cancellation (client and CancelTransfer), unknown
ids, deadlines, pins, models, unreachable decoders."""

from __future__ import annotations

import time

import grpc
import pytest
from server_helpers import (
    MODEL,
    WAIT,
    Gate,
    budgets_drain,
    raw_submit_future,
    raw_transfer,
    rid,
    status_or_none,
    stored_stream,
    submit_list,
    wait_until,
)

from speckv.client.client import RpcFailed
from speckv.coder.codec import bf16_bits
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb

S = dpb.TransferState


def _blocked_submit(pair, prompts, prefix: str, layers: int = 8):
    """A Submit whose engine stops after ``layers`` layers; returns (request id, gate,
    future, channel) once the decoder has received every chunk of those layers."""
    ids, kv = prompts("medium")
    r = rid(prefix)
    gate = Gate(submit_list(r, kv, ids, pair.daddr), after=1 + layers)
    fut, ch = raw_submit_future(pair.eaddr, gate)
    assert gate.reached.wait(WAIT)
    st = wait_until(lambda: (s := status_or_none(pair.dec, r)) is not None and s.chunks_received >= layers // 2
                    and s, what=f"{r}: {layers // 2} chunks at the decoder")
    assert st.state == S.TRANSFER_STATE_RECEIVING and st.chunks_total == 15
    assert not fut.done()
    return r, gate, fut, ch


def test_client_cancel_mid_stream_cancels_the_decoder_transfer(pair, prompts):
    r, gate, fut, ch = _blocked_submit(pair, prompts, "engine-abort")
    try:
        # the chunks wait at the decoder (no fetcher yet): it holds their memory
        assert pair.decoder.service.budget.used > 0
        assert fut.cancel()
        with pytest.raises(grpc.FutureCancelledError):
            fut.result(timeout=WAIT)
        st = wait_until(lambda: (s := pair.dec.status(r)).state != S.TRANSFER_STATE_RECEIVING and s,
                        what="the decoder transfer to end")
        # grpc.aio may hand the decoder's handler the cancelled call's end as a plain end of
        # stream before it cancels the handler: then the transfer FAILED as cut short
        assert (st.state, st.status.code) in {
            (S.TRANSFER_STATE_CANCELLED, pb.STATUS_CODE_CANCELLED),
            (S.TRANSFER_STATE_FAILED, pb.STATUS_CODE_INVALID_ARGUMENT)}, st
        if st.state == S.TRANSFER_STATE_FAILED:
            assert "stream ended after" in st.status.message
        with pytest.raises(RpcFailed) as ei:
            pair.dec.fetch(r, wait=1, timeout=WAIT)
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert S.Name(st.state) in ei.value.details and st.status.message in ei.value.details
        budgets_drain(pair)
    finally:
        gate.open()
        ch.close()


def test_cancel_transfer_rpc_on_a_live_transfer(pair, prompts):
    r, gate, fut, ch = _blocked_submit(pair, prompts, "rpc-cancel")
    try:
        st = pair.dec.cancel(r)
        assert st.state == S.TRANSFER_STATE_CANCELLED
        assert st.status.code == pb.STATUS_CODE_CANCELLED and "CancelTransfer" in st.status.message
        assert st.chunks_received >= 4 and st.chunks_total == 15
        # the encoder hears it at once (not at its deadline) and ends the engine's Submit
        with pytest.raises(grpc.RpcError) as ei:
            fut.result(timeout=10)
        assert ei.value.code() == grpc.StatusCode.CANCELLED
        assert ei.value.details() == "decoder: cancelled by CancelTransfer"
        assert pair.dec.cancel(r).state == S.TRANSFER_STATE_CANCELLED  # idempotent
        with pytest.raises(RpcFailed) as ei2:
            pair.dec.fetch(r, wait=1, timeout=WAIT)
        assert ei2.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "cancelled by CancelTransfer" in ei2.value.details
        budgets_drain(pair)
    finally:
        gate.open()
        ch.close()


def test_cancel_transfer_frees_a_decoded_unfetched_kv(pair, prompts):
    ids, kv = prompts("short")
    r = rid("ready-cancel")
    res = pair.enc.submit(r, kv, ids, pair.daddr, MODEL, timeout=WAIT)  # no fetcher: fits the default cap
    st = pair.dec.status(r)
    assert st.state == S.TRANSFER_STATE_READY and st.chunks_decoded == 15
    assert pair.decoder.service.budget.used == res.raw_bytes == bf16_bits(kv).nbytes
    st = pair.dec.cancel(r)
    assert st.state == S.TRANSFER_STATE_CANCELLED
    assert pair.decoder.service.budget.used == 0
    with pytest.raises(RpcFailed) as ei:
        pair.dec.fetch(r, wait=1, timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_cancel_of_a_finished_transfer_keeps_its_state(pair, prompts):
    ids, kv = prompts("short")
    r = rid("fetched-cancel")
    pair.roundtrip(r, kv, ids)
    assert pair.dec.cancel(r).state == S.TRANSFER_STATE_FETCHED


@pytest.mark.parametrize("call", ["fetch", "status", "cancel"])
def test_unknown_request_id_is_not_found(pair, call):
    r = rid("unknown")
    t0 = time.monotonic()
    with pytest.raises(RpcFailed) as ei:
        if call == "fetch":
            pair.dec.fetch(r, wait=0.2, timeout=WAIT)
        else:
            getattr(pair.dec, call)(r, timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.NOT_FOUND
    assert repr(r) in ei.value.details
    assert time.monotonic() - t0 < 5


def test_submit_deadline_exceeded(pair, prompts):
    ids, kv = prompts("medium")
    # NOTE: a prompt no sidecar's mu cache holds: its predictor pass outlasts the deadline (a
    # cached one moves this KV in well under 50 ms)
    ids = ids.copy()
    ids[0] ^= 1
    r = rid("deadline")
    t0 = time.monotonic()
    with pytest.raises(RpcFailed) as ei:
        pair.enc.submit(r, kv, ids, pair.daddr, MODEL, timeout=0.05)
    assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5
    # whatever reached the decoder ends too (the encoder's call inherits the deadline)
    wait_until(lambda: (s := status_or_none(pair.dec, r)) is None or s.state != S.TRANSFER_STATE_RECEIVING,
               what="the decoder side to end")
    assert status_or_none(pair.dec, r) is None or pair.dec.status(r).state in (
        S.TRANSFER_STATE_CANCELLED, S.TRANSFER_STATE_FAILED)
    budgets_drain(pair)


def test_fetch_deadline_shorter_than_wait(pair):
    t0 = time.monotonic()
    with pytest.raises(RpcFailed) as ei:
        pair.dec.fetch(rid("fetch-deadline"), wait=10, timeout=0.3)
    assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5


def test_expected_pin_mismatch_is_failed_precondition(pair, prompts, embedded_session):
    ids, kv = prompts("short")
    other = "ab" * 32
    assert other != embedded_session.predictor.pin
    with pytest.raises(RpcFailed) as ei:
        pair.enc.submit(rid("pin"), kv, ids, pair.daddr, MODEL, expected_pin=other, timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert ei.value.reason == "PIN_MISMATCH"  # google.rpc.ErrorInfo from the status details
    assert "pin" in ei.value.details and other in ei.value.details
    budgets_drain(pair)


def test_transfer_with_wrong_predictor_pin_is_failed_precondition(pair, prompts):
    ids, kv = prompts("short")
    codec = pair.decoder.service.rt.codec
    r = rid("raw-pin")
    header, _ = stored_stream(codec, r, bf16_bits(kv), ids, pin=bytes(32))
    h = codec.stream_header(True, kv.shape, ids, 2, stored=False)  # speckv: the pin matters
    from dataclasses import replace

    from speckv.coder import container as ct
    from speckv.status import error_details

    header.header.header_record = ct.pack_header(replace(h, pin=bytes(32)))  # the same other pin twice
    with pytest.raises(grpc.RpcError) as ei:
        raw_transfer(pair.daddr, [header])
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_details(ei.value) == ("PIN_MISMATCH", None)
    assert "predictor" in ei.value.details() and "0" * 64 in ei.value.details()
    assert status_or_none(pair.dec, r) is None  # rejected before it was registered
    # the two copies of the pin (TransferHeader, header record) must agree
    header.header.header_record = ct.pack_header(h)
    with pytest.raises(grpc.RpcError) as ei:
        raw_transfer(pair.daddr, [header])
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "disagrees with the header record's pin" in ei.value.details()


def test_model_not_served_is_failed_precondition(pair, prompts):
    ids, kv = prompts("short")
    with pytest.raises(RpcFailed) as ei:
        pair.enc.submit(rid("model"), kv, ids, pair.daddr, "Llama-3-70B", timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert ei.value.reason == "MODEL_MISMATCH"  # not PIN_MISMATCH (the old in-band misreport)
    assert "Llama-3-70B" in ei.value.details and MODEL in ei.value.details


def test_unreachable_decoder_is_unavailable(pair, prompts):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ids, kv = prompts("short")
    t0 = time.monotonic()
    with pytest.raises(RpcFailed) as ei:
        pair.enc.submit(rid("unreachable"), kv, ids, f"127.0.0.1:{port}", MODEL, timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    assert ei.value.details.startswith("decoder: ")
    assert time.monotonic() - t0 < 10
    budgets_drain(pair)
