"""The extension's persistent worker pool (coder/kernels/spk_pool.h): every thread count
writes the same bytes; Python threads calling native code at once (one gets the pool, the
others their own threads) all get the same answer as one call alone; and a forked child,
which holds the pool's memory but none of its workers, runs threaded calls to completion
instead of waiting forever for workers that do not exist there. A core held beside the pool
(``hold_core``: the codec's lookahead helper) starts a job one worker short, and given back
mid-job lets a worker join it.

A missing extension skips these tests on a developer's machine and fails them in CI
(SPECKV_REQUIRE_NATIVE, tests/require.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest
from require import missing

from speckv.coder import native

HEADS, TOKENS, DIM = 3, 512, 64


@pytest.fixture(scope="module")
def inputs():
    if not native.available():
        missing("NATIVE", f"the native coder is not built ({native.IMPORT_ERROR})")
    rng = np.random.default_rng(7)
    mu = rng.integers(0, 1 << 16, size=(4, 2, HEADS, TOKENS, DIM), dtype=np.uint16)
    a = rng.normal(1.0, 0.1, size=(4, 2, HEADS, DIM)).astype(np.float32)
    b = rng.normal(0.0, 0.01, size=(4, 2, HEADS, DIM)).astype(np.float32)
    scales = rng.uniform(0.001, 0.1, size=(4, 2)).astype(np.float32)
    return mu, a, b, scales


def prepared(threads: int, inputs) -> np.ndarray:
    """``prepare_mu`` into an output filled with a sentinel first (NOTE: a fresh np.empty
    often gets the previous call's block back, right answer included, which would hide a pool
    that skipped indices or returned before its workers finished)."""
    mu, a, b, scales = inputs
    out = np.full(mu.shape, 0xA5A5A5A5, np.uint32)
    native._native.prepare_mu(True, mu, a, b, scales, mu.shape[0], HEADS, TOKENS, DIM, out, threads,
                              native.PATHS["auto"])
    return out


def test_every_thread_count_writes_the_same_bytes(inputs):
    want = prepared(1, inputs)
    assert not (want == 0xA5A5A5A5).all(axis=(-2, -1)).any()  # every row written
    for threads in (2, 3, 8, 64, 100):  # 100: capped at MAX_THREADS
        assert prepared(threads, inputs).tobytes() == want.tobytes(), threads


def test_concurrent_callers_share_the_pool_without_waiting_or_mixing(inputs):
    want = prepared(1, inputs).tobytes()
    got: list[bytes] = []
    errors: list[BaseException] = []

    def call(threads: int) -> None:
        try:
            for _ in range(20):
                got.append(prepared(threads, inputs).tobytes())
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    callers = [threading.Thread(target=call, args=(t,), daemon=True) for t in (2, 2, 3, 4)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=120)
    assert not any(c.is_alive() for c in callers), "a native call hung"
    assert not errors, errors
    assert len(got) == 80 and all(g == want for g in got)


def _child(inputs, want: bytes, q) -> None:
    q.put(prepared(2, inputs).tobytes() == want and prepared(4, inputs).tobytes() == want)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_gets_its_own_workers(inputs):
    want = prepared(1, inputs).tobytes()
    assert prepared(2, inputs).tobytes() == want  # the parent's pool has a worker now
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_child, args=(inputs, want, q))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("a threaded native call hung in a forked child")
    assert child.exitcode == 0 and q.get(timeout=5) is True


def stats() -> dict[str, object]:
    held, jobs, short, top_ups, open_, last_want = native._native.pool_stats()
    return {"held": held, "jobs": jobs, "short": short, "top_ups": top_ups, "open": open_, "last_want": last_want}


def test_a_held_core_starts_a_job_one_worker_short(inputs):
    want = prepared(1, inputs).tobytes()
    before = stats()
    native.NativeCoder.hold_core(1)
    try:
        assert stats()["held"] == before["held"] + 1
        assert prepared(2, inputs).tobytes() == want  # the caller alone: no worker allowed
        mid = stats()
        assert (mid["jobs"], mid["short"]) == (before["jobs"] + 1, before["short"] + 1), (before, mid)
        assert stats()["last_want"] == 0
        assert prepared(3, inputs).tobytes() == want  # one worker of two
        assert stats()["short"] == before["short"] + 2 and stats()["last_want"] == 1
    finally:
        native.NativeCoder.hold_core(-1)
    assert prepared(2, inputs).tobytes() == want
    after = stats()
    assert after["held"] == before["held"] and after["short"] == before["short"] + 2, (before, after)


def give_back(done: threading.Event) -> None:
    """Give the held core back once a job is open (or the caller is done)."""
    while not stats()["open"] and not done.is_set():
        time.sleep(0)  # NOTE: lets the GIL go; the job itself runs without it
    native.NativeCoder.hold_core(-1)


def test_a_core_given_back_mid_job_lets_a_worker_join(inputs):
    """The core is given back once a job is open (seen through ``pool_stats``, never a sleep);
    a job short enough to end before the watcher sees it is simply tried again."""
    want = prepared(1, inputs).tobytes()
    for _ in range(50):
        before = stats()
        native.NativeCoder.hold_core(1)
        done = threading.Event()

        watcher = threading.Thread(target=give_back, args=(done,), daemon=True)
        watcher.start()
        try:
            assert prepared(2, inputs).tobytes() == want
        finally:
            done.set()
            watcher.join(timeout=30)
        assert not watcher.is_alive() and stats()["held"] == before["held"]
        if stats()["top_ups"] > before["top_ups"]:
            return
    pytest.fail("no job was topped up in 50 tries")


def test_a_stray_give_back_never_lifts_a_job_past_its_threads(inputs):
    want = prepared(1, inputs).tobytes()
    assert prepared(8, inputs).tobytes() == want  # the pool has workers to spare
    native.NativeCoder.hold_core(-1)  # a give-back with no hold: the count goes below zero
    try:
        assert prepared(2, inputs).tobytes() == want
        assert stats()["last_want"] == 1  # the caller and one worker: 2 threads, as asked
    finally:
        native.NativeCoder.hold_core(1)
