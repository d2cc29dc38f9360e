"""Per-chunk predictor checks: a decoder whose predictor computes another mu for some
layers (here: one bit of one scalar flipped in layer SKEW_LAYER, as another GPU or
library build would) gets only that chunk stored; every other chunk stays coded and
the transfer stays bit-exact. The stored chunks are reported (SubmitResponse,
TransferResult), counted on both sides by reason, logged once per peer. And no
whole-mu gate: chunk 0 reaches the decode engine while both predictors are still
short of their last layers."""
from __future__ import annotations

import contextlib
import logging
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from server_helpers import assert_timeline
from sidecars import LoopThread

from speckv.client.client import DecoderClient, EncoderClient
from speckv.coder.codec import bf16_bits
from speckv.server.app import create_server
from speckv.server.config import ServerConfig
from speckv.server.runtime import Runtime

MODEL = "SmolLM2-135M-Instruct"
SKEW_LAYER = 5  # in chunk 2 (2 layers per chunk)


class WrappedPredictor:
    """The real predictor, its mu passed to ``on_layer`` through ``emit`` (same pin)."""

    def __init__(self, inner) -> None:
        self.inner, self.checkpoint, self.model = inner, inner.checkpoint, inner.model

    @property
    def pin(self) -> str:
        return self.inner.pin

    @property
    def device(self) -> str:
        return self.inner.device

    def mu(self, ids, on_layer=None, fp8_attention=None):
        m = self.inner.mu(ids, fp8_attention=fp8_attention)  # the whole pass first: no lock held while emit waits
        bits = bf16_bits(m).copy()
        self.skew(bits)
        for i in range(bits.shape[0] if on_layer else 0):
            self.emit(i, bits[i], on_layer)
        return m

    def stream(self, ids, on_layer, fp8_attention=None) -> None:
        self.mu(ids, on_layer, fp8_attention)

    def skew(self, bits: np.ndarray) -> None:
        pass

    def emit(self, i: int, layer: np.ndarray, on_layer) -> None:
        on_layer(i, layer)


class SkewedPredictor(WrappedPredictor):
    def skew(self, bits: np.ndarray) -> None:
        bits[SKEW_LAYER].reshape(-1)[7] ^= 1


class GatedPredictor(WrappedPredictor):
    """Holds every layer from ``hold_from`` on until ``gate`` opens."""

    def __init__(self, inner, gate: threading.Event, hold_from: int) -> None:
        super().__init__(inner)
        self.gate, self.hold_from = gate, hold_from

    def emit(self, i: int, layer: np.ndarray, on_layer) -> None:
        if i >= self.hold_from:
            self.gate.wait(120)
        on_layer(i, layer)


def _start_pair(loop: LoopThread, enc_predictor, dec_predictor, dec_model: str | None = None):
    made = []
    for role, predictor in (("decoder", dec_predictor), ("encoder", enc_predictor)):
        config = ServerConfig(role=role, metrics_port=0, model_id=dec_model if role == "decoder" else None)

        async def make(config=config, predictor=predictor):
            s, port = create_server(config, Runtime.from_predictor(predictor, config))
            await s.start()
            return s, f"127.0.0.1:{port}"
        made.append(loop.run(make()))
    return made


@contextlib.contextmanager
def running_pair(enc_predictor, dec_predictor, dec_model: str | None = None):
    """An in-process encoder and decoder around these predictors: ((enc, eaddr), (dec, daddr)),
    both stopped on exit (``dec_model``: the model id the decoder serves, default the checkpoint's)."""
    loop = LoopThread()
    made = _start_pair(loop, enc_predictor, dec_predictor, dec_model)
    (dec, daddr), (enc, eaddr) = made
    try:
        yield (enc, eaddr), (dec, daddr)
    finally:
        for s, _ in made:
            loop.run(s.stop(0.1))
        loop.close()


