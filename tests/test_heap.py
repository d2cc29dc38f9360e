"""speckv/heap.py: predictor passes are counted while they run (nested, across threads), and the
decoder's trim (``release_free_beside_pass``) reaches glibc only while one runs."""
from __future__ import annotations

import threading

import pytest

from speckv import heap


@pytest.fixture
def trims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(heap, "release_free", lambda: calls.append(heap.passes_running()))
    return calls


def test_passes_are_counted_while_they_run_and_after_errors():
    assert heap.passes_running() == 0
    with heap.predictor_pass():
        assert heap.passes_running() == 1
        with heap.predictor_pass():
            assert heap.passes_running() == 2
        assert heap.passes_running() == 1
    with pytest.raises(ValueError), heap.predictor_pass():
        raise ValueError("a pass that fails still ends")
    assert heap.passes_running() == 0


def test_a_pass_on_another_thread_counts():
    inside, leave = threading.Event(), threading.Event()

    def run() -> None:
        with heap.predictor_pass():
            inside.set()
            assert leave.wait(30)

    t = threading.Thread(target=run)
    t.start()
    assert inside.wait(30)
    assert heap.passes_running() == 1
    leave.set()
    t.join(30)
    assert heap.passes_running() == 0


def test_trim_beside_a_pass_only(trims: list[int]):
    heap.release_free_beside_pass()
    assert trims == []  # no pass: the freed blocks stay for the next buffers
    with heap.predictor_pass():
        heap.release_free_beside_pass()
    assert trims == [1]


def test_release_free_runs_on_this_libc():
    heap.release_free()  # glibc's malloc_trim, or nothing elsewhere: never raises
