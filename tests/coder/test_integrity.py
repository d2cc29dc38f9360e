"""``digests_ahead``: an encode's chunk digests computed on the digest thread while the
backend codes (threads > 1), on the caller's own thread with one; in the jobs' order; and a
forked child, which inherits the executor but not its thread, still gets its digests."""
from __future__ import annotations

import multiprocessing as mp
import threading

from speckv.coder.integrity import digests_ahead


def _jobs(n: int, where: list[int]) -> list:
    def job(i: int) -> tuple[bytes, bytes]:
        where.append(threading.get_ident())
        return bytes([i]), bytes([i, i])
    return [lambda i=i: job(i) for i in range(n)]


def test_one_thread_runs_the_jobs_on_the_caller_when_asked():
    where: list[int] = []
    sums = digests_ahead(1, _jobs(3, where))
    assert where == []  # nothing ran yet: one thread codes first, then digests
    assert sums() == [(b"\0", b"\0\0"), (b"\1", b"\1\1"), (b"\2", b"\2\2")]
    assert where == [threading.get_ident()] * 3


def test_two_threads_run_the_jobs_on_the_digest_thread_in_order():
    where: list[int] = []
    assert digests_ahead(2, _jobs(5, where))() == [(bytes([i]), bytes([i, i])) for i in range(5)]
    assert len(set(where)) == 1 and where[0] != threading.get_ident()
    again: list[int] = []
    digests_ahead(2, _jobs(1, again))()
    assert again == where[:1]  # one thread, started once


def _child(q) -> None:
    q.put(digests_ahead(2, _jobs(2, []))())


def test_a_forked_child_starts_its_own_digest_thread():
    digests_ahead(2, _jobs(1, []))()  # the parent's thread exists before the fork
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
