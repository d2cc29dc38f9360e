"""The encoder's second predictor pass after a disagreement (server/mu_recheck.py): a first
pass gone wrong once is recovered (the transfer stays coded, an error is logged, the wrong
pass leaves the mu cache); a decoder that computes another mu every time costs one second
pass per peer, not one per transfer; a pass that differs every time goes stored."""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import urllib.request
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from test_fallback import MODEL, SKEW_LAYER, SkewedPredictor, WrappedPredictor, _transfer, running_pair

from speckv.client.client import EncoderClient, RpcFailed
from speckv.coder.codec import bf16_bits
from speckv.server import mu_recheck
from speckv.server.replies import Checks


class FlakyPredictor(WrappedPredictor):
    """The real predictor, with one bit of layer ``wrong[n]`` flipped in pass n (0: the first pass)."""

    def __init__(self, inner, wrong: dict[int, int]) -> None:
        super().__init__(inner)
        self.wrong, self.passes, self._lock, self.local = wrong, 0, threading.Lock(), threading.local()

    def skew(self, bits: np.ndarray) -> None:
        with self._lock:
            n, self.passes = self.passes, self.passes + 1
        self.local.n = n  # the pass this thread emits (``emit``)
        if n in self.wrong:
            bits[self.wrong[n]].reshape(-1)[3 + n] ^= 1  # NOTE: another bit each pass: no two wrong passes agree


def outcomes(sidecar) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10).read().decode()
    found = {m.group(1): float(m.group(2)) for m in
             re.finditer(r'^speckv_mu_rechecks_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$', text, re.M)}
    assert set(found) == {"same", "recovered", "unstable", "error"}  # every series from the start
    return {k: v for k, v in found.items() if v}


def _run(enc_predictor, dec_predictor, target, texts, caplog):
    results = []
    with running_pair(enc_predictor, dec_predictor) as ((enc, eaddr), (dec, daddr)):
        with caplog.at_level(logging.WARNING, logger="speckv"):
            for k, text in enumerate(texts):
                ids = target.tokenize(text)
                kv = target.kv(ids)
                res, back = _transfer(eaddr, daddr, f"rc-{k}-{id(enc_predictor)}", kv, ids)
                assert np.array_equal(back, bf16_bits(kv))  # lossless whatever the outcome
                results.append(res)
        assert not enc.service.mu_cache._users  # every pass given back once, the second ones included
        return results, outcomes(enc)


def test_a_first_pass_gone_wrong_is_recovered_and_logged(embedded_session, caplog):
    flaky = FlakyPredictor(embedded_session.predictor, wrong={0: 0})
    texts = ["The first pass here goes wrong once.", "A later transfer needs no second pass."]
    (first, later, again), counts = _run(flaky, embedded_session.predictor, embedded_session.target,
                                         texts + texts[:1], caplog)
    assert (first.fallback, first.encoding, first.stored_chunks) == (False, "speckv", 0), first
    assert [(r.fallback, r.stored_chunks) for r in (later, again)] == [(False, 0)] * 2
    assert first.wire_bytes < first.raw_bytes / 2  # coded under the second pass
    assert counts == {"recovered": 1}
    # two passes for the first prompt, one for the second; the first prompt again: the mu cache holds
    # its second pass, not the wrong first one
    assert flaky.passes == 3
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "two different mu" in errors[0] and "goes on coded" in errors[0], errors
    # the log names both passes' layer digests: layer 0 differs between them, layer 1 does not
    first_pass, second_pass = (dict(p.split(":") for p in part.split("mu layers ")[1].split(";")[0].split())
                               for part in errors[0].split("; second "))
    assert first_pass["0"] != second_pass["0"] and first_pass["1"] == second_pass["1"]
    assert "layer 0: 1 of " in errors[0] and "layer 1:" not in errors[0]  # where they differ: one scalar
    assert not [r for r in caplog.records if "computes another mu" in r.getMessage()]  # nothing went stored


def test_a_peer_that_computes_another_mu_costs_one_second_pass(embedded_session, caplog):
    # the decoder flips a bit of layer SKEW_LAYER every time: the encoder's second pass repeats its first
    skewed = SkewedPredictor(embedded_session.predictor)
    counting = FlakyPredictor(embedded_session.predictor, wrong={})
    texts = ["The decoder computes another mu.", "Again.", "And again."]
    results, counts = _run(counting, skewed, embedded_session.target, texts, caplog)
    assert [(r.fallback, r.stored_chunks) for r in results] == [(True, 1)] * 3
    assert counts == {"same": 1}  # settled for this peer: the next transfers go stored without one
    assert counting.passes == 4
    assert not [r for r in caplog.records if r.levelno == logging.ERROR]
    warned = [r.getMessage() for r in caplog.records if "computes another mu" in r.getMessage()]
    assert len(warned) == 1 and f"chunks [{SKEW_LAYER // 2}]" in warned[0]