@pytest.fixture(scope="module")
def skewed_pair(embedded_session):
    loop = LoopThread()
    (dec, daddr), (enc, eaddr) = made = _start_pair(loop, embedded_session.predictor,
                                                    SkewedPredictor(embedded_session.predictor))
    yield (enc, eaddr), (dec, daddr)
    for s, _ in made:
        loop.run(s.stop(0.1))
    loop.close()


def _metric(sidecar, name: str, reason: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'reason="{reason}"' in line)


def _transfer(eaddr, daddr, rid, kv, ids):
    with EncoderClient(eaddr) as e, DecoderClient(daddr) as d, ThreadPoolExecutor(1) as pool:
        fut = pool.submit(d.fetch, rid, 30, 60)
        res = e.submit(rid, kv, ids, daddr, MODEL, timeout=60)
        return res, fut.result(60)


def test_a_mismatch_sends_only_its_chunk_stored_and_stays_bit_exact(skewed_pair, embedded_session, caplog):
    (enc, eaddr), (dec, daddr) = skewed_pair
    target = embedded_session.target
    with caplog.at_level(logging.WARNING, logger="speckv"):
        for k, text in enumerate(["The predictors disagree by one bit.", "A second transfer to the same peer."]):
            ids = target.tokenize(text)
            kv = target.kv(ids)
            res, back = _transfer(eaddr, daddr, f"fb-{k}", kv, ids)
            assert np.array_equal(back, bf16_bits(kv))  # still lossless
            assert (res.fallback, res.encoding, res.stored_chunks, res.chunks) == (True, "speckv", 1, 15), res
            assert res.wire_bytes < res.raw_bytes / 2  # the other 14 chunks are still coded
    for side in (enc, dec):
        assert _metric(side, "speckv_fallbacks_total", "mu_mismatch") == 2
        assert _metric(side, "speckv_fallbacks_total", "larger_than_stored") == 0
        assert _metric(side, "speckv_fallback_transfers_total", "mu_mismatch") == 2  # one chunk each of two
        assert _metric(side, "speckv_fallback_transfers_total", "larger_than_stored") == 0
    warnings = [r for r in caplog.records if "mu" in r.getMessage() and r.levelno == logging.WARNING]
    assert len([r for r in warnings if r.name == "speckv.server.encoder"]) == 1  # once per peer
    assert len([r for r in warnings if r.name == "speckv.server.decoder"]) == 1
    enc_log, dec_log = (next(r.getMessage() for r in warnings if r.name == f"speckv.server.{side}")
                        for side in ("encoder", "decoder"))
    assert "chunks [2]" in enc_log
    # each side's log names the prompt and its layers' digests: the same prompt, the one skewed layer differs
    here = [dict(p.split(":") for p in log.split("mu layers ")[1].split()) for log in (enc_log, dec_log)]
    assert enc_log.split("prompt ")[1].split(",")[0] == dec_log.split("prompt ")[1].split(",")[0]
    skewed, other = str(SKEW_LAYER), str(SKEW_LAYER - 1)  # chunk 2: layers 4 and 5
    assert sorted(here[0]) == sorted(here[1]) == [other, skewed]
    assert here[0][skewed] != here[1][skewed] and here[0][other] == here[1][other]


def test_matching_predictors_do_not_fall_back(sidecars, embedded_session):
    dec, daddr = sidecars.start("decoder")
    enc, eaddr = sidecars.start("encoder")
    try:
        ids = embedded_session.target.tokenize("Same predictor on both sides.")
        kv = embedded_session.target.kv(ids)
        res, back = _transfer(eaddr, daddr, "nofb", kv, ids)
        assert np.array_equal(back, bf16_bits(kv))
        assert (res.fallback, res.encoding, res.stored_chunks) == (False, "speckv", 0)
        assert res.wire_bytes < res.raw_bytes / 2
    finally:
        sidecars.stop(enc, 0.1)
        sidecars.stop(dec, 0.1)


