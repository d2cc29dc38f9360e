"""The clients' own end-to-end check of the whole-transfer digest (FetchKVDone), against
a fake decoder: a real in-process gRPC server implementing speckv.v1 DecoderService
FetchKV that streams well-formed layers and then a FetchKVDone of its choosing.

Every stream below is valid on the wire (parts, sizes, order, scales); the bad ones
differ from the good ones only in that the layers sent are not the ones the digest
(or the raw byte count) was computed over: one KV bit flipped, one FP8 scale changed,
raw_bytes off by one. The blocking and asyncio clients must refuse them with
DATA_LOSS from ``fetch`` and ``fetch_layers``, and return the exact bytes of the
good ones, so it is the digest check, and nothing else, that fires. Every stream
comes in two styles: ``old``, a decoder before FetchKVRequest.digest (blake2b-128,
FetchKVResponse.digest unset), and ``xxh3``, one that names XXH3-128 on every message."""
from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from speckv.client.client import AsyncDecoderClient, DecoderClient, RpcFailed
from speckv.digests import BLAKE2B_128, XXH3_128, KVDigest
from speckv.kv import Fp8KV
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import decoder_pb2_grpc as dgrpc
from speckv.wire import kv_shape, layer_messages

SHAPE = (4, 2, 3, 5, 8)  # (layers, 2, kv_heads, tokens, head_dim): 240 bytes a BF16 layer
PART_BYTES = 64  # several parts per layer, as a real decoder sends a large layer
TIMEOUT = 10.0
DIGEST_MISMATCH = "whole-transfer digest"  # the client's words when FetchKVDone does not match


@dataclass
class Stream:
    """What the fake sends for one request id: ``bits`` (uint16 BF16 patterns or uint8 FP8
    codes) and ``scales`` (FP8) as layers, then FetchKVDone(``digest``, ``raw_bytes``)."""

    bits: np.ndarray
    scales: np.ndarray | None
    digest: bytes
    raw_bytes: int
    algorithm: int  # FetchKVResponse.digest on every message (0: unset, an old decoder: blake2b-128)
    done_algorithm: int | None = None  # FetchKVDone's message, when it names another


STYLES = {"old": 0, "xxh3": XXH3_128}


def _digest(bits: np.ndarray, scales: np.ndarray | None, algorithm: int) -> tuple[bytes, int]:
    d = KVDigest(algorithm or BLAKE2B_128)
    for layer in range(bits.shape[0]):
        d.update_layer(bits[layer], None if scales is None else scales[layer])
    return d.digest(), d.raw_bytes


class FakeDecoder(dgrpc.DecoderServiceServicer):
    def __init__(self) -> None:
        self.streams: dict[str, Stream] = {}
        self.asked: list[int] = []  # FetchKVRequest.digest of every call

    def FetchKV(self, request: dpb.FetchKVRequest, context: grpc.ServicerContext):
        self.asked.append(request.digest)
        s = self.streams.get(request.request_id)
        if s is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no stream {request.request_id!r}")
        dtype = pb.DTYPE_BF16 if s.scales is None else pb.DTYPE_FP8_E4M3
        shape = kv_shape(s.bits.shape)
        for layer in range(s.bits.shape[0]):
            sc = None if s.scales is None else s.scales[layer]
            for part in layer_messages(layer, s.bits[layer], dtype, shape, PART_BYTES, sc):
                yield dpb.FetchKVResponse(layer=part, digest=s.algorithm)
        yield dpb.FetchKVResponse(done=dpb.FetchKVDone(raw_digest=s.digest, raw_bytes=s.raw_bytes),
                                  digest=s.algorithm if s.done_algorithm is None else s.done_algorithm)


def _kvs() -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    rng = np.random.default_rng(7)
    bf16 = rng.integers(0, 1 << 16, SHAPE, dtype=np.uint16)
    codes = rng.integers(0, 256, SHAPE, dtype=np.uint8)
    scales = rng.uniform(0.01, 2.0, (SHAPE[0], 2)).astype(np.float32)
    return {"bf16": (bf16, None), "fp8": (codes, scales)}


KVS = _kvs()


def _tampered(name: str, how: str, style: str) -> Stream:
    """A stream of KV ``name`` whose FetchKVDone is that of the true KV, while the layers
    sent are altered by ``how`` (or the byte count is off); ``how == "none"``: all true."""
    bits, scales = KVS[name]
    digest, raw_bytes = _digest(bits, scales, STYLES[style])
    sent_bits, sent_scales = bits.copy(), None if scales is None else scales.copy()
    if how == "bit":
        sent_bits[2, 1, 0, 3, 5] ^= 0x0010  # one bit of one layer (not the first, not the last)
    elif how == "scale":
        sent_scales[1, 0] = np.nextafter(sent_scales[1, 0], np.float32(10))  # one ulp of one scale
    elif how == "raw_bytes":
        raw_bytes += 1
    else:
        assert how == "none"
    return Stream(sent_bits, sent_scales, digest, raw_bytes, STYLES[style])


BAD = [("bf16", "bit"), ("bf16", "raw_bytes"), ("fp8", "bit"), ("fp8", "scale")]


