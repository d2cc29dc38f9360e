"""A Submit fed one layer at a time (EncoderClient.open_submit / SubmitStream) through
real sidecars: the header reaches the decoder before any layer, layers given as
torch.bfloat16 or uint16 numpy (FP8: codes and scales) arrive bit for bit, refused
layers leave the stream intact, refusals at open start no call, cancel() ends the call
CANCELLED and the decoder keeps no transfer, and a call the encoder rejects fails every
later send_layer at once. Every wait is bounded, and the thread that feeds a stream to
grpc always ends."""

from __future__ import annotations

import sys

import grpc
import numpy as np
import pytest
import torch
from server_helpers import (
    FETCH_WAIT,
    MODEL,
    WAIT,
    assert_same_kv,
    budgets_drain,
    rid,
    status_or_none,
    wait_until,
)

from speckv.client.client import RpcFailed
from speckv.client.stream import SubmitStream
from speckv.coder.codec import bf16_bits
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb

S = dpb.TransferState


def feeding() -> int:
    """Threads now inside a SubmitStream's request iterator (grpc's, reading what send_layer queued)."""
    n = 0
    for frame in sys._current_frames().values():
        while frame is not None and frame.f_code is not SubmitStream._requests.__code__:
            frame = frame.f_back
        n += frame is not None
    return n


def open_stream(pair, r: str, kv, ids, model: str = MODEL, **kw) -> SubmitStream:
    return pair.enc.open_submit(r, tuple(kv.shape), ids, pair.daddr, model, timeout=WAIT, **kw)


def test_layer_by_layer_bit_exact(pair, prompts):
    ids, kv = prompts("medium")
    bits = bf16_bits(kv)
    r = rid("stream")
    s = open_stream(pair, r, kv, ids)
    ended = []
    s.add_done_callback(ended.append)
    for i in range(kv.shape[0]):
        assert s.layers_sent == i
        s.send_layer(i, kv[i] if i % 3 else bits[i].copy())  # torch.bfloat16 and uint16 numpy
    assert s.layers_sent == 30
    res = s.result(timeout=WAIT)
    assert s.done()
    assert res.raw_bytes == bits.nbytes == kv.numel() * 2
    assert res.chunks == 15 and res.encoding == "speckv" and 0 < res.wire_bytes < res.raw_bytes
    got = pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT)
    assert got.dtype == np.uint16 and got.shape == bits.shape
    assert np.array_equal(got, bits)
    st = pair.dec.status(r)
    assert st.state == S.TRANSFER_STATE_FETCHED and (st.raw_bytes, st.wire_bytes) == (res.raw_bytes, res.wire_bytes)
    wait_until(lambda: ended == [s], WAIT, what="the done callback")


def test_stored_stream_bit_exact(pair, prompts):
    ids, kv = prompts("short")
    r = rid("stream-stored")
    s = open_stream(pair, r, kv, ids, encoding="stored")
    for i in range(kv.shape[0]):
        s.send_layer(i, kv[i])
    res = s.result(timeout=WAIT)
    assert res.encoding == "stored" and res.wire_bytes > res.raw_bytes == kv.numel() * 2
    assert_same_kv(pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT), kv)


def test_fp8_stream_bit_exact(pair, fp8_kv):
    ids, kv = fp8_kv("short")
    r = rid("stream-fp8")
    s = pair.enc.open_submit(r, kv.codes.shape, ids, pair.daddr, MODEL, dtype="fp8_e4m3", timeout=WAIT)
    with pytest.raises(ValueError, match="two scales"):
        s.send_layer(0, kv.codes[0])  # FP8 layers need their scales
    with pytest.raises(ValueError, match="must not be NaN"):
        s.send_layer(0, kv.codes[0], np.float32([np.nan, 1.0]))
    with pytest.raises(TypeError, match="uint8"):
        s.send_layer(0, kv.codes[0].astype(np.uint16), kv.scales[0])
    assert s.layers_sent == 0
    for i in range(kv.codes.shape[0]):
        s.send_layer(i, kv.codes[i], kv.scales[i])
    res = s.result(timeout=WAIT)
    assert res.raw_bytes == kv.codes.nbytes
    assert_same_kv(pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT), kv)