def test_chunk_zero_is_delivered_before_either_predictor_finishes(embedded_session):
    # both predictors hold their layers 10.. until the gate opens: with a whole-mu gate
    # nothing could reach the decode engine before that
    gate, loop = threading.Event(), LoopThread()
    p = embedded_session.predictor
    made = _start_pair(loop, GatedPredictor(p, gate, 10), GatedPredictor(p, gate, 10))
    (_, daddr), (_, eaddr) = made
    try:
        ids = embedded_session.target.tokenize("No chunk waits for the whole mu.")
        kv = embedded_session.target.kv(ids)
        with EncoderClient(eaddr) as e, DecoderClient(daddr) as d, ThreadPoolExecutor(2) as pool:
            sub = pool.submit(lambda: e.submit("nogate", kv, ids, daddr, MODEL, timeout=60))
            layers = d.fetch_layers("nogate", 30, 60)
            first = next(layers)
            assert not gate.is_set() and not sub.done()  # both predictors are held at layer 10
            gate.set()
            rest = list(layers)
            res = sub.result(60)
        assert res.stored_chunks == 0 and [first[0]] + [r[0] for r in rest] == list(range(kv.shape[0]))
        # the encoder waited for the held layers' mu, and says so
        assert 0 < res.mu_wait_seconds < res.total_seconds and 0 <= res.wire_wait_seconds < res.total_seconds
        # and when: the chunk of the held layer 10 was ready only after chunk 0 had gone (2 layers a chunk)
        assert_timeline(res)
        held = res.chunk_timings[10 // 2]
        assert held.ready_seconds > res.chunk_timings[0].written_seconds, res.chunk_timings
        assert min(held.mu_seconds, held.peer_mu_seconds) > res.chunk_timings[0].written_seconds, held  # both sides' mu
        assert np.array_equal(first[1], bf16_bits(kv)[0])
    finally:
        gate.set()
        for s, _ in made:
            loop.run(s.stop(0.1))
        loop.close()


class OtherPin:
    """A checkpoint under another pin (everything else delegated)."""

    pin = "ab" * 32

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class OtherPinPredictor(WrappedPredictor):
    """The same model under another checkpoint pin, as a rolling upgrade leaves one side."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.checkpoint = OtherPin(inner.checkpoint)

    @property
    def pin(self) -> str:
        return self.checkpoint.pin


def test_a_decoder_under_another_pin_gets_a_stored_stream_not_a_failure(embedded_session, caplog):
    target = embedded_session.target
    with running_pair(embedded_session.predictor, OtherPinPredictor(embedded_session.predictor)) as (
            (enc, eaddr), (dec, daddr)):
        with caplog.at_level(logging.WARNING, logger="speckv"):
            for k, text in enumerate(["A rolling upgrade: two checkpoints live.", "And a second transfer."]):
                ids = target.tokenize(text)
                kv = target.kv(ids)
                res, back = _transfer(eaddr, daddr, f"pin-{k}", kv, ids)
                assert np.array_equal(back, bf16_bits(kv))  # lossless, uncompressed
                assert (res.fallback, res.encoding, res.stored_chunks, res.chunks) == (True, "stored", 0, 15), res
                assert res.wire_bytes > res.raw_bytes
                assert_timeline(res)  # the stream started again stored: one timing per chunk of that one
                assert all(t.mu_seconds == t.peer_mu_seconds == 0 for t in res.chunk_timings)
        assert _metric(enc, "speckv_fallbacks_total", "pin_mismatch") == 2 * 15  # every chunk of both streams
        assert _metric(enc, "speckv_fallbacks_total", "mu_mismatch") == 0
        assert _metric(enc, "speckv_fallback_transfers_total", "pin_mismatch") == 2  # per transfer, not chunk
        assert _metric(dec, "speckv_fallback_transfers_total", "pin_mismatch") == 0  # a plain stored stream there
        warned = [r for r in caplog.records if r.name == "speckv.server.encoder" and "another predictor" in
                  r.getMessage()]
        assert len(warned) == 1  # once per peer
