"""The asyncio clients against real sidecars on loopback (the blocking clients are
exercised by tests/server): submit and fetch concurrently, bit for bit, BF16 and
FP8; typed errors carry the gRPC code."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from speckv.client.client import AsyncDecoderClient, AsyncEncoderClient, RpcFailed, submit_requests
from speckv.coder.codec import Fp8KV, bf16_bits
from speckv.predictor.fp8 import kv_to_fp8

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def pair(embedded_session):
    from speckv.server.local import LocalPair

    with LocalPair(embedded_session.predictor, metrics=False) as p:
        yield p


@pytest.fixture(scope="module")
def prompt(embedded_session):
    ids = embedded_session.target.tokenize("Async clients move the cache while the engine waits.")
    return ids, embedded_session.target.kv(ids)


def _fp8(kv: torch.Tensor) -> Fp8KV:
    q, scale = kv_to_fp8(kv)
    codes = q.view(torch.uint8).numpy() if q.dtype != torch.uint8 else q.numpy()
    return Fp8KV(np.ascontiguousarray(codes), np.asarray(scale, np.float32).reshape(-1, 2))


async def _round_trip(pair, rid, kv, ids, **kw):
    enc, dec = AsyncEncoderClient(pair.encoder_address), AsyncDecoderClient(pair.decoder_address)
    try:
        res, back = await asyncio.gather(enc.submit(rid, kv, ids, pair.decoder_address, MODEL, **kw),
                                         dec.fetch(rid, wait=30, as_torch=True))
        status = await dec.status(rid)
        return res, back, status
    finally:
        await enc.close()
        await dec.close()


def test_async_bf16_round_trip(pair, prompt):
    ids, kv = prompt
    res, back, status = asyncio.run(_round_trip(pair, "async-bf16", kv, ids))
    assert back.dtype == torch.bfloat16
    assert np.array_equal(bf16_bits(back), bf16_bits(kv))
    assert res.raw_bytes == kv.numel() * 2 and res.wire_bytes < res.raw_bytes / 2
    assert status.chunks_decoded == status.chunks_total == res.chunks
    assert status.wire_bytes == res.wire_bytes and status.raw_bytes == res.raw_bytes


@pytest.mark.parametrize("encoding", ["speckv", "stored"])
def test_async_fp8_round_trip(pair, prompt, encoding):
    ids, kv = prompt
    fp8 = _fp8(kv)
    res, back, _ = asyncio.run(_round_trip(pair, f"async-fp8-{encoding}", fp8, ids, encoding=encoding))
    assert isinstance(back, Fp8KV)
    assert np.array_equal(back.codes, fp8.codes)
    assert np.array_equal(back.scales.view(np.uint32), fp8.scales.view(np.uint32))
    assert res.raw_bytes == fp8.codes.nbytes
    assert (res.wire_bytes < res.raw_bytes) == (encoding == "speckv")


def test_async_typed_errors(pair):
    async def run():
        dec = AsyncDecoderClient(pair.decoder_address)
        try:
            with pytest.raises(RpcFailed) as e1:
                await dec.status("no-such-request")
            with pytest.raises(RpcFailed) as e2:
                await dec.fetch("no-such-request", wait=0.1)
            with pytest.raises(RpcFailed) as e3:
                await dec.cancel("no-such-request")
            return e1.value, e2.value, e3.value
        finally:
            await dec.close()

    for err in asyncio.run(run()):
        assert err.code == grpc.StatusCode.NOT_FOUND and "no-such-request" in err.details


def test_submit_requests_validates_locally(prompt):
    ids, kv = prompt
    with pytest.raises(ValueError, match="encoding"):
        list(submit_requests("r", kv, ids, "h:1", MODEL, encoding="zip"))
    with pytest.raises(ValueError, match="layers, 2"):
        list(submit_requests("r", kv[0], ids, "h:1", MODEL))
    with pytest.raises(TypeError):
        list(submit_requests("r", kv.float(), ids, "h:1", MODEL))
    msgs = list(submit_requests("r", kv, ids, "h:1", MODEL, part_bytes=4096))
    assert all(m.ByteSize() < 4096 + 512 for m in msgs[1:])
    assert sum(len(m.layer.data) for m in msgs[1:]) == kv.numel() * 2