def test_a_pass_that_differs_every_time_goes_stored(embedded_session, caplog):
    unstable = FlakyPredictor(embedded_session.predictor, wrong=dict.fromkeys(range(4), 0))
    (res,), counts = _run(unstable, embedded_session.predictor, embedded_session.target,
                          ["Every pass here differs."], caplog)
    assert (res.fallback, res.encoding, res.stored_chunks) == (True, "speckv", 1), res
    assert counts == {"unstable": 1}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "the chunks go stored" in errors[0]


class SwitchedSkew(SkewedPredictor):
    """A decoder that computes another mu only while ``on`` (a peer restarted on other numerics and back)."""

    on = True

    def skew(self, bits: np.ndarray) -> None:
        if self.on:
            super().skew(bits)


def test_a_peer_that_agreed_on_a_whole_transfer_gets_a_second_pass_again(embedded_session, caplog):
    switched, counting = SwitchedSkew(embedded_session.predictor), FlakyPredictor(embedded_session.predictor, {})
    target = embedded_session.target
    with running_pair(counting, switched) as ((enc, eaddr), (_, daddr)):
        stored = []
        for k, on in enumerate([True, True, False, True]):
            switched.on = on
            ids = target.tokenize(f"Transfer {k} to a peer that changes.")
            res, _ = _transfer(eaddr, daddr, f"sw-{k}", target.kv(ids), ids)
            stored.append(res.stored_chunks)
        assert stored == [1, 1, 0, 1]
        assert outcomes(enc) == {"same": 2}  # the first and the last: the third agreed on every chunk
        assert counting.passes == 6


def test_a_second_pass_wrong_elsewhere_in_the_batch_does_not_code_under_it(embedded_session, caplog):
    # the first pass is wrong in layer 0 (chunk 0), the second in layer 2 (chunk 1): the second pass
    # must not code chunk 1 where it shares chunk 0's batch (the decoder would decode it under
    # another mu: DATA_LOSS); either way one chunk goes stored and the transfer is lossless
    flaky = FlakyPredictor(embedded_session.predictor, wrong={0: 0, 1: 2})
    (res,), counts = _run(flaky, embedded_session.predictor, embedded_session.target,
                          ["The second pass goes wrong elsewhere."], caplog)
    assert (res.fallback, res.stored_chunks) == (True, 1), res
    assert counts in ({"unstable": 1}, {"recovered": 1}), counts  # chunk 1 in chunk 0's batch, or later


class SlowSecond(FlakyPredictor):
    """Wrong in layer 0 on its first pass; its second pass holds layer 1 until ``gate`` opens."""

    def __init__(self, inner, gate: threading.Event) -> None:
        super().__init__(inner, {0: 0})
        self.gate = gate

    def emit(self, i: int, layer: np.ndarray, on_layer) -> None:
        if self.local.n == 1 and i == 1:
            self.gate.wait(60)
        on_layer(i, layer)


def test_a_transfer_that_ends_during_its_second_pass_gives_that_pass_back(embedded_session):
    gate = threading.Event()
    slow = SlowSecond(embedded_session.predictor, gate)
    target = embedded_session.target
    with running_pair(slow, embedded_session.predictor) as ((enc, eaddr), (_, daddr)):
        ids = target.tokenize("This transfer times out while its second pass runs.")
        kv = target.kv(ids)
        with EncoderClient(eaddr) as e, pytest.raises(RpcFailed) as ei:
            e.submit("rc-slow", kv, ids, daddr, MODEL, timeout=3)
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert slow.passes == 2  # the second pass was running, held at layer 1
        gate.set()
        cache = enc.service.mu_cache
        deadline = time.monotonic() + 30
        while cache._users and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not cache._users  # both passes given back (the held one stopped at its next layer)


class DigestsOf:
    """A LayerMu stand-in: each chunk's digest given (chunk i = layers 2i, 2i + 1)."""

    def __init__(self, chunks: dict[int, bytes]) -> None:
        self.chunks = chunks

    async def digest_of(self, start: int, stop: int, algorithm: int) -> bytes:
        return self.chunks[start // 2]


@pytest.mark.parametrize("second, want", [
    ({0: b"d", 1: b"d"}, mu_recheck.RECOVERED),  # the second pass agrees with the decoder on the whole batch
    ({0: b"d", 1: b"x"}, mu_recheck.UNSTABLE),  # right on chunk 0, wrong on chunk 1: nothing coded under it
    ({0: b"a", 1: b"d"}, mu_recheck.SAME),  # repeats the first on the disagreeing chunk
    ({0: b"y", 1: b"d"}, mu_recheck.UNSTABLE),  # differs from both there
])
def test_compare_needs_the_decoder_on_every_chunk_of_the_batch(second, want):
    job = SimpleNamespace(h=SimpleNamespace(version=5, chunk_layers=lambda i: (2 * i, 2)))
    first = DigestsOf({0: b"a", 1: b"d"})  # disagrees with the decoder ("d") on chunk 0 only

    async def outcome() -> str:
        checks = Checks(2)
        for i in (0, 1):
            checks.get(i).set_result(b"d")
        return await mu_recheck.compare(first, DigestsOf(second), job, [0, 1], {0}, checks)

    assert asyncio.run(outcome()) == want
