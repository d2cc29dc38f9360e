"""frames: pre-serialised bulk messages are byte for byte what protobuf writes, and the
payload split off a received message parses to the same message (anything unusual is
left to upb whole)."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from speckv import frames
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import encoder_pb2 as epb

SIZES = [0, 1, 127, 128, 16_383, 16_384, 2 << 20]
SHAPE = pb.KVShape(layers=30, kv=2, kv_heads=3, tokens=2048, head_dim=64)


def _data(n: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("reason", ["", "mu_mismatch"])
def test_chunk_part_is_the_transfer_request(n, reason):
    data = _data(n)
    for off in (0, 300, 1 << 40):
        views = [memoryview(data)[:n // 3], memoryview(data)[n // 3:]]
        want = dpb.TransferRequest(chunk=dpb.Chunk(index=7, record=data, byte_offset=off, record_bytes=n + 9,
                                                   stored_reason=reason)).SerializeToString()
        assert frames.chunk_part(7, views, off, n + 9, reason) == want


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scales", [[], [1.5, -0.0]])
@pytest.mark.parametrize("tokens", [None, (0, 1), (256, 7)])
def test_layer_part_is_the_submit_and_fetch_message(n, scales, tokens):
    data = _data(n)
    head = pb.KVLayer(layer=3, dtype=pb.DTYPE_BF16, shape=SHAPE, part_index=1, part_count=2, byte_offset=5,
                      layer_bytes=n)
    full = pb.KVLayer(layer=3, dtype=pb.DTYPE_BF16, shape=SHAPE, part_index=1, part_count=2, byte_offset=5,
                      layer_bytes=n, data=data, fp8_scales=scales)
    tail = pb.KVLayer(fp8_scales=scales) if scales or tokens else None
    if tokens:
        full.token_start, full.token_count = tokens
        assert tail is not None
        tail.token_start, tail.token_count = tokens
    inner = frames.layer_part(head, memoryview(data), tail)
    assert frames.join(frames.submessage(2, inner)) == epb.SubmitRequest(layer=full).SerializeToString()
    for digest in (0, pb.DIGEST_ALGORITHM_XXH3_128):
        got = frames.join(frames.submessage(1, inner, dpb.FetchKVResponse(digest=digest)))
        assert got == dpb.FetchKVResponse(layer=full, digest=digest).SerializeToString()


def test_record_slices():
    pieces = [memoryview(b"abc"), memoryview(b""), memoryview(b"defgh"), memoryview(b"ij")]
    got = [(o, n, b"".join(v)) for o, n, v in frames.record_slices(pieces, 4)]
    assert got == [(0, 4, b"abcd"), (4, 4, b"efgh"), (8, 2, b"ij")]
    assert [(o, n, b"".join(v)) for o, n, v in frames.record_slices(pieces, 100)] == [(0, 10, b"abcdefghij")]
    assert list(frames.record_slices([memoryview(b"")], 4)) == [(0, 0, [])]


def test_serialize_passes_bytes_through():
    m = dpb.FetchKVRequest(request_id="x")
    assert frames.serialize(m) == m.SerializeToString() and frames.serialize(b"raw") == b"raw"


def _submit(data: bytes, scales=()) -> epb.SubmitRequest:
    return epb.SubmitRequest(layer=pb.KVLayer(layer=2, dtype=pb.DTYPE_FP8_E4M3, shape=SHAPE, part_index=0,
                                              part_count=1, byte_offset=0, layer_bytes=len(data), data=data,
                                              fp8_scales=list(scales)))


@pytest.mark.parametrize("n", [1, 200, 70_000])
def test_split_parses_the_same_message(n):
    data = _data(n)
    m = _submit(data, [0.25, 4.0])
    p = frames.parse(epb.SubmitRequest, m.SerializeToString())
    assert isinstance(p, frames.Parsed) and bytes(p.payload) == data and p.payload.readonly
    assert p.layer.data == b"" and p.WhichOneof("kind") == "layer"
    p.msg.layer.data = bytes(p.payload)
    assert p.msg == m
    t = dpb.TransferRequest(chunk=dpb.Chunk(index=1, record=data, byte_offset=9, record_bytes=n + 9))
    q = frames.parse(dpb.TransferRequest, t.SerializeToString())
    assert bytes(q.payload) == data and q.chunk.record == b"" and q.chunk.record_bytes == n + 9
    r = dpb.FetchKVResponse(layer=m.layer, digest=pb.DIGEST_ALGORITHM_XXH3_128)
    got = frames.parse(dpb.FetchKVResponse, r.SerializeToString())
    assert bytes(got.payload) == data and got.digest == pb.DIGEST_ALGORITHM_XXH3_128 and got.layer.layer == 2


def test_unusual_messages_are_parsed_whole():
    m = _submit(b"abc").SerializeToString()
    header = epb.SubmitRequest(header=epb.SubmitHeader(request_id="r")).SerializeToString()
    unknown = bytes([0x9A, 0x06, 2]) + b"zz"  # field 99, length-delimited: an unknown field, kept
    for raw, payload in ((m + m, None),  # layer twice: protobuf merges the two, upb does it
                         (header, None),  # no layer at all
                         (_submit(b"").SerializeToString(), None),  # empty data: the field is absent
                         (m + unknown, b"abc")):
        p = frames.parse(epb.SubmitRequest, raw)
        whole = epb.SubmitRequest.FromString(raw)
        assert (None if p.payload is None else bytes(p.payload)) == payload
        if payload is None:
            assert p.msg == whole
        else:
            p.msg.layer.data = bytes(p.payload)
            assert p.msg == whole
    for bad in (m[:-2], m[:3], b"\x12\xff\xff\xff\xff\x7f", b"\x0b"):
        with pytest.raises(DecodeError):
            frames.parse(epb.SubmitRequest, bad)
    assert frames.payload_of(whole) is None
