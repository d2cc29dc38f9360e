"""FetchKV's whole-transfer digest in the algorithm the client asks for
(FetchKVRequest.digest): the stream's own (XXH3-128 for format version 3, blake2b-128
for version 2) when they agree, else recomputed over the layers handed out; a client
before the field (digest unset) gets blake2b-128, so it still verifies. Every message
names the algorithm (FetchKVResponse.digest), and FetchKVDone's digest is exactly the
reference one over the KV sent; an unknown algorithm is INVALID_ARGUMENT."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
from server_helpers import WAIT, chunk_requests, raw_transfer, rid, stored_stream, trailer_request

from speckv.client.core import CHANNEL_OPTIONS
from speckv.coder.codec import bf16_bits
from speckv.digests import BLAKE2B_128, XXH3_128, KVDigest
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import decoder_pb2_grpc as dgrpc
from speckv.wire import LayerAssembler, shape_of

UNSET = 0


def _fetch(daddr: str, request_id: str, digest: int) -> list[dpb.FetchKVResponse]:
    with grpc.insecure_channel(daddr, options=CHANNEL_OPTIONS) as ch:
        req = dpb.FetchKVRequest(request_id=request_id, wait_timeout_ms=int(WAIT * 1000), digest=digest)
        return list(dgrpc.DecoderServiceStub(ch).FetchKV(req, timeout=WAIT))


def _check(msgs: list[dpb.FetchKVResponse], bits: np.ndarray, want: int) -> None:
    """The layers are ``bits``, every message names ``want``, FetchKVDone is ``want``'s digest."""
    assert all(m.digest == want for m in msgs)
    asm = LayerAssembler(msgs[0].layer.dtype, shape_of(msgs[0].layer.shape))
    layers = [got[1] for m in msgs[:-1] if (got := asm.add(m.layer)) is not None]
    assert asm.done and np.array_equal(np.stack(layers), bits)
    ref = KVDigest(want)
    for layer in bits:
        ref.update_layer(layer)
    done = msgs[-1].done
    assert (done.raw_digest, done.raw_bytes) == (ref.digest(), bits.nbytes)


@pytest.mark.parametrize("encoding", ["stored", "speckv"])
@pytest.mark.parametrize("asked", [UNSET, BLAKE2B_128, XXH3_128])
def test_fetch_answers_in_the_asked_algorithm(pair, prompts, encoding, asked):
    ids, kv = prompts("short")
    r = rid(f"digest-{encoding}-{asked}")
    _, msgs = pair.transfer(r, kv, ids, encoding=encoding, fetch=lambda dec, r: _fetch(pair.daddr, r, asked))
    _check(msgs, bf16_bits(kv), asked or BLAKE2B_128)


@pytest.mark.parametrize("asked", [UNSET, XXH3_128])
def test_a_version_2_stream_verifies_and_is_fetched_in_either(pair, prompts, embedded_session, asked):
    """A version 2 stream's trailer is blake2b-128; a client asking XXH3-128 gets that, recomputed."""
    ids, kv = prompts("short")
    bits = bf16_bits(kv)
    r = rid("v2")
    header, recs = stored_stream(pair.decoder.service.rt.codec, r, bits, ids,
                                 bytes.fromhex(embedded_session.predictor.pin), version=2)
    bad_trailer = trailer_request(bits, version=3)  # XXH3-128: not this stream's algorithm
    with pytest.raises(grpc.RpcError) as e:
        raw_transfer(pair.daddr, [header] + chunk_requests(recs) + [bad_trailer])
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    header.header.request_id = r = rid("v2")
    raw_transfer(pair.daddr, [header] + chunk_requests(recs) + [trailer_request(bits, version=2)])
    _check(_fetch(pair.daddr, r, asked), bits, asked or BLAKE2B_128)


def test_unknown_algorithm_is_invalid(pair):
    with pytest.raises(grpc.RpcError) as e:
        _fetch(pair.daddr, rid("unknown-digest"), 9)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "digest" in e.value.details()
