"""Batched calls of the fused CUDA coder (``CudaCoder.encode_batch`` / ``decode_batch``): requests of
different lengths and chunkings in one launch a pass. Each request's streams are the native coder's
for that request alone; each decodes bit for bit; a corrupt stream fails its own request only, with
the native coder's error for it. On the warp emulator everywhere, on a CUDA device where there is one."""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from cuda_helpers import assert_same_streams, decode_outcome, kv_case

from speckv.coder.cuda import Request
from speckv.coder.residual import models_of
from speckv.errors import RansDecodeError

# (layers, tokens, layers of each chunk): a prompt, a one-token prompt, one with no tokens, a longer one
SHAPES = ((3, 17, [2, 1]), (2, 1, [1, 1]), (2, 0, [2]), (4, 40, [3, 1]))


def _requests(cu, nat, model, fp8, shapes=SHAPES):
    """Per request: (x, mu prepared, L, layer counts) and the native coder's streams for it alone."""
    reqs = []
    for i, (layers, tokens, counts) in enumerate(shapes):
        x, mu, a, b, scales, L = kv_case(model, fp8, layers, tokens, 100 + i)
        m = nat.prepare_mu(mu, a, b, scales)
        reqs.append((x, m, L, counts, nat.encode(x, m, L, counts, 16, model.tables)))
    return reqs


def _device(cu, reqs, out=False):
    cp = cu.cp
    return [Request(cp.empty(x.shape, x.dtype) if out else cp.asarray(x), cp.asarray(m), L, counts)
            for x, m, L, counts, _ in reqs]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_batch_codes_each_request_as_alone(coders, ckpt, fp8):
    cu, nat, _ = coders
    for model in models_of(ckpt).values():
        reqs = _requests(cu, nat, model, fp8)
        got = cu.encode_batch(_device(cu, reqs), 16, model.tables)
        assert len(got) == len(reqs)
        for (*_, want), parts in zip(reqs, got, strict=True):
            assert_same_streams(parts, want)
        outs = _device(cu, reqs, out=True)
        assert cu.decode_batch(outs, 16, [[(p.blocks, p.bits) for p in r[4]] for r in reqs], model.tables) == [
            None] * len(reqs)
        for (x, *_), o in zip(reqs, outs, strict=True):
            assert np.array_equal(cu.cp.asnumpy(o.kv), x)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_batch_streams_kept_on_the_device(coders, ckpt, fp8):
    """encode_batch_streams -> decode_streams_batch: the KV back; the streams, copied out and split,
    are each request's native streams; a batch of other requests is refused."""
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    reqs = _requests(cu, nat, model, fp8)
    kept = cu.encode_batch_streams(_device(cu, reqs), 16, model.tables)
    outs = _device(cu, reqs, out=True)
    assert cu.decode_streams_batch(kept, outs, 16, model.tables) == [None] * len(reqs)
    for (x, *_), o in zip(reqs, outs, strict=True):
        assert np.array_equal(cu.cp.asnumpy(o.kv), x)
    for (*_, want), parts in zip(reqs, kept.geometry.by_request(cu.to_host(kept)), strict=True):
        assert_same_streams(parts, want)
    with pytest.raises(ValueError, match="another geometry"):  # the same chunks' elements, other requests
        cu.decode_streams_batch(kept, outs[::-1], 16, model.tables)


@pytest.mark.gpu
@pytest.mark.parametrize("part", ["words", "states", "bits"])
def test_batch_fails_only_the_corrupt_request(coders, ckpt, part):
    """A bit flipped in one request's streams: that request gets the error the native coder gives it
    decoded alone (message and all); the others decode bit for bit."""
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    reqs = _requests(cu, nat, model, False)
    rng = np.random.default_rng({"words": 1, "states": 2, "bits": 3}[part])
    seen = set()
    for _ in range(6):
        q = int(rng.choice([0, 1, 3]))  # a request with elements
        x, m, L, counts, parts = reqs[q]
        c = int(rng.integers(0, len(parts)))
        blocks, bits = parts[c].blocks, bytearray(parts[c].bits)
        words, states = blocks.words.copy(), blocks.states.copy()
        target = {"bits": np.frombuffer(bits, np.uint8), "words": words.view(np.uint8),
                  "states": states.view(np.uint8).reshape(-1)}[part]
        if not target.size:
            continue
        target[int(rng.integers(0, target.size))] ^= np.uint8(1 << int(rng.integers(0, 8)))
        streams = [[(p.blocks, p.bits) for p in r[4]] for r in reqs]
        streams[q][c] = (type(blocks)(states, blocks.word_counts, words), bytes(bits))
        want = decode_outcome(nat, m, L, counts, 16, streams[q], model.tables, x)
        outs = _device(cu, reqs, out=True)
        errors = cu.decode_batch(outs, 16, streams, model.tables)
        for i, ((xi, *_), o, e) in enumerate(zip(reqs, outs, errors, strict=True)):
            if i != q:
                assert e is None and np.array_equal(cu.cp.asnumpy(o.kv), xi)
        got = (f"ok {hashlib.sha256(cu.cp.asnumpy(outs[q].kv).tobytes()).hexdigest()[:16]}" if errors[q] is None
               else f"{type(errors[q]).__name__}: {errors[q]}")
        assert got == want
        seen.add(got.split(":")[0])
    assert seen - {"ok"}, "no corruption was caught: the case checks nothing"