def test_header_reaches_the_decoder_before_any_layer(pair, prompts):
    ids, kv = prompts("short")
    r = rid("stream-early")
    s = open_stream(pair, r, kv, ids)
    st = wait_until(lambda: status_or_none(pair.dec, r), WAIT, what="the decoder to know the transfer")
    assert st.state == S.TRANSFER_STATE_RECEIVING
    assert (st.chunks_received, st.chunks_total) == (0, 15)
    assert not s.done()
    for i in range(kv.shape[0]):
        s.send_layer(i, kv[i])
    s.result(timeout=WAIT)
    assert_same_kv(pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT), kv)


def test_refused_layers_leave_the_stream_intact(pair, prompts):
    ids, kv = prompts("short")
    bits = bf16_bits(kv)
    _, _, heads, tokens, dim = kv.shape
    r = rid("stream-refused")
    s = open_stream(pair, r, kv, ids)
    with pytest.raises(ValueError, match="layer 1 out of order: layer 0 is next"):
        s.send_layer(1, kv[1])
    s.send_layer(0, kv[0])
    with pytest.raises(ValueError, match="layer 0 out of order: layer 1 is next"):
        s.send_layer(0, kv[0])  # again
    with pytest.raises(ValueError, match="layer 2 out of order"):
        s.send_layer(2, kv[2])
    for wrong in (np.zeros((2, heads, tokens + 1, dim), np.uint16), np.zeros((2, heads - 1, tokens, dim), np.uint16),
                  np.zeros((heads, tokens, dim), np.uint16), bits[1:3]):
        with pytest.raises(ValueError, match="shape"):
            s.send_layer(1, wrong)
    with pytest.raises(TypeError):
        s.send_layer(1, kv[1].float())
    with pytest.raises(TypeError):
        s.send_layer(1, bits[1].astype(np.int32))
    with pytest.raises(ValueError, match="scales belong to FP8"):
        s.send_layer(1, kv[1], np.float32([1.0, 1.0]))  # a BF16 stream takes no scales
    assert s.layers_sent == 1 and not s.done()
    for i in range(1, kv.shape[0]):
        s.send_layer(i, bits[i])
    for layer in (30, 29, 0):
        with pytest.raises(ValueError, match=f"layer {layer}: all 30 layers were sent"):
            s.send_layer(layer, bits[0])
    assert s.layers_sent == 30
    assert s.result(timeout=WAIT).raw_bytes == bits.nbytes
    assert_same_kv(pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT), kv)


@pytest.mark.parametrize("shape, kw, match", [
    ((30, 2, 3, 12), {}, "shape must be"),
    ((30, 2, 3, 12, 64, 1), {}, "shape must be"),
    ((30, 1, 3, 12, 64), {}, "shape must be"),
    ((30, 2, -1, 12, 64), {}, "shape must be"),
    ((30, 2, 3, 12, 64), {"dtype": "fp16"}, "dtype must be one of"),
    ((30, 2, 3, 12, 64), {"encoding": "zstd"}, "encoding must be one of"),
])
def test_open_refuses_a_bad_header_before_any_call(pair, prompts, shape, kw, match):
    ids, _ = prompts("short")
    r = rid("stream-open")
    before = feeding()
    with pytest.raises(ValueError, match=match):
        pair.enc.open_submit(r, shape, ids, pair.daddr, MODEL, timeout=WAIT, **kw)
    assert feeding() == before
    assert status_or_none(pair.dec, r) is None


