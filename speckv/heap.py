"""The C heap of this process (glibc malloc): giving freed pages back to the kernel.

Kept apart from the sidecar's memory policy (server/memory.py) so that the predictor,
which imports nothing from the server, can call it between the stages of one pass.
Elsewhere than glibc every verb here does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Iterator


@functools.cache
def glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_free() -> None:
    """Hand the heap's free pages back to the kernel (glibc ``malloc_trim``, every arena). A predictor
    pass frees ~80 MiB of activations at 2048 tokens that otherwise stay resident in its thread's
    arena, below blocks a decode then maps afresh (its output is one block above the mmap threshold):
    the batcher calls this when its queue runs dry, a lone pass when it ends. The next pass faults
    its activations in again (~20k pages, a few ms against seconds of compute)."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


_passes = 0  # predictor passes running in this process (predictor_pass)
_passes_lock = threading.Lock()


@contextlib.contextmanager
def predictor_pass(device: str = "cpu") -> Iterator[None]:
    """Marks a predictor pass running in this process while the body runs (its thread enters this
    around the pass). A pass on another device (``device`` not "cpu": its activations are the
    device's) leaves this heap alone and is not counted."""
    global _passes
    counted = device == "cpu"
    if counted:
        with _passes_lock:
            _passes += 1
    try:
        yield
    finally:
        if counted:
            with _passes_lock:
                _passes -= 1


def passes_running() -> int:
    """How many predictor passes run in this process now."""
    return _passes  # NOTE: one read of an int: stale by the time it is used either way


@contextlib.contextmanager
def trimmed_beside_pass() -> Iterator[None]:
    """Runs the body (a decode), then ``release_free`` if a predictor pass ran when it began or runs
    when it ends. Beside a pass, the body's freed scratch would otherwise stay resident under the
    pass's activations (their working sets stack at the sidecar's peak). Without a pass the freed
    blocks are the next buffers' (the next decode's, FetchKV's messages): trimmed, every page of them
    faults in afresh, a fifth of a warm transfer's decoder CPU here (benchmarks/RESULTS.md,
    "Trimming the heap only beside a pass").
    NOTE: a lone pass trims the heap when it ends, the batcher when its queue runs dry."""
    beside = passes_running()
    try:
        yield
    finally:
        if beside or passes_running():
            release_free()
