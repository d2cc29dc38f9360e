"""``Ahead``: an encode's chunk digests computed on the digest thread while the
backend codes (threads > 1), on the caller's own thread with one; in the jobs' order; and a
forked child, which inherits the executor but not its thread, still gets its digests."""
from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from speckv.coder.integrity import Ahead


def _jobs(n: int, where: list[int]) -> list:
    def job(i: int) -> tuple[bytes, bytes]:
        where.append(threading.get_ident())
        return bytes([i]), bytes([i, i])
    return [lambda i=i: job(i) for i in range(n)]


def test_one_thread_runs_the_jobs_on_the_caller_when_asked():
    where: list[int] = []
    sums = Ahead(1, _jobs(3, where)).result
    assert where == []  # nothing ran yet: one thread codes first, then digests
    assert sums() == [(b"\0", b"\0\0"), (b"\1", b"\1\1"), (b"\2", b"\2\2")]
    assert where == [threading.get_ident()] * 3


def test_two_threads_run_the_jobs_on_the_digest_thread_in_order():
    where: list[int] = []
    assert Ahead(2, _jobs(5, where)).result() == [(bytes([i]), bytes([i, i])) for i in range(5)]
    assert len(set(where)) == 1 and where[0] != threading.get_ident()
    again: list[int] = []
    Ahead(2, _jobs(1, again)).result()
    assert again == where[:1]  # one thread, started once


def _child(q) -> None:
    q.put(Ahead(2, _jobs(2, [])).result())


def test_a_forked_child_starts_its_own_digest_thread():
    Ahead(2, _jobs(1, [])).result()  # the parent's thread exists before the fork
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    try:
        assert q.get(timeout=30) == [(b"\0", b"\0\0"), (b"\1", b"\1\1")]
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_a_failing_job_raises_from_result(threads):
    def bad() -> tuple[bytes, bytes]:
        raise ValueError("no digest")
    sums = Ahead(threads, [bad])
    with pytest.raises(ValueError, match="no digest"):
        sums.result()


def test_cancel_drops_digests_not_yet_started():
    """A failed encode cancels its digests: queued behind another encode's, they never run."""
    gate, ran = threading.Event(), []
    first = Ahead(2, [lambda: (gate.wait(30), (b"", b""))[1]])  # holds the digest thread
    second = Ahead(2, [lambda: ran.append(1) or (b"", b"")])
    second.cancel()
    gate.set()
    first.result()
    Ahead(2, [lambda: (b"", b"")]).result()  # the thread went past the cancelled job
    assert ran == []


def test_a_failed_block_cancels_its_digests():
    """``with Ahead(...)``: an exception in the block cancels digests not yet started."""
    gate, ran = threading.Event(), []
    first = Ahead(2, [lambda: (gate.wait(30), (b"", b""))[1]])
    with pytest.raises(RuntimeError), Ahead(2, [lambda: ran.append(1) or (b"", b"")]):
        raise RuntimeError("the backend failed")
    gate.set()
    first.result()
    Ahead(2, [lambda: (b"", b"")]).result()
    assert ran == []
