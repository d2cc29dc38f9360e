"""The in-flight byte cap: ByteBudget/Holding on their own (asyncio), then the
cap holding through real transfers several times its size, with backpressure
(a slow fetcher, a slow submitter) that must not deadlock."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from server_helpers import (
    MODEL,
    WAIT,
    Pair,
    assert_same_kv,
    budgets_drain,
    raw_submit,
    raw_submit_future,
    rid,
    submit_list,
)

from speckv.client.client import RpcFailed
from speckv.coder.codec import bf16_bits
from speckv.server.budget import BudgetExceeded, ByteBudget, HoldingClosed

CAP = 128 * 1024
MSG = 64 * 1024  # the smallest message_bytes the config allows


# -- ByteBudget / Holding ---------------------------------------------------------

def test_acquire_beyond_cap_raises_budget_exceeded():
    async def main():
        b = ByteBudget(1000)
        h = b.holding()
        with pytest.raises(BudgetExceeded, match="1001 bytes exceed"):
            await h.acquire(1001)
        assert (b.used, h.held) == (0, 0)
        await h.acquire(1000)  # exactly the cap fits
        assert (b.used, h.held) == (1000, 1000)
        h.close()
        assert b.used == 0

    asyncio.run(main())


def test_waiting_acquire_resumes_after_release():
    async def main():
        seen = []
        b = ByteBudget(100, seen.append)
        h1, h2 = b.holding(), b.holding()
        await h1.acquire(80)
        waiter = asyncio.ensure_future(h2.acquire(30))
        await asyncio.sleep(0.02)
        assert not waiter.done() and b.used == 80  # 80 + 30 > 100: it waits
        h1.release(40)
        await asyncio.wait_for(waiter, 5)
        assert (b.used, h1.held, h2.held) == (70, 40, 30)
        h1.release(1000)  # more than held: gives back what it holds, no more
        assert (b.used, h1.held) == (30, 0)
        h2.close()
        assert b.used == 0
        assert seen == [80, 40, 70, 30, 0]

    asyncio.run(main())


def test_close_wakes_waiters_with_holding_closed():
    async def main():
        b = ByteBudget(100)
        h1, h2 = b.holding(), b.holding()
        await h1.acquire(100)
        waiter = asyncio.ensure_future(h2.acquire(10))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        h2.close()  # its transfer ended while it waited
        with pytest.raises(HoldingClosed):
            await asyncio.wait_for(waiter, 5)
        assert (b.used, h2.held) == (100, 0)
        with pytest.raises(HoldingClosed):
            await h2.acquire(1)  # a closed holding grants nothing
        h1.close()
        h1.close()  # idempotent
        assert b.used == 0

    asyncio.run(main())


def test_release_wakes_several_waiters_in_turn():
    async def main():
        b = ByteBudget(10)
        owner = b.holding()
        await owner.acquire(10)
        hs = [b.holding() for _ in range(3)]
        waiters = [asyncio.ensure_future(h.acquire(5)) for h in hs]
        await asyncio.sleep(0.02)
        owner.close()
        for _ in range(100):
            await asyncio.sleep(0.005)
            if sum(w.done() for w in waiters) >= 2:
                break
        done = [w for w in waiters if w.done()]
        pending = [w for w in waiters if not w.done()]
        assert len(done) == 2 and len(pending) == 1 and b.used == 10  # two of 5 fit in 10
        for h, w in zip(hs, waiters, strict=True):
            if w in done:
                h.close()
        await asyncio.wait_for(asyncio.gather(*pending), 5)
        assert b.used == 5

    asyncio.run(main())


# -- the cap through real transfers -------------------------------------------------

@pytest.fixture(scope="module")
def small(sidecars):
    """A pair whose caps are a tenth of one KV: 128 KiB each, 64 KiB messages."""
    p = Pair.start(sidecars, max_inflight_bytes=CAP, message_bytes=MSG)
    yield p
    p.stop()


class Peak:
    """The highest ``budget.used`` of both sidecars during a block: every value the
    budget reports (its on_change hook, wrapped) and a thread polling ``used``."""

    def __init__(self, pair: Pair) -> None:
        self.sides = {s.config.role: s.service.budget for s in (pair.decoder, pair.encoder)}
        self.peak = dict.fromkeys(self.sides, 0)
        self.polled = dict.fromkeys(self.sides, 0)
        self.changes = dict.fromkeys(self.sides, 0)
        self.samples = 0
        self._saved = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _hook(self, role: str, budget: ByteBudget):
        orig = budget._on_change

        def on_change(used: int) -> None:
            self.peak[role] = max(self.peak[role], used)
            self.changes[role] += 1
            orig(used)

        return orig, on_change

    def _poll(self) -> None:
        while not self._stop.is_set():
            for role, budget in self.sides.items():
                self.polled[role] = max(self.polled[role], budget.used)
            self.samples += 1
            time.sleep(0.002)

    def __enter__(self) -> "Peak":
        for role, budget in self.sides.items():
            self._saved[role], budget._on_change = self._hook(role, budget)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for role, budget in self.sides.items():
            budget._on_change = self._saved[role]

    def check(self, cap: int) -> None:
        assert self.samples > 10 and min(self.changes.values()) > 10, (self.samples, self.changes)
        for role in self.sides:
            assert 0 < self.peak[role] <= cap, (role, self.peak, cap)
            assert self.polled[role] <= self.peak[role], (role, self.polled, self.peak)


def test_transfer_of_several_caps_stays_bounded(small, prompts):
    ids, kv = prompts("long")
    raw = bf16_bits(kv).nbytes
    assert raw >= 8 * CAP, f"prompt too short to exceed the cap ({raw} bytes)"
    with Peak(small) as peak:
        res, got = small.transfer(rid("big"), kv, ids)
    assert_same_kv(got, kv)
    assert res.raw_bytes == raw and res.chunks == 30  # one layer per chunk under this cap
    peak.check(CAP)
    budgets_drain(small)


def test_slow_fetcher_backpressure_does_not_deadlock(small, prompts):
    """The decode engine takes its layers slowly: the decoder's budget fills up and
    stops reading, the encoder's fills up and stops reading the engine; all of it
    must still arrive, in bounded memory."""
    ids, kv = prompts("long")
    want = bf16_bits(kv)

    def slow_fetch(dec, r):
        out = []
        for layer, arr, _scales in dec.fetch_layers(r, wait=WAIT, timeout=WAIT):
            time.sleep(0.02)
            out.append((layer, arr))
        return out

    with Peak(small) as peak:
        res, layers = small.transfer(rid("slow"), kv, ids, fetch=slow_fetch)
    assert [k for k, _ in layers] == list(range(30))
    assert all(np.array_equal(arr, want[k]) for k, arr in layers)
    assert res.raw_bytes == want.nbytes
    peak.check(CAP)
    # the fetcher was the bottleneck: the decoder buffered at least half its cap
    assert peak.peak["decoder"] >= CAP // 2, peak.peak
    budgets_drain(small)


def test_stored_records_and_layers_in_many_parts(small, prompts):
    """A stored transfer (records as large as their raw layers) with the engine's
    layers in 16 KiB KVLayer parts: bounded and bit-exact."""
    ids, kv = prompts("long")
    r = rid("parts")
    reqs = submit_list(r, kv, ids, small.daddr, encoding="stored", part_bytes=16 * 1024)
    assert len(reqs) == 1 + 30 * 3  # every 42 KiB layer in 3 parts
    with Peak(small) as peak, ThreadPoolExecutor(1) as pool:
        fetched = pool.submit(small.dec.fetch, r, WAIT, WAIT)
        fut, ch = raw_submit_future(small.eaddr, reqs)
        try:
            resp = fut.result(timeout=WAIT)
        finally:
            ch.close()
        got = fetched.result(timeout=WAIT)
    assert_same_kv(got, kv)
    assert resp.raw_bytes == bf16_bits(kv).nbytes < resp.wire_bytes
    peak.check(CAP)
    budgets_drain(small)


def test_layer_larger_than_half_the_cap_is_resource_exhausted(small):
    tokens = 200  # one layer: 2 * 3 * 200 * 64 * 2 = 153600 bytes > CAP / 2
    ids = np.arange(100, 100 + tokens, dtype=np.int64)
    kv = np.zeros((30, 2, 3, tokens, 64), np.uint16)
    with pytest.raises(RpcFailed) as ei:
        small.enc.submit(rid("huge"), kv, ids, small.daddr, MODEL, timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "153600" in ei.value.details and str(CAP) in ei.value.details
    budgets_drain(small)


def test_max_tokens_is_resource_exhausted(sidecars, prompts):
    p = Pair.start(sidecars, encoder={"max_tokens": 8})
    try:
        ids, kv = prompts("short")
        assert len(ids) > 8
        e = raw_submit(p.eaddr, submit_list(rid("toolong"), kv, ids, p.daddr))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "1 to 8" in e.details()
    finally:
        p.stop()
