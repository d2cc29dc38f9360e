"""SubmitHeader.fp8_attention through both sidecars: the encoder passes it on in the
TransferHeader and both predictors compute the mu that follows an engine whose attention reads
its FP8 cache, so every chunk's predictor check agrees (nothing stored) and the stream is smaller
than under plain mu; a malformed one is INVALID_ARGUMENT before any transfer starts."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
from server_helpers import MODEL, raw_submit, rid

from speckv.predictor import engines
from speckv.v1 import common_pb2 as pb
from speckv.v1 import encoder_pb2 as epb
from speckv.wire import fp8_attention_msg, kv_shape

TEXT = ("Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. "
        "The evil that men do lives after them; the good is oft interred with their bones.")


@pytest.fixture(scope="module")
def engine_fp8(embedded_session):
    """(ids, the fp8cache engine's FP8 KV, its Fp8Attention)."""
    target = embedded_session.target
    ids = target.tokenize(TEXT)
    fa = engines.fp8_cache_attention(target.kv(ids), toward_zero=True)
    return ids, engines.fp8_cache_codes(engines.fp8_cache_kv(target, ids, fa), fa), fa


def test_both_predictors_follow_the_engines_fp8_attention(pair, engine_fp8):
    ids, kv, fa = engine_fp8
    with_fa, back = pair.transfer(rid("fa"), kv, ids, fp8_attention=fa)
    assert np.array_equal(back.codes, kv.codes) and np.array_equal(back.scales, kv.scales)
    assert (with_fa.encoding, with_fa.stored_chunks, with_fa.fallback) == ("speckv", 0, False)
    plain, back = pair.transfer(rid("no-fa"), kv, ids)
    assert np.array_equal(back.codes, kv.codes)
    print(f"\n{len(ids)} tokens: {with_fa.wire_bytes} wire bytes with fp8_attention, {plain.wire_bytes} without")
    assert with_fa.wire_bytes < 0.8 * plain.wire_bytes  # measured 157,287 vs 211,318 (0.744)


@pytest.mark.parametrize("how", ["layers", "rounding", "bf16", "scale"])
def test_a_malformed_fp8_attention_is_invalid_argument(pair, engine_fp8, how):
    ids, kv, fa = engine_fp8
    msg = fp8_attention_msg(fa)
    dtype = pb.DTYPE_FP8_E4M3
    if how == "layers":
        del msg.k_scales[-1]
    elif how == "rounding":
        msg.rounding = pb.FP8_ROUNDING_UNSPECIFIED
    elif how == "bf16":
        dtype = pb.DTYPE_BF16
    else:
        msg.v_scales[3] = -1.0
    header = epb.SubmitRequest(header=epb.SubmitHeader(
        request_id=rid("fa-bad"), decoder_address=pair.daddr, model_id=MODEL, dtype=dtype,
        shape=kv_shape(kv.codes.shape), prompt_token_ids=[int(t) for t in ids], fp8_attention=msg))
    e = raw_submit(pair.eaddr, [header])
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "fp8_attention" in e.details(), e.details()


def test_the_client_refuses_fp8_attention_on_bf16_kv(pair, embedded_session, engine_fp8):
    ids, _, fa = engine_fp8
    with pytest.raises(ValueError, match="FP8 KV only"):
        pair.enc.submit(rid("fa-bf16"), embedded_session.target.kv(ids), ids, pair.daddr, MODEL, fp8_attention=fa)