@pytest.fixture(scope="module")
def fake():
    """``(servicer, address)`` of the fake decoder, serving every stream of this file."""
    servicer = FakeDecoder()
    for style in STYLES:
        for name in KVS:
            servicer.streams[f"good-{name}-{style}"] = _tampered(name, "none", style)
        for name, how in BAD:
            servicer.streams[f"bad-{name}-{how}-{style}"] = _tampered(name, how, style)
    servicer.streams["switch"] = dataclasses.replace(_tampered("bf16", "none", "xxh3"), done_algorithm=BLAKE2B_128)
    servicer.streams["unknown"] = dataclasses.replace(_tampered("bf16", "none", "xxh3"), algorithm=9)
    server = grpc.server(ThreadPoolExecutor(4))
    dgrpc.add_DecoderServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0).wait(TIMEOUT)


def _assert_exact(got, name: str) -> None:
    bits, scales = KVS[name]
    if scales is None:
        assert isinstance(got, np.ndarray) and got.dtype == np.uint16 and got.shape == bits.shape
        assert np.array_equal(got, bits)
    else:
        assert isinstance(got, Fp8KV)
        assert got.codes.dtype == np.uint8 and np.array_equal(got.codes, bits)
        assert np.array_equal(np.asarray(got.scales, np.float32).view(np.uint32), scales.view(np.uint32))


def _assert_layers_exact(layers: list, name: str) -> None:
    bits, scales = KVS[name]
    assert [k for k, _, _ in layers] == list(range(bits.shape[0]))
    for k, arr, sc in layers:
        assert np.array_equal(arr, bits[k])
        if scales is None:
            assert sc is None
        else:
            assert np.array_equal(np.asarray(sc, np.float32).view(np.uint32), scales[k].view(np.uint32))


def _assert_digest_refused(err: RpcFailed) -> None:
    assert err.code == grpc.StatusCode.DATA_LOSS, err
    assert DIGEST_MISMATCH in err.details, err


# -- the fake is right: the same server, streams and client calls, with a true digest -----

@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("name", sorted(KVS))
def test_true_digest_delivers_the_exact_kv(fake, name, style):
    servicer, addr = fake
    del servicer.asked[:]
    with DecoderClient(addr, timeout=TIMEOUT) as dec:
        _assert_exact(dec.fetch(f"good-{name}-{style}"), name)
        _assert_exact(dec.fetch(f"good-{name}-{style}", verified_only=True), name)
        _assert_layers_exact(list(dec.fetch_layers(f"good-{name}-{style}")), name)
    assert servicer.asked == [XXH3_128] * 3  # the clients ask for XXH3-128 (an old decoder ignores it)


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("name", sorted(KVS))
def test_true_digest_delivers_the_exact_kv_async(fake, name, style):
    _, addr = fake

    async def run():
        dec = AsyncDecoderClient(addr, timeout=TIMEOUT)
        try:
            got = await dec.fetch(f"good-{name}-{style}")
            layers = [x async for x in dec.fetch_layers(f"good-{name}-{style}")]
        finally:
            await dec.close()
        return got, layers

    got, layers = asyncio.run(run())
    _assert_exact(got, name)
    _assert_layers_exact(layers, name)


# -- the layers do not match the digest sent: DATA_LOSS, the KV never handed out whole ----

@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("name,how", BAD)
def test_digest_mismatch_is_data_loss(fake, name, how, style):
    _, addr = fake
    r = f"bad-{name}-{how}-{style}"
    with DecoderClient(addr, timeout=TIMEOUT) as dec:
        for verified_only in (False, True):
            with pytest.raises(RpcFailed) as e:
                dec.fetch(r, verified_only=verified_only)
            _assert_digest_refused(e.value)
        # fetch_layers hands each layer out as it arrives (see its docstring): every layer
        # came, and the iterator then raises instead of ending cleanly
        layers = []
        with pytest.raises(RpcFailed) as e:
            for x in dec.fetch_layers(r):
                layers.append(x)
        _assert_digest_refused(e.value)
        assert [k for k, _, _ in layers] == list(range(SHAPE[0]))


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("name,how", BAD)
def test_digest_mismatch_is_data_loss_async(fake, name, how, style):
    _, addr = fake
    r = f"bad-{name}-{how}-{style}"

    async def run():
        dec = AsyncDecoderClient(addr, timeout=TIMEOUT)
        errors, layers = [], []
        try:
            try:
                await dec.fetch(r)
            except RpcFailed as e:
                errors.append(e)
            try:
                async for x in dec.fetch_layers(r):
                    layers.append(x)
            except RpcFailed as e:
                errors.append(e)
        finally:
            await dec.close()
        return errors, layers

    errors, layers = asyncio.run(run())
    assert len(errors) == 2, f"expected fetch and fetch_layers to raise, got {errors}"
    for err in errors:
        _assert_digest_refused(err)
    assert [k for k, _, _ in layers] == list(range(SHAPE[0]))


@pytest.mark.parametrize("r,words", [("switch", "digest algorithm changed"), ("unknown", "unknown digest algorithm")])
def test_digest_algorithm_is_one_the_client_knows_and_keeps(fake, r, words):
    _, addr = fake
    with DecoderClient(addr, timeout=TIMEOUT) as dec:
        with pytest.raises(RpcFailed) as e:
            dec.fetch(r)
    assert e.value.code == grpc.StatusCode.INTERNAL and words in e.value.details
