"""A sidecar's resident memory: how it loads without a lasting peak, and what it reports.

Loading a predictor allocates and frees hundreds of tensors of 1-60 MB (the target's
tensors read one at a time, the derived weights, the model's copies). glibc serves
a freed block's size from its heap afterwards (its mmap threshold rises to the
largest block freed, up to 32 MiB), so the loader's garbage stays resident between
kept tensors: measured here, the sidecar idled ~180 MB above the tensors it holds.

``loading_arena()`` maps every block of 128 KiB or more on its own while the
predictor loads (a freed one goes straight back to the kernel), then fixes the
threshold at glibc's own ceiling (32 MiB) for serving, where reusing heap blocks
is what keeps a forward pass from page-faulting its activations afresh (a 128 KiB
threshold made a 2,048-token pass 1.3x slower here), and trims the heap once.
It also caps glibc at one arena (``SERVING_ARENAS``) for the process's life: each
thread that allocates (the predictor's, the coder's workers, gRPC's) otherwise gets an
arena of its own, up to 8 per core, and each keeps the blocks freed in it resident
for its own next use: the predictor's activations, then a decode's, then a gRPC
message's, side by side. Measured here (four uncached 2048-token transfers through
two sidecar processes, load.py's loop with ``SPECKV_MU_CACHE_BYTES=0``): decoder peak
530-531 MiB with glibc's default, 501-506 with one arena, the encoder 624-644 against
562-580, the same transfer times (benchmarks/RESULTS.md, "A serving sidecar's memory"). A
``MALLOC_ARENA_MAX`` or ``GLIBC_TUNABLES`` arena setting in the environment wins.
Elsewhere than glibc it does nothing.

``peak_rss_bytes()`` is the kernel's high-water mark of this process (VmHWM):
every byte ever resident at once, not a sample. ``runtime_floor_bytes()`` is that
of a fresh process that only imports what a sidecar runs on (torch, grpc, the
sidecar's modules; not transformers, which the shipped rung never imports): the part of a sidecar's peak that no
model or request of its own adds, which benchmarks report beside the peak.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from speckv.heap import glibc

M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
LOADING_MMAP = 128 << 10  # glibc's initial threshold: each block this size or larger is its own mapping
SERVING_MMAP = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where the dynamic one ends up
SERVING_TRIM = 2 * SERVING_MMAP  # what glibc's dynamic rule pairs with it
SERVING_ARENAS = 1  # malloc arenas every thread shares (module docstring)


@contextlib.contextmanager
def loading_arena() -> Iterator[None]:
    """Allocate what runs inside so that the loader's freed blocks leave no resident garbage."""
    libc = glibc()
    if libc is None:
        yield
        return
    if not arenas_from_environment():
        libc.mallopt(M_ARENA_MAX, SERVING_ARENAS)  # NOTE: a thread keeps the arena it has; later ones share
    libc.mallopt(M_MMAP_THRESHOLD, LOADING_MMAP)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, SERVING_MMAP)
        libc.mallopt(M_TRIM_THRESHOLD, SERVING_TRIM)
        libc.malloc_trim(0)


def arenas_from_environment() -> bool:
    """Whether the environment sets glibc's arena count (then it is left as set)."""
    return "MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", "")


def _status_kib(field: str, pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_bytes(pid: int | str = "self") -> int:
    """The process's peak resident set (VmHWM), in bytes; 0 where /proc has none."""
    return _status_kib("VmHWM", pid) * 1024


def rss_bytes(pid: int | str = "self") -> int:
    """The process's resident set now (VmRSS), in bytes; 0 where /proc has none."""
    return _status_kib("VmRSS", pid) * 1024


# NOTE: no transformers: a sidecar on a w8a8 rung (the shipped one) never imports it (predictor/llama.py)
FLOOR_IMPORTS = "import torch, grpc, speckv.server.app, speckv.predictor.predict"


def runtime_floor_bytes() -> int:
    """Peak RSS of a fresh interpreter that imports what a sidecar runs on, and nothing more."""
    code = f"{FLOOR_IMPORTS}; from speckv.server.memory import peak_rss_bytes; print(peak_rss_bytes())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.split()[-1])