@pytest.mark.gpu
def test_batch_fails_only_the_request_whose_blocks_are_malformed(coders, ckpt):
    """Blocks the host refuses before any kernel runs (a state below RANS_L, words cut short, a block
    too few): that request's error as decoding it alone, the others decoded."""
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    reqs = _requests(cu, nat, model, False)
    streams = [[(p.blocks, p.bits) for p in r[4]] for r in reqs]
    b0, b3, b1 = streams[0][1][0], streams[3][0][0], streams[1][0][0]
    low = b0.states.copy()
    low[0, 5] = 5
    streams[0][1] = (type(b0)(low, b0.word_counts, b0.words), streams[0][1][1])
    streams[3][0] = (type(b3)(b3.states, b3.word_counts, b3.words[:-1]), streams[3][0][1])
    streams[1][0] = (type(b1)(b1.states[:0], b1.word_counts[:0], b1.words[:0]), streams[1][0][1])
    want = {q: decode_outcome(nat, reqs[q][1], reqs[q][2], reqs[q][3], 16, streams[q], model.tables, reqs[q][0])
            for q in (0, 3)}
    outs = _device(cu, reqs, out=True)
    errors = cu.decode_batch(outs, 16, streams, model.tables)
    for q in (0, 3):
        assert f"{type(errors[q]).__name__}: {errors[q]}" == want[q] and "RansDecodeError" in want[q]
    assert isinstance(errors[1], ValueError) and "states:" in str(errors[1])
    assert errors[2] is None and np.array_equal(cu.cp.asnumpy(outs[2].kv), reqs[2][0])


@pytest.mark.gpu
def test_one_request_calls_raise_the_batch_error(coders, ckpt):
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    x, m, L, counts, parts = _requests(cu, nat, model, False)[0]
    bad = parts[0].blocks.states.copy()
    bad[0, 0] ^= 1
    streams = [(type(parts[0].blocks)(bad, parts[0].blocks.word_counts, parts[0].blocks.words), parts[0].bits),
               (parts[1].blocks, parts[1].bits)]
    with pytest.raises(RansDecodeError, match="chunk 0, block 0"):
        cu.decode_device(cu.cp.asarray(m), L, counts, 16, streams, model.tables, cu.cp.empty(x.shape, x.dtype))


class _Foreign:
    """A device array known only by its array interface (as a torch CUDA tensor shows itself to CuPy)."""

    def __init__(self, a):
        self._a = a

    @property
    def __cuda_array_interface__(self):
        return self._a.__cuda_array_interface__

    @property
    def __array_interface__(self):  # the emulator's device arrays are numpy's
        return self._a.__array_interface__


@pytest.mark.gpu
def test_decode_writes_into_a_foreign_device_array(coders, ckpt):
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    x, m, L, counts, parts = _requests(cu, nat, model, False)[3]
    out = cu.cp.zeros(x.shape, x.dtype)
    cu.decode_device(cu.cp.asarray(m), L, counts, 16, [(p.blocks, p.bits) for p in parts], model.tables,
                     _Foreign(out))
    assert np.array_equal(cu.cp.asnumpy(out), x)


@pytest.mark.gpu
def test_batch_refuses_requests_it_cannot_code_together(coders, ckpt):
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    reqs = _device(cu, _requests(cu, nat, model, False))
    streams = [[(p.blocks, p.bits) for p in r[4]] for r in _requests(cu, nat, model, False)]
    cases = {
        "at least one request": lambda: cu.encode_batch([], 16, model.tables),
        "one heads and dim": lambda: cu.encode_batch(
            reqs[:1] + [Request(reqs[0].kv[:, :, :2], reqs[0].mu[:, :, :2], reqs[0].log2_sigma[:, :, :2],
                                reqs[0].layer_counts)], 16, model.tables),
        "one KV dtype": lambda: cu.encode_batch(
            reqs[:1] + [dataclasses.replace(reqs[1], kv=reqs[1].kv.view(cu.cp.uint8)[..., :64])], 16, model.tables),
        "need 4 requests' streams": lambda: cu.decode_batch(reqs, 16, streams[:3], model.tables),
        "need a list of 2 chunk streams": lambda: cu.decode_batch(reqs, 16, [streams[0][:1]] + streams[1:],
                                                                   model.tables),
        "mu: ": lambda: cu.encode_batch([dataclasses.replace(reqs[0], mu=reqs[3].mu)], 16, model.tables),
        "expected \\(layers, 2, heads, tokens, dim\\) arrays": lambda: cu.encode_batch(
            [dataclasses.replace(reqs[0], kv=reqs[0].kv[0])], 16, model.tables),
        "does not hold layers": lambda: cu.encode_batch(  # no tokens: no element to count, the layers still
            [dataclasses.replace(reqs[2], layer_counts=[1])], 16, model.tables),
        # NOTE: a host array would be copied to the device and decoded into there: the caller's never written
        "out must be a device array": lambda: cu.decode_batch(
            [dataclasses.replace(reqs[0], kv=np.empty(reqs[0].kv.shape, np.uint16))], 16, streams[:1], model.tables),
        "out: expected 16- or 8-bit": lambda: cu.decode_batch(
            [dataclasses.replace(reqs[0], kv=cu.cp.empty(reqs[0].kv.shape, np.float32))], 16, streams[:1],
            model.tables),
    }
    for why, call in cases.items():
        with pytest.raises(ValueError, match=why):
            call()
