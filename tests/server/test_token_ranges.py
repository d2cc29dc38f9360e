"""A Submit whose layers arrive in token ranges (KVLayer.token_start / token_count), as a
chunked prefill produces them: every step's tokens of every layer, interleaved. The KV
arrives bit for bit and is coded exactly as whole layers are (the same wire bytes); every
broken order or range is INVALID_ARGUMENT; a KV the in-flight cap cannot hold whole is
refused up front (RESOURCE_EXHAUSTED), never left to deadlock."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from server_helpers import FETCH_WAIT, MODEL, WAIT, Pair, budgets_drain, raw_submit, rid

from speckv.client.client import RpcFailed
from speckv.client.core import submit_header
from speckv.coder.codec import Fp8KV, bf16_bits
from speckv.v1 import common_pb2 as pb
from speckv.v1 import encoder_pb2 as epb
from speckv.v1 import encoder_pb2_grpc as egrpc
from speckv.wire import kv_shape, layer_messages

STEP = 8  # tokens per prefill step


def _steps(T: int) -> list[tuple[int, int]]:
    return [(a, min(a + STEP, T)) for a in range(0, T, STEP)]


def _bits(kv):
    return kv.codes if isinstance(kv, Fp8KV) else bf16_bits(kv)


def _requests(r: str, kv, ids, daddr: str, order: list[tuple[int, int, int]], part_bytes: int = 1 << 20,
              scales=None) -> list[epb.SubmitRequest]:
    """A raw Submit: header, then each (layer, start, stop) of ``order`` as a token range."""
    bits = _bits(kv)
    fp8 = isinstance(kv, Fp8KV)
    shape = kv_shape(bits.shape)
    dtype = pb.DTYPE_FP8_E4M3 if fp8 else pb.DTYPE_BF16
    reqs = [submit_header(r, dtype, shape, ids, daddr, MODEL, "speckv", None)]
    for layer, a, b in order:
        sc = None if not fp8 else (kv.scales[layer] if scales is None else scales(layer, a))
        reqs += [epb.SubmitRequest(layer=m) for m in layer_messages(layer, bits[layer][:, :, a:b], dtype, shape,
                                                                     part_bytes, sc, a)]
    return reqs


def _prefill_order(L: int, T: int) -> list[tuple[int, int, int]]:
    """Chunked prefill: each step's tokens of layers 0 .. L-1."""
    return [(layer, a, b) for a, b in _steps(T) for layer in range(L)]


def _submit(pair, reqs) -> epb.SubmitResponse:
    with grpc.insecure_channel(pair.eaddr) as ch:
        return egrpc.EncoderServiceStub(ch).Submit(iter(reqs), timeout=WAIT)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_chunked_prefill_order_is_coded_as_whole_layers(pair, prompts, fp8_kv, dtype):
    ids, kv = fp8_kv("medium") if dtype == "fp8" else prompts("medium")
    whole = pair.roundtrip(rid("whole"), kv, ids)
    r = rid(f"ranges-{dtype}")
    L, T = _bits(kv).shape[0], _bits(kv).shape[3]
    assert len(_steps(T)) >= 3
    resp = _submit(pair, _requests(r, kv, ids, pair.daddr, _prefill_order(L, T), part_bytes=1000))
    got = pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT)
    assert _bits(got).tobytes() == _bits(kv).tobytes()
    if dtype == "fp8":
        assert got.scales.tobytes() == np.asarray(kv.scales, np.float32).tobytes()
    assert (resp.raw_bytes, resp.wire_bytes, resp.chunks) == (whole.raw_bytes, whole.wire_bytes, whole.chunks)
    budgets_drain(pair)


def test_submit_stream_send_tokens(pair, prompts):
    ids, kv = prompts("medium")
    r = rid("send-tokens")
    L, T = kv.shape[0], kv.shape[3]
    s = pair.enc.open_submit(r, tuple(kv.shape), ids, pair.daddr, MODEL, timeout=WAIT)
    for a, b in _steps(T):
        for layer in range(L):
            s.send_tokens(layer, a, kv[layer][:, :, a:b])
    res = s.result(timeout=WAIT)
    assert res.raw_bytes == bf16_bits(kv).nbytes
    assert pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT).tobytes() == bf16_bits(kv).tobytes()


def test_send_tokens_refuses_bad_ranges_before_any_byte(pair, prompts):
    ids, kv = prompts("short")
    T = kv.shape[3]
    s = pair.enc.open_submit(rid("st-bad"), tuple(kv.shape), ids, pair.daddr, MODEL, timeout=WAIT)
    try:
        with pytest.raises(ValueError, match="next range"):
            s.send_tokens(0, 1, kv[0][:, :, 1:3])  # a gap: tokens [0, 1) not sent
        s.send_tokens(0, 0, kv[0][:, :, :2])
        with pytest.raises(ValueError, match="before layer 0"):
            s.send_tokens(1, 0, kv[1])  # layer 1 would complete before layer 0
        with pytest.raises(ValueError, match="token ranges"):
            s.send_layer(0, kv[0])  # no mixing
        with pytest.raises(ValueError, match="next range"):
            s.send_tokens(0, 2, kv[0][:, :, 2:T + 1].repeat(1, 1, 2, 1))  # past the prompt's end
    finally:
        s.cancel()


def _cases(L: int, T: int) -> dict[str, tuple[list, str]]:
    h = T // 2
    return {
        "gap": ([(0, 0, 2), (0, 3, T)], "do not continue its tokens"),
        "overlap": ([(0, 0, h), (0, h - 1, T)], "do not continue its tokens"),
        "out_of_order_completion": ([(0, 0, h), (1, 0, T)], "completed before layer 0"),
        "done_layer_again": ([(0, 0, T), (0, 0, 1)], "not a layer still being sent"),
        "short_stream": ([(layer, 0, T) for layer in range(L - 1)], f"after {L - 1} of {L} layers"),
    }


