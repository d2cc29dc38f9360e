"""Byte identity of the native CPU coder and the numpy reference across stream
geometries and entry points: odd geometries (0, 1 and 5 tokens, 1-layer chunks,
short last chunks, partial last blocks, elems_per_lane 1..2000), thread counts 1, 2
and 3, a decoder configured differently from the encoder, and the streaming APIs
(encode_chunks / encode_chunk / decode_run / decode_chunk) against the whole-stream
records.

A missing extension skips these tests on a developer's machine and fails them in
CI (SPECKV_REQUIRE_NATIVE, tests/require.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from codec_helpers import ALL_CODES, LAYERS, SCALES, bf16_tensor, fp8_mu, ids_for, tile
from native_helpers import (
    EPLS,
    LPCS,
    MODELS,
    assert_same_kv,
    assert_same_records,
    both_ways,
    realistic_pair,
)

from speckv.coder import container as ct
from speckv.coder.codec import Fp8KV
from speckv.coder.stored import stored_record_len

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------------------ geometries


@pytest.mark.parametrize("lpc", LPCS)
@pytest.mark.parametrize("epl", EPLS)
def test_geometries(codecs, epl, lpc):
    """One token (384 elements per layer: partial last blocks for every epl but 1 and 3),
    1-layer chunks, a short last chunk, a single chunk; both dtypes, both models."""
    x, mu = realistic_pair(1, epl * 31 + lpc)
    both_ways(codecs, x, ids_for(1), mu, epl, lpc, "tuned")
    both_ways(codecs, x, ids_for(1), mu, epl, lpc, "seed")
    codes = tile(ALL_CODES, 1, seed=epl)
    both_ways(codecs, Fp8KV(codes, SCALES["mixed"]), ids_for(1), fp8_mu(codes, SCALES["mixed"], "near"),
              epl, lpc, "tuned" if epl % 2 else "seed")


@pytest.mark.parametrize("T", [0, 1, 5])
@pytest.mark.parametrize("epl,lpc", [(1, 1), (5, 29), (33, 31), (2000, 2)])
def test_token_counts_and_partial_blocks(codecs, T, epl, lpc):
    """No tokens (chunks without blocks), 1 token, and 5 tokens (1920 elements a layer),
    with blocks of 32, 160, 1056 and 64000 elements."""
    x, mu = realistic_pair(T, T * 7 + epl)
    recs = both_ways(codecs, x, ids_for(T), mu, epl, lpc, "tuned")
    h, _ = ct.unpack_header(recs[0])
    for i, r in enumerate(recs[1:]):
        c, _ = ct.unpack_chunk(r, h)
        assert h.chunk_blocks(i) == (0 if T == 0 else -(-h.chunk_elements(i) // (32 * epl)))
        # a chunk the size guard stores has no blocks (both_ways also checks the all-coded version 2 stream)
        assert c.n_blocks == (0 if ct.is_stored_chunk(h, c) else h.chunk_blocks(i))
        assert c.record_len <= stored_record_len(h, i)
    codes = tile(ALL_CODES, T, seed=T)
    both_ways(codecs, Fp8KV(codes, SCALES["one"]), ids_for(T), fp8_mu(codes, SCALES["one"], "near"),
              epl, lpc, "seed")


def test_threads_do_not_change_the_bytes(codecs):
    """Thread counts 1, 2 and 3 on both backends: one stream."""
    x, mu = realistic_pair(3, 17)
    codes = tile(ALL_CODES, 3, seed=17)
    kv8 = Fp8KV(codes, SCALES["mixed"])
    for epl, lpc in ((3, 7), (64, 1), (1024, 30)):
        for kv, m in ((x, mu), (kv8, fp8_mu(codes, SCALES["mixed"], "near"))):
            ref = both_ways(codecs, kv, ids_for(3), m, epl, lpc, "tuned", threads=(1, 2, 3))
            for t in (1, 3):
                assert_same_records(ref, list(codecs("numpy", epl, lpc, t).encode(kv, ids_for(3), m)))
                out = codecs("native", epl, lpc, t).decode(ref, ids_for(3), m)
                assert_same_kv(out, codecs("numpy", epl, lpc, t).decode(ref, ids_for(3), m))


def test_decoder_geometry_is_the_streams(codecs):
    """A native decoder configured with other elems_per_lane / layers_per_chunk / model /
    threads decodes a numpy stream (the stream carries its geometry and model id)."""
    x, mu = realistic_pair(2, 4)
    ids = ids_for(2)
    for enc in ((3, 7, "seed"), (1024, 1, "tuned")):
        recs = list(codecs("numpy", enc[0], enc[1], 2, enc[2]).encode(x, ids, mu))
        for dec in ((1, 30, 1, "tuned"), (64, 2, 3, "seed")):
            out = codecs("native", *dec).decode(recs, ids, mu)
            assert out.dtype == np.uint16 and np.array_equal(out, x)


# ------------------------------------------------------------ streaming


def _runs(n: int) -> list[range]:
    """Ways to cut chunks 0..n-1 into consecutive runs: all at once, one by one, pairs."""
    cuts = [[range(0, n)], [range(i, i + 1) for i in range(n)], [range(i, min(i + 2, n)) for i in range(0, n, 2)]]
    return [r for cut in cuts for r in cut]


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("lpc", LPCS + (4,))
def test_streaming_apis(codecs, dtype, lpc):
    """encode_chunks / encode_chunk write the whole stream's records on both backends;
    decode_run / decode_chunk of either backend's chunks give the layers back."""
    T, epl = 2, 7
    x, mu = realistic_pair(T, lpc)
    ids = ids_for(T)
    codes = tile(ALL_CODES, T, seed=lpc)
    scales = SCALES["mixed"]
    arr, kv = (x, x) if dtype == "bf16" else (codes, Fp8KV(codes, scales))
    whole = both_ways(codecs, kv, ids, mu, epl, lpc, "tuned")
    cn, cv = codecs("numpy", epl, lpc), codecs("native", epl, lpc)
    h = cn.stream_header(dtype == "bf16", arr.shape, ids)
    assert ct.pack_header(h) == ct.pack_header(cv.stream_header(dtype == "bf16", arr.shape, ids)) == whole[0]
    chunks = {}
    for idx in _runs(h.n_chunks):
        s = h.chunk_layers(idx[0])[0]
        e = sum(h.chunk_layers(idx[-1]))
        sc = scales[s:e] if dtype == "fp8" else None
        ref = [ct.pack_chunk(c) for c in cn.encode_chunks(h, idx, arr[s:e], mu, sc)]
        got = cv.encode_chunks(h, idx, arr[s:e], mu, sc)
        assert_same_records([whole[0]] + ref, [whole[0]] + [ct.pack_chunk(c) for c in got])
        assert ref == whole[1 + idx[0]:1 + idx[-1] + 1]
        for c in got:
            chunks[c.index] = c
        if len(idx) == 1:
            one = cv.encode_chunk(h, idx[0], arr[s:e], mu, sc)
            assert ct.pack_chunk(one) == ref[0]
    dt = np.uint16 if dtype == "bf16" else np.uint8
    for idx in _runs(h.n_chunks):
        s = h.chunk_layers(idx[0])[0]
        e = sum(h.chunk_layers(idx[-1]))
        run = [chunks[i] for i in idx]
        a = cn.decode_run(h, run, mu)
        b = cv.decode_run(h, run, bf16_tensor(mu))
        assert a.dtype == b.dtype == dt and np.array_equal(a, b) and np.array_equal(b, arr[s:e])
        if len(idx) == 1:
            one = cv.decode_chunk(h, run[0], mu)
            assert one.dtype == dt and np.array_equal(one, arr[s:e])


@pytest.mark.parametrize("mdl", MODELS)
def test_streaming_one_layer_one_token(codecs, mdl):
    """A stream of 1-layer chunks of 1 token, each coded and decoded alone on both."""
    x, mu = realistic_pair(1, 8)
    ids = ids_for(1)
    cn, cv = codecs("numpy", 1024, 1, 1, mdl), codecs("native", 1024, 1, 1, mdl)
    h = cn.stream_header(True, x.shape, ids)
    assert h.n_chunks == LAYERS
    for i in (0, 13, LAYERS - 1):
        a, b = cn.encode_chunk(h, i, x[i:i + 1], mu), cv.encode_chunk(h, i, x[i:i + 1], mu)
        assert ct.pack_chunk(a) == ct.pack_chunk(b)
        assert np.array_equal(cv.decode_chunk(h, a, mu), x[i:i + 1])
        assert np.array_equal(cn.decode_chunk(h, b, mu), x[i:i + 1])
