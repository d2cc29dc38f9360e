"""speckv/heap.py: predictor passes are counted while they run (nested, across threads, not on
another device), and a decode's trim (``trimmed_beside_pass``) reaches glibc only when a pass ran
beside it. NOTE: counts are compared with the count when a test began (a sidecar of another test
in this process may still be ending a pass)."""
from __future__ import annotations

import threading

import pytest

from speckv import heap


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(heap, "release_free", lambda: calls.append(heap.passes_running()))
    monkeypatch.setattr(heap, "_passes", 0)  # this test's own passes only
    return calls


def test_passes_are_counted_while_they_run_and_after_errors(trims: list[int]):
    with heap.predictor_pass():
        assert heap.passes_running() == 1
        with heap.predictor_pass():
            assert heap.passes_running() == 2
        assert heap.passes_running() == 1
    with pytest.raises(ValueError), heap.predictor_pass():
        raise ValueError("a pass that fails still ends")
    assert heap.passes_running() == 0


def test_a_pass_on_another_device_is_not_counted(trims: list[int]):
    with heap.predictor_pass("cuda:0"):
        assert heap.passes_running() == 0
    with heap.trimmed_beside_pass(), heap.predictor_pass("cuda:0"):
        pass
    assert trims == []


def test_a_pass_on_another_thread_counts(trims: list[int]):
    inside, leave = threading.Event(), threading.Event()

    def run() -> None:
        with heap.predictor_pass():
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=run)
    t.start()
    try:
        assert inside.wait(30)
        assert heap.passes_running() == 1
    finally:
        leave.set()
        t.join(30)
    assert heap.passes_running() == 0


def test_trim_only_beside_a_pass(trims: list[int]):
    with heap.trimmed_beside_pass():
        pass
    assert trims == []  # no pass: the freed blocks stay for the next buffers
    with heap.predictor_pass(), heap.trimmed_beside_pass():
        pass
    assert trims == [1]


def test_a_pass_beside_either_end_of_the_decode_trims(trims: list[int]):
    ended = heap.predictor_pass()
    ended.__enter__()
    with heap.trimmed_beside_pass():
        ended.__exit__(None, None, None)  # the pass ended (and trimmed) before the decode freed its scratch
    assert trims == [0]
    began = heap.predictor_pass()
    with heap.trimmed_beside_pass():
        began.__enter__()  # a pass that began during the decode and runs on at its end
    began.__exit__(None, None, None)
    assert trims == [0, 1]
    with heap.trimmed_beside_pass(), heap.predictor_pass():
        pass  # a pass wholly inside the decode trims when it ends (its own release_free): not counted here
    assert trims == [0, 1]


def test_release_free_runs_on_this_libc():
    heap.release_free()  # glibc's malloc_trim, or nothing elsewhere: never raises
