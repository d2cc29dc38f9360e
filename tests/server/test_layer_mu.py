"""LayerMu: the predictor's mu arriving layer by layer (no whole-mu gate), its errors,
and stop() ending a pass that nobody needs any more."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from speckv.digests import BLAKE2B_128, XXH3_128, digest
from speckv.server.layer_mu import LayerMu, PredictorStopped

SHAPE = (4, 2, 1, 3, 2)  # (layers, 2, heads, tokens, dim)
MU = np.arange(np.prod(SHAPE), dtype=np.uint16).reshape(SHAPE)


class Stepped:
    """Emits layer i once step[i] is set; ``fail_at`` raises there instead; ``emitted`` counts."""

    def __init__(self, fail_at: int | None = None, layers: int = SHAPE[0]) -> None:
        self.steps = [threading.Event() for _ in range(SHAPE[0])]
        self.fail_at, self.layers, self.emitted = fail_at, layers, 0

    def stream(self, ids, on_layer, fp8_attention=None):
        assert fp8_attention is None
        for i in range(self.layers):
            assert self.steps[i].wait(30)
            if i == self.fail_at:
                raise ValueError("predictor broke at layer 2")
            on_layer(i, MU[i])
            self.emitted += 1
        return MU


def released(p: Stepped) -> LayerMu:
    """A pass over ``p`` with every step let through (call inside a running loop)."""
    mu = LayerMu.start(p, np.zeros(3, np.int64), SHAPE)
    for e in p.steps:
        e.set()
    return mu


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_layers_arrive_one_by_one_and_match():
    async def go():
        p = Stepped()
        mu = LayerMu.start(p, np.zeros(3, np.int64), SHAPE)
        p.steps[0].set()
        bits = await mu.upto(1)
        assert mu.count >= 1 and np.array_equal(bits[0], MU[0])
        waiter = asyncio.ensure_future(mu.upto(3))
        await asyncio.sleep(0.05)
        assert not waiter.done() and mu.count == 1  # layers 1.. are not there yet
        for e in p.steps:
            e.set()
        await waiter
        assert await mu.digest_of(2, 4, XXH3_128) == digest(MU[2:4], algorithm=XXH3_128)
        assert await mu.digest_of(2, 4, BLAKE2B_128) == digest(MU[2:4], algorithm=BLAKE2B_128)
        assert await mu.done() >= 0 and np.array_equal(mu.bits, MU)
        # when each layer existed: layer 0 before the held ones, a range's time its last layer's
        t = mu.ready_at
        assert np.isfinite(t).all() and (np.diff(t) >= 0).all() and t[1] - t[0] >= 0.05, t
        assert mu.ready_time(0, 1) == t[0] and mu.ready_time(1, 4) == t[3]
    run(go())


def test_predictor_error_reaches_every_waiter():
    async def go():
        mu = released(Stepped(fail_at=2))
        assert np.array_equal((await mu.upto(2))[:2], MU[:2])  # layers before the failure still serve
        with pytest.raises(ValueError, match="layer 2"):
            await mu.upto(3)
        with pytest.raises(ValueError):
            await mu.done()
    run(go())


def test_a_predictor_short_of_layers_is_an_error():
    async def go():
        mu = released(Stepped(layers=3))
        with pytest.raises(RuntimeError, match="3 of 4 layers"):
            await mu.upto(4)
    run(go())


def test_stop_ends_the_pass_at_its_next_layer():
    async def go():
        p = Stepped()
        mu = LayerMu.start(p, np.zeros(3, np.int64), SHAPE)
        p.steps[0].set()
        await mu.upto(1)
        mu.stop()
        with pytest.raises(PredictorStopped):
            await mu.upto(2)
        for e in p.steps:
            e.set()
        await asyncio.wait([mu.task], timeout=10)
        assert isinstance(mu.task.exception(), PredictorStopped) and p.emitted == 1
    run(go())


def test_a_pass_is_marked_running_while_it_streams():
    from speckv import heap

    seen: list[int] = []

    class Counting(Stepped):
        def stream(self, ids, on_layer, fp8_attention=None):
            seen.append(heap.passes_running())
            return super().stream(ids, on_layer, fp8_attention)

    async def go():
        mu = released(Counting())
        await mu.done()

    run(go())
    assert seen == [1] and heap.passes_running() == 0