@pytest.mark.parametrize("case", ["gap", "overlap", "out_of_order_completion", "done_layer_again", "short_stream"])
def test_broken_ranges_are_invalid(pair, prompts, case):
    ids, kv = prompts("short")
    L, T = kv.shape[0], kv.shape[3]
    order, why = _cases(L, T)[case]
    e = raw_submit(pair.eaddr, _requests(rid(case), kv, ids, pair.daddr, order))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.details(), e.details()
    budgets_drain(pair)


def test_whole_and_ranged_layers_do_not_mix(pair, prompts):
    ids, kv = prompts("short")
    T = kv.shape[3]
    reqs = _requests(rid("mix"), kv, ids, pair.daddr, [(0, 0, T)])
    shape, bits = kv_shape(kv.shape), bf16_bits(kv)
    reqs += [epb.SubmitRequest(layer=m) for m in layer_messages(1, bits[1], pb.DTYPE_BF16, shape, 1 << 20)]
    e = raw_submit(pair.eaddr, reqs)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "whole layer among token ranges" in e.details()
    whole_first = [reqs[0]] + [epb.SubmitRequest(layer=m) for m in
                               layer_messages(0, bits[0], pb.DTYPE_BF16, shape, 1 << 20)] + reqs[1:2]
    e = raw_submit(pair.eaddr, whole_first)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "all of its layers whole or all" in e.details()
    budgets_drain(pair)


def test_fp8_scales_must_agree_across_ranges(pair, fp8_kv):
    ids, kv = fp8_kv("short")
    T = kv.codes.shape[3]
    other = np.asarray(kv.scales[0], np.float32) * 2

    def scales(layer, start):
        return other if (layer, start) == (0, 4) else kv.scales[layer]

    e = raw_submit(pair.eaddr, _requests(rid("fp8-sc"), kv, ids, pair.daddr, [(0, 0, 4), (0, 4, T)],
                                         scales=scales))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "differ between its token ranges" in e.details()


def test_ranges_need_the_whole_kv_within_the_cap(sidecars, prompts):
    """At 256 KiB the cap holds a layer but not this KV: whole layers go, token ranges are refused."""
    ids, kv = prompts("long")
    assert 2 * bf16_bits(kv)[0].nbytes < 256 << 10 < bf16_bits(kv).nbytes
    p = Pair.start(sidecars, max_inflight_bytes=256 << 10, message_bytes=64 << 10)
    try:
        p.roundtrip(rid("cap-whole"), kv, ids)
        L, T = kv.shape[0], kv.shape[3]
        e = raw_submit(p.eaddr, _requests(rid("cap-ranges"), kv, ids, p.daddr, _prefill_order(L, T), 60 << 10))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "send whole layers" in e.details()
        budgets_drain(p)
    finally:
        p.stop()


# -- FetchKV of a token range --------------------------------------------------------

def test_fetch_a_token_range(pair, prompts):
    """A decode engine holding the prompt's first tokens (a prefix-cache hit) fetches the rest."""
    ids, kv = prompts("medium")
    bits, T = bf16_bits(kv), kv.shape[3]
    r = rid("fetch-tokens")
    pair.enc.submit(r, kv, ids, pair.daddr, MODEL, timeout=WAIT)
    with pytest.raises(RpcFailed) as ei:
        pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT, tokens=(5, T + 1))
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and "not within" in ei.value.details
    got = pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT, tokens=(5, T))  # the refusal claimed nothing
    assert got.shape == (30, 2, 3, T - 5, 64) and got.tobytes() == np.ascontiguousarray(bits[..., 5:, :]).tobytes()
    budgets_drain(pair)


def test_fetch_heads_and_tokens_of_fp8(pair, fp8_kv):
    from speckv.kv import HeadRange

    ids, kv = fp8_kv("medium")
    r = rid("fetch-ht")
    pair.enc.submit(r, kv, ids, pair.daddr, MODEL, timeout=WAIT)
    got = pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT, heads=HeadRange(1, 2, 3), tokens=(2, 9))
    assert got.codes.tobytes() == np.ascontiguousarray(kv.codes[:, :, 1:3, 2:9]).tobytes()
    assert got.scales.tobytes() == np.asarray(kv.scales, np.float32).tobytes()
    pair.dec.cancel(r)  # head 0 was never fetched
    budgets_drain(pair)


def test_a_decoder_before_token_ranges_is_cut_by_the_client(pair, prompts, monkeypatch):
    """A decoder that ignores FetchKVRequest.token_start (an older release) sends whole layers:
    the client verifies them and hands out only the tokens it asked for."""
    from speckv.server import fetch as fetch_mod

    monkeypatch.setattr(fetch_mod, "_tokens", lambda request, tokens: None)
    ids, kv = prompts("medium")
    bits, T = bf16_bits(kv), kv.shape[3]
    want = np.ascontiguousarray(bits[..., 4:T - 1, :])
    for how in ("fetch", "fetch_layers"):
        r = rid(f"old-decoder-{how}")
        pair.enc.submit(r, kv, ids, pair.daddr, MODEL, timeout=WAIT)
        if how == "fetch":
            got = pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT, tokens=(4, T - 1))
        else:
            got = np.stack([a for _, a, _ in pair.dec.fetch_layers(r, wait=FETCH_WAIT, timeout=WAIT,
                                                                  tokens=(4, T - 1))])
        assert got.tobytes() == want.tobytes(), how
    budgets_drain(pair)