def test_cancel_mid_stream(pair, prompts):
    ids, kv = prompts("medium")
    r = rid("stream-cancel")
    before = feeding()
    s = open_stream(pair, r, kv, ids)
    for i in range(4):
        s.send_layer(i, kv[i])
    wait_until(lambda: (st := status_or_none(pair.dec, r)) is not None and st.chunks_received >= 2, WAIT,
               what="two chunks at the decoder")
    with pytest.raises(RpcFailed) as ei:
        s.result(timeout=0.05)  # still waiting for its layers
    assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not s.done()
    s.cancel()
    with pytest.raises(RpcFailed) as ei:
        s.result(timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.CANCELLED
    assert s.done()
    with pytest.raises(RpcFailed) as ei:
        s.send_layer(4, kv[4])
    assert ei.value.code == grpc.StatusCode.CANCELLED
    st = wait_until(lambda: (st := pair.dec.status(r, timeout=5)).state != S.TRANSFER_STATE_RECEIVING and st, WAIT,
                    what="the decoder transfer to end")
    # as test_errors: the decoder may see the cancelled call's end as a stream cut short first
    assert (st.state, st.status.code) in {
        (S.TRANSFER_STATE_CANCELLED, pb.STATUS_CODE_CANCELLED),
        (S.TRANSFER_STATE_FAILED, pb.STATUS_CODE_INVALID_ARGUMENT)}, st
    assert st.chunks_received < st.chunks_total == 15
    with pytest.raises(RpcFailed) as ei:
        pair.dec.fetch(r, wait=1, timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    wait_until(lambda: feeding() == before, WAIT, what="the request iterator to end")
    budgets_drain(pair)


def test_cancel_is_cancelled_even_when_the_caller_stalls(pair, prompts, monkeypatch):
    """cancel() ends the call before it ends the request stream: a caller descheduled in
    between must not let the encoder see a stream cut short (INVALID_ARGUMENT) first."""
    ids, kv = prompts("short")
    r = rid("stream-stall")
    s = open_stream(pair, r, kv, ids)
    for i in range(4):
        s.send_layer(i, kv[i])
    wait_until(lambda: (st := status_or_none(pair.dec, r)) is not None and st.chunks_received >= 2, WAIT,
               what="two chunks at the decoder")
    put = s._queue.put

    def stalling_put(item, *a, **kw):
        put(item, *a, **kw)
        if item is None:  # the end of the request stream: stall until the call has ended, whichever way
            wait_until(s.done, 10, what="the call to end")

    monkeypatch.setattr(s._queue, "put", stalling_put)
    s.cancel()
    with pytest.raises(RpcFailed) as ei:
        s.result(timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.CANCELLED, ei.value
    budgets_drain(pair)


def test_rejected_header_fails_the_stream(pair, prompts):
    ids, kv = prompts("short")
    r = rid("stream-rejected")
    before = feeding()
    s = open_stream(pair, r, kv, ids, model="not-this-model")
    with pytest.raises(RpcFailed) as ei:
        s.result(timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "'not-this-model' is not served here" in ei.value.details
    assert s.done()
    for _ in range(2):  # at once, every time
        with pytest.raises(RpcFailed) as ei:
            s.send_layer(0, kv[0])
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert s.layers_sent == 0
    assert status_or_none(pair.dec, r) is None  # the encoder never called the decoder
    wait_until(lambda: feeding() == before, WAIT, what="the request iterator to end")


def test_deadline_ends_a_stream_whose_layers_never_come(pair, prompts):
    ids, kv = prompts("short")
    r = rid("stream-deadline")
    before = feeding()
    s = pair.enc.open_submit(r, tuple(kv.shape), ids, pair.daddr, MODEL, timeout=2.0)
    s.send_layer(0, torch.clone(kv[0]))
    with pytest.raises(RpcFailed) as ei:
        s.result(timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(RpcFailed) as ei:
        s.send_layer(1, kv[1])
    assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: feeding() == before, WAIT, what="the request iterator to end")
    wait_until(lambda: (st := status_or_none(pair.dec, r)) is None or st.state != S.TRANSFER_STATE_RECEIVING, WAIT,
               what="the decoder side to end")
    budgets_drain(pair)
