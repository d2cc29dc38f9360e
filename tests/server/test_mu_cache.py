"""MuCache: a prompt seen again costs no second predictor pass; transfers of one prompt
in flight together share one pass; a pass nobody needs is stopped; finished passes are
kept least-recently-used first out within the byte cap (0: off)."""
from __future__ import annotations

import asyncio
import threading

import numpy as np

from speckv.server.layer_mu import LayerMu, PredictorStopped
from speckv.server.mu_cache import MuCache

LAYERS, HEADS, DIM = 3, 1, 4


class Predictor:
    def __init__(self) -> None:
        self.passes = 0
        self.gate = threading.Event()
        self.gate.set()

    def stream(self, ids, on_layer, fp8_attention=None):
        assert fp8_attention is None
        self.passes += 1
        for i in range(LAYERS):
            assert self.gate.wait(30)
            on_layer(i, np.full((2, HEADS, len(ids), DIM), len(ids) + i, np.uint16))


class Runtime:
    def __init__(self) -> None:
        self.predictor = Predictor()

    def mu_layers(self, ids, fp8_attention=None) -> LayerMu:
        assert fp8_attention is None
        return LayerMu.start(self.predictor, ids, (LAYERS, 2, HEADS, len(ids), DIM))


def nbytes(tokens: int) -> int:
    return LAYERS * 2 * HEADS * tokens * DIM * 2


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_finished_pass_is_reused_and_bit_equal():
    async def go():
        rt, cache = Runtime(), MuCache(1 << 20)
        a, hit_a = cache.take(rt, np.arange(5))
        await a.done()
        cache.give_back(a)
        b, hit_b = cache.take(rt, np.arange(5))
        assert (hit_a, hit_b, b is a, rt.predictor.passes) == (False, True, True, 1)
        c, hit_c = cache.take(rt, np.arange(6))  # another prompt: another pass
        await c.done()
        assert hit_c is False and rt.predictor.passes == 2
        assert not np.array_equal(c.bits[0, 0, 0, 0], b.bits[0, 0, 0, 0])
    run(go())


def test_transfers_in_flight_share_one_pass_and_the_last_one_out_stops_it():
    async def go():
        rt, cache = Runtime(), MuCache(1 << 20)
        rt.predictor.gate.clear()
        a, _ = cache.take(rt, np.arange(5))
        b, hit = cache.take(rt, np.arange(5))
        assert b is a and hit and rt.predictor.passes <= 1
        cache.give_back(a)  # b still uses it: it keeps running
        assert a.error is None
        cache.give_back(b)  # nobody does: stopped and dropped
        assert isinstance(a.error, PredictorStopped) and len(cache) == 0
        rt.predictor.gate.set()
        c, hit = cache.take(rt, np.arange(5))
        await c.done()
        assert c is not a and not hit
    run(go())


def test_lru_eviction_within_the_byte_cap_and_zero_disables():
    async def go():
        rt, cache = Runtime(), MuCache(2 * nbytes(4))
        for n in (4, 5):  # 4 fits, then 4 + 5 tokens do not: 4 (least recent, unused) goes
            mu, _ = cache.take(rt, np.arange(n))
            await mu.done()
            cache.give_back(mu)
        assert len(cache) == 1 and cache.nbytes == nbytes(5)
        off = MuCache(0)
        mu, _ = off.take(rt, np.arange(4))
        await mu.done()
        off.give_back(mu)
        again, hit = off.take(rt, np.arange(4))
        assert not hit and again is not mu and len(off) == 0
    run(go())


def test_a_running_pass_counts_so_a_finished_one_never_stays_beside_it():
    """The byte cap holds one prompt's mu (the default's shape): the next prompt's pass, still
    running, evicts the finished one at once, so two prompts' mu are never resident together; a
    finished pass some transfer still uses stays until given back."""
    async def go():
        rt, cache = Runtime(), MuCache(nbytes(5) + nbytes(4) - 1)
        first, _ = cache.take(rt, np.arange(4))
        await first.done()
        cache.give_back(first)
        rt.predictor.gate.clear()  # the next pass stops before its first layer
        second, hit = cache.take(rt, np.arange(5))
        assert not hit and second.count == 0
        assert len(cache) == 1 and cache.nbytes == nbytes(5)  # first went when second started
        rt.predictor.gate.set()
        await second.done()
        third, _ = cache.take(rt, np.arange(6))  # second is still in use: it stays beside third
        assert len(cache) == 2 and cache.nbytes == nbytes(5) + nbytes(6)
        await third.done()
        cache.give_back(second)  # out of use now, and it does not fit beside third
        assert len(cache) == 1 and cache.nbytes == nbytes(6)
        cache.give_back(third)
    run(go())
