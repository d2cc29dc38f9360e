"""EncoderService.Submit on malformed input: every bad header field or layer
order ends the call with INVALID_ARGUMENT (and a message naming the problem),
whatever had started at the decoder ends too, and no memory stays held."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from server_helpers import MODEL, WAIT, budgets_drain, raw_submit, rid, status_or_none, submit_list, wait_until

from speckv.client.client import RpcFailed
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import encoder_pb2 as epb

S = dpb.TransferState
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def reqs(pair, prompts):
    """A fresh valid request stream of the short prompt: [header, layer 0, ..., layer 29]."""
    ids, kv = prompts("short")
    return submit_list(rid("bad"), kv, ids, pair.daddr)


def _header(reqs) -> epb.SubmitHeader:
    assert reqs[0].WhichOneof("kind") == "header"
    return reqs[0].header


def _fails(pair, reqs, code=INVALID, *words: str) -> grpc.RpcError:
    e = raw_submit(pair.eaddr, reqs)
    assert e.code() == code, (e.code(), e.details())
    for w in words:
        assert w in e.details(), (w, e.details())
    budgets_drain(pair)
    return e


def test_empty_stream(pair):
    _fails(pair, [], INVALID, "first message", "SubmitHeader")


def test_first_message_not_a_header(pair, reqs):
    _fails(pair, reqs[1:], INVALID, "first message", "SubmitHeader")


@pytest.mark.parametrize("field,value,words", [
    ("kv", 3, ("not a KV shape",)),
    ("layers", 0, ("not a KV shape",)),
    ("head_dim", 0, ("not a KV shape",)),
    ("layers", 29, ("does not fit", "layers 30")),
    ("kv_heads", 4, ("does not fit", "kv_heads 3")),
])
def test_bad_shape(pair, reqs, field, value, words):
    setattr(_header(reqs).shape, field, value)
    _fails(pair, reqs[:1], INVALID, *words)


def test_dtype_unspecified(pair, reqs):
    _header(reqs).dtype = pb.DTYPE_UNSPECIFIED
    _fails(pair, reqs[:1], INVALID, "dtype 0")


def test_token_count_differs_from_shape(pair, reqs):
    h = _header(reqs)
    h.shape.tokens += 1
    _fails(pair, reqs[:1], INVALID, f"{h.shape.tokens} tokens", f"{h.shape.tokens - 1} prompt token ids")


def test_token_id_outside_the_vocabulary(pair, reqs):
    _header(reqs).prompt_token_ids[0] = 10 ** 9
    _fails(pair, reqs[:1], INVALID, "prompt token ids must lie in")


def test_no_prompt_tokens(pair, reqs):
    h = _header(reqs)
    del h.prompt_token_ids[:]
    h.shape.tokens = 0
    e = _fails(pair, reqs[:1], grpc.StatusCode.RESOURCE_EXHAUSTED, "0 tokens")
    assert "1 to" in e.details()


def test_zero_token_kv_from_the_client(pair):
    """The client sends a 0-token KV (its one empty part per layer); the encoder refuses it."""
    kv = np.zeros((30, 2, 3, 0, 64), np.uint16)
    with pytest.raises(RpcFailed) as ei:
        pair.enc.submit(rid("zero"), kv, np.zeros(0, np.int64), pair.daddr, MODEL, timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "0 tokens" in ei.value.details
    budgets_drain(pair)


def test_empty_request_id(pair, reqs):
    _header(reqs).request_id = ""
    _fails(pair, reqs[:1], INVALID, "request_id")


def test_overlong_request_id(pair, reqs):
    _header(reqs).request_id = "x" * 257
    _fails(pair, reqs[:1], INVALID, "request_id")


@pytest.mark.parametrize("address", ["", "localhost"])
def test_bad_decoder_address(pair, reqs, address):
    _header(reqs).decoder_address = address
    _fails(pair, reqs[:1], INVALID, "decoder_address")


def test_unknown_encoding(pair, reqs):
    _header(reqs).encoding = 7
    _fails(pair, reqs[:1], INVALID, "encoding 7")


def test_fp8_header_with_bf16_sized_layers(pair, reqs):
    _header(reqs).dtype = pb.DTYPE_FP8_E4M3
    _fails(pair, reqs[:2], INVALID, "layer 0")


# -- the layer stream (the decoder call is open by then: it must end as well) -------------

def _fails_after_open(pair, reqs, *words: str) -> None:
    r = _header(reqs).request_id
    _fails(pair, reqs, INVALID, *words)
    wait_until(lambda: (s := status_or_none(pair.dec, r)) is None or s.state != S.TRANSFER_STATE_RECEIVING,
               what=f"{r} to end at the decoder")
    st = status_or_none(pair.dec, r)
    assert st is None or st.state in (S.TRANSFER_STATE_CANCELLED, S.TRANSFER_STATE_FAILED), st


def test_layers_out_of_order(pair, reqs):
    _fails_after_open(pair, [reqs[0], reqs[2], reqs[1]] + reqs[3:], "got layer 1, expected layer 0")


def test_layer_repeated(pair, reqs):
    _fails_after_open(pair, reqs[:2] + [reqs[1]] + reqs[2:], "got layer 0, expected layer 1")


def test_second_header(pair, reqs):
    _fails_after_open(pair, reqs[:3] + [reqs[0]] + reqs[3:], "only layer messages")


def test_stream_ends_early(pair, reqs):
    _fails_after_open(pair, reqs[:5], "stream ended after 4 of 30 layers")


def test_layer_with_wrong_byte_count(pair, reqs):
    bad = epb.SubmitRequest()
    bad.CopyFrom(reqs[1])
    bad.layer.data = bad.layer.data[:-2]
    _fails_after_open(pair, [reqs[0], bad] + reqs[2:], "layer 0", "parts cover")


def test_layer_part_at_wrong_offset(pair, reqs):
    first = epb.SubmitRequest()
    first.CopyFrom(reqs[1])
    n = first.layer.layer_bytes
    second = epb.SubmitRequest()
    second.CopyFrom(first)
    first.layer.part_count = second.layer.part_count = 2
    first.layer.data = first.layer.data[: n // 2]
    second.layer.part_index = 1
    second.layer.byte_offset = n // 2 + 2  # a gap
    second.layer.data = second.layer.data[n // 2 + 2:]
    _fails_after_open(pair, [reqs[0], first, second] + reqs[2:], "does not continue the layer")


def test_layer_with_a_different_shape(pair, reqs):
    bad = epb.SubmitRequest()
    bad.CopyFrom(reqs[1])
    bad.layer.shape.tokens += 1
    _fails_after_open(pair, [reqs[0], bad] + reqs[2:], "dtype/shape differ")


def test_bf16_layer_with_fp8_scales(pair, reqs):
    bad = epb.SubmitRequest()
    bad.CopyFrom(reqs[1])
    bad.layer.fp8_scales.extend([1.0, 1.0])
    _fails_after_open(pair, [reqs[0], bad] + reqs[2:], "BF16 layers carry no fp8_scales")


def test_deprecated_header_fp8_scales_are_refused(pair, reqs):
    """SubmitHeader.fp8_scales was documented but ignored; now setting it is an error."""
    _header(reqs).fp8_scales.extend([1.0, 1.0])
    _fails(pair, reqs[:1], INVALID, "fp8_scales is deprecated")


def test_valid_stream_after_all_that(pair, prompts):
    """The encoder still works after the failures above (no leaked slot or budget)."""
    ids, kv = prompts("short")
    pair.roundtrip(rid("after-bad"), kv, ids)
    wait_until(lambda: pair.encoder.service.active == 0, what="no Submit in progress")
    budgets_drain(pair)
