"""A decoder serving another model id than the encoder's (a rolling upgrade that renames or
replaces the model; issue 17 item 5): the speckv header is refused with MODEL_MISMATCH and the
encoder sends the same KV as a stored stream, which needs no predictor, instead of failing the
transfer; counted per chunk and per transfer (reason model_mismatch), logged once per peer. A
decoder takes stored streams of any model and geometry; the decode engine's FetchKV names the
model it runs, and a transfer of another model is refused before any layer is handed out."""
from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest
from server_helpers import MODEL, chunk_requests, raw_transfer, rid, stored_stream, trailer_request
from test_fallback import _metric, _transfer, running_pair

from speckv.client.client import DecoderClient, RpcFailed
from speckv.coder.codec import bf16_bits
from speckv.errors import RpcError

RENAMED = "SmolLM2-135M-Instruct-v2"  # what the decoder serves


def test_a_decoder_serving_another_model_gets_a_stored_stream_not_a_failure(embedded_session, caplog):
    target, p = embedded_session.target, embedded_session.predictor
    with running_pair(p, p, dec_model=RENAMED) as ((enc, eaddr), (dec, daddr)):
        with caplog.at_level(logging.WARNING, logger="speckv"):
            for k, text in enumerate(["The decode pod serves a renamed model.", "And a second transfer."]):
                ids = target.tokenize(text)
                kv = target.kv(ids)
                res, back = _transfer(eaddr, daddr, f"model-{k}", kv, ids)
                assert np.array_equal(back, bf16_bits(kv))  # lossless, uncompressed
                assert (res.fallback, res.encoding, res.stored_chunks, res.chunks) == (True, "stored", 0, 15), res
        assert _metric(enc, "speckv_fallbacks_total", "model_mismatch") == 2 * 15  # every chunk of both streams
        assert _metric(enc, "speckv_fallback_transfers_total", "model_mismatch") == 2  # per transfer
        assert _metric(enc, "speckv_fallbacks_total", "pin_mismatch") == 0
        assert _metric(dec, "speckv_fallback_transfers_total", "model_mismatch") == 0  # a plain stored stream there
        warned = [r for r in caplog.records if r.name == "speckv.server.encoder" and "another model" in
                  r.getMessage()]
        assert len(warned) == 1 and MODEL in warned[0].getMessage()  # once per peer


def test_fetch_refuses_a_transfer_of_another_model_than_the_engines(pair, prompts):
    """FetchKVRequest.model_id: the wrong model is FAILED_PRECONDITION before any layer (the
    transfer stays fetchable); the right one, or none (older clients), gets the KV."""
    ids, kv = prompts("short")
    for model, code in [("Llama-3-8B", grpc.StatusCode.FAILED_PRECONDITION), (MODEL, None), ("", None)]:
        r = rid("fetch-model")
        pair.enc.submit(r, kv, ids, pair.daddr, MODEL, timeout=60)
        if code is not None:
            with pytest.raises(RpcFailed) as ei:
                pair.dec.fetch(r, 30, 60, model_id=model)
            assert (ei.value.code, ei.value.reason) == (code, "MODEL_MISMATCH")
            assert "Llama-3-8B" in ei.value.details and MODEL in ei.value.details
        assert np.array_equal(pair.dec.fetch(r, 30, 60, model_id=MODEL if code else model), bf16_bits(kv))


def test_a_stored_stream_of_another_geometry_is_taken_and_served_exact(pair, embedded_session):
    """Another model's KV (4 layers, 2 heads, 5 tokens, head_dim 16; ids beyond this vocabulary)
    needs no predictor: the decoder relays it bit for bit to an engine naming that model."""
    rng = np.random.default_rng(17)
    bits = rng.integers(0, 1 << 16, size=(4, 2, 2, 5, 16), dtype=np.uint16)
    ids = np.array([3, 70_000, 5, 123_456, 9], np.int64)
    r = rid("foreign")
    header, recs = stored_stream(pair.decoder.service.rt.codec, r, bits, ids,
                                 bytes.fromhex(embedded_session.predictor.pin), model="other-model-7B")
    resps = raw_transfer(pair.daddr, [header] + chunk_requests(recs) + [trailer_request(bits)])
    assert resps[-1].result.raw_bytes == bits.nbytes
    with DecoderClient(pair.daddr) as d:
        assert np.array_equal(d.fetch(r, 30, 60, model_id="other-model-7B"), bits)


def test_runtime_check_takes_another_model_only_stored(pair):
    rt = pair.decoder.service.rt
    ids = np.arange(5, dtype=np.int64)
    shape = (4, 2, 2, 5, 16)  # not this model's geometry
    rt.check("other-model-7B", shape, ids, None, stored=True)
    with pytest.raises(RpcError) as ei:
        rt.check("other-model-7B", shape, ids, None)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and ei.value.reason == "MODEL_MISMATCH"
    with pytest.raises(RpcError, match="6 tokens but 5"):  # the token count is still checked
        rt.check("other-model-7B", (4, 2, 2, 6, 16), ids, None, stored=True)
    with pytest.raises(RpcError, match="does not fit"):  # this model's stored streams keep its geometry
        rt.check(rt.model_id, shape, ids, None, stored=True)


def test_another_models_prompt_is_bounded_by_the_configured_limit_not_this_context(pair):
    """Another model's context is its own: a stored stream of it longer than this model's context
    passes (up to FALLBACK_MAX_TOKENS, or config.max_tokens when set)."""
    from speckv.server.config import FALLBACK_MAX_TOKENS

    rt = pair.decoder.service.rt
    n = rt.context + 1
    ids = np.zeros(n, np.int64)
    rt.check("other-model-7B", (1, 2, 1, n, 8), ids, None, stored=True)
    with pytest.raises(RpcError, match="takes 1 to"):
        rt.check("other-model-7B", (1, 2, 1, n, 8), ids, n - 1, stored=True)
    with pytest.raises(RpcError, match="exceed the context"):
        rt.check(rt.model_id, rt.geometry[:1] + (2,) + rt.geometry[1:2] + (n,) + rt.geometry[2:], ids, None)
    assert n <= FALLBACK_MAX_TOKENS
