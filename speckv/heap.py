"""The C heap of this process (glibc malloc): giving freed pages back to the kernel.

Kept apart from the sidecar's memory policy (server/memory.py) so that the predictor,
which imports nothing from the server, can call it between the stages of one pass.
Elsewhere than glibc every verb here does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


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
