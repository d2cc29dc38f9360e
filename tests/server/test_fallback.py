"""Predictor mismatch: a decoder whose predictor computes another mu (here: one bit of
one scalar flipped, as another GPU or library build would) makes the encoder fall
back to a stored stream, so the transfer still completes bit-exact; the fallback is
reported (SubmitResponse, TransferResult), counted on both sides, logged once per peer."""
from __future__ import annotations

import logging
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from sidecars import LoopThread

from speckv.client.client import DecoderClient, EncoderClient
from speckv.coder.codec import bf16_bits
from speckv.server.app import create_server
from speckv.server.config import ServerConfig
from speckv.server.runtime import Runtime

MODEL = "SmolLM2-135M-Instruct"


class SkewedPredictor:
    """The real predictor with one bit of its mu flipped (same pin, other numerics)."""

    def __init__(self, inner) -> None:
        self.inner, self.checkpoint, self.model = inner, inner.checkpoint, inner.model

    @property
    def pin(self) -> str:
        return self.inner.pin

    def mu(self, ids):
        m = self.inner.mu(ids).clone()
        m.view(torch.int16).view(-1)[7] ^= 1
        return m


@pytest.fixture(scope="module")
def skewed_pair(embedded_session):
    loop = LoopThread()
    made = []

    def start(role, predictor):
        config = ServerConfig(role=role, metrics_port=0)

        async def make():
            s, port = create_server(config, Runtime.from_predictor(predictor, config))
            await s.start()
            return s, f"127.0.0.1:{port}"
        made.append(loop.run(make()))
        return made[-1]

    dec = start("decoder", SkewedPredictor(embedded_session.predictor))
    enc = start("encoder", embedded_session.predictor)
    yield enc, dec
    for s, _ in made:
        loop.run(s.stop(0.1))
    loop.close()


def _metric(sidecar, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_mismatch_falls_back_to_stored_and_stays_bit_exact(skewed_pair, embedded_session, caplog):
    (enc, eaddr), (dec, daddr) = skewed_pair
    target = embedded_session.target
    results = []
    with caplog.at_level(logging.WARNING, logger="speckv"):
        for k, text in enumerate(["The predictors disagree by one bit.", "A second transfer to the same peer."]):
            ids = target.tokenize(text)
            kv = target.kv(ids)
            with EncoderClient(eaddr) as e, DecoderClient(daddr) as d, ThreadPoolExecutor(1) as pool:
                fut = pool.submit(d.fetch, f"fb-{k}", 30, 60)
                res = e.submit(f"fb-{k}", kv, ids, daddr, MODEL, timeout=60)
                back = fut.result(60)
            assert np.array_equal(back, bf16_bits(kv))  # still lossless
            assert res.fallback is True and res.encoding == "stored"
            assert res.wire_bytes > res.raw_bytes  # stored: not compressed
            results.append(res)
    assert _metric(enc, "speckv_fallbacks_total") == 2 and _metric(dec, "speckv_fallbacks_total") == 2
    warnings = [r for r in caplog.records if "back to" in r.getMessage() and r.levelno == logging.WARNING]
    assert len([r for r in warnings if r.name == "speckv.server.encoder"]) == 1  # once per peer
    assert len([r for r in warnings if r.name == "speckv.server.decoder"]) == 1


def test_matching_predictors_do_not_fall_back(sidecars, embedded_session):
    dec, daddr = sidecars.start("decoder")
    enc, eaddr = sidecars.start("encoder")
    try:
        ids = embedded_session.target.tokenize("Same predictor on both sides.")
        kv = embedded_session.target.kv(ids)
        with EncoderClient(eaddr) as e, DecoderClient(daddr) as d:
            res = e.submit("nofb", kv, ids, daddr, MODEL, timeout=60)
            assert np.array_equal(d.fetch("nofb", 30, 60), bf16_bits(kv))
        assert res.fallback is False and res.encoding == "speckv" and res.wire_bytes < res.raw_bytes / 2
    finally:
        sidecars.stop(enc, 0.1)
        sidecars.stop(dec, 0.1)
