"""Read-only tensors over a safetensors file's pages: resident only where read.

A sidecar's rung keeps the target's embeddings (49152 x 576 BF16, 57 MB for the
embedded model) but a prompt reads one row per token. Copied into the process they
are 57 MB of anonymous memory; mapped from the file, only the rows prompts touch are
resident (file pages, which the kernel may reclaim and which two sidecars on one node
share through the page cache). Hashing a mapped tensor (``store.state_digest``, the
pin check) reads it in windows and drops each window's pages again (MADV_DONTNEED on
a read-only file mapping only unmaps them), so checking the digest leaves nothing
resident.

NOTE: a mapping reads the file as it is at each lookup. The pin check hashed it at
load; a file rewritten in place afterwards would change this sidecar's mu (its peer's
per-chunk mu check then sends those chunks stored: still lossless), and a truncated
one raises SIGBUS. The embedded model's cache is written by an atomic rename; keep
a target directory unchanged while sidecars use it.

Lifecycle: ``map_tensor(file, name)`` -> a BF16 tensor over the file (None when the
tensor is not stored as BF16); ``take_rows(t, ids)`` looks rows up and drops the pages
again; ``hash_into(h, t)`` feeds a mapped tensor's bytes to a hash window by window and
says whether ``t`` was mapped.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

WINDOW = 4 << 20  # bytes hashed between page drops
_MAPPED: dict[int, tuple[mmap.mmap, int, int]] = {}  # data_ptr -> (mapping, byte offset, byte length)


def _header(f: Any) -> tuple[dict, int]:
    """A safetensors file's header and the offset where its data starts."""
    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n)), 8 + n


def map_tensor(file: Path, name: str) -> "torch.Tensor | None":
    """``name`` of a safetensors ``file`` as a read-only BF16 tensor over the file's pages; None when
    it is not stored as BF16 (the caller reads a copy)."""
    import torch

    with open(file, "rb") as f:
        header, data = _header(f)
        entry = header.get(name)
        if entry is None or entry.get("dtype") != "BF16":
            return None
        begin, end = (data + int(x) for x in entry["data_offsets"])
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    shape = tuple(int(x) for x in entry["shape"])
    if end - begin != 2 * int(np.prod(shape)) or begin % 2:
        mm.close()
        return None
    arr = np.frombuffer(mm, dtype=np.int16, count=(end - begin) // 2, offset=begin).reshape(shape)
    with warnings.catch_warnings():  # NOTE: read-only by design: nothing writes the target's weights
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr).view(torch.bfloat16)
    ptr = t.data_ptr()
    _MAPPED[ptr] = (mm, begin, end - begin)
    # NOTE: keyed on the array, which every tensor over this storage keeps alive (a Parameter too)
    weakref.finalize(arr, _MAPPED.pop, ptr, None)
    return t


def is_mapped(t: "torch.Tensor") -> bool:
    return t.data_ptr() in _MAPPED


def take_rows(t: "torch.Tensor", ids: "torch.Tensor") -> "torch.Tensor":
    """``t[ids]`` (a copy); a mapped ``t`` drops its pages after, so a sidecar's resident share of
    its embeddings stays at one lookup's rows however many prompts it serves. NOTE: the kernel maps
    up to 16 neighbouring pages per fault (fault-around), so one lookup touches more than its rows."""
    rows = t[ids]
    entry = _MAPPED.get(t.data_ptr())
    if entry is not None:
        drop_pages(entry[0], entry[1], entry[1] + entry[2])
    return rows


def hash_into(h: Any, t: "torch.Tensor") -> bool:
    """``h.update`` with the bytes of ``t`` if it is a whole mapped tensor (window by window, each
    window's pages dropped after); False (nothing hashed) for any other tensor."""
    entry = _MAPPED.get(t.data_ptr())
    if entry is None or t.numel() * t.element_size() != entry[2]:
        return False
    mm, begin, length = entry
    view = memoryview(mm)
    try:
        a = begin
        while a < begin + length:
            b = min((a + WINDOW) // mmap.PAGESIZE * mmap.PAGESIZE, begin + length)  # page-aligned windows
            h.update(view[a:b])
            drop_pages(mm, a, b)
            a = b
    finally:
        view.release()
    return True


def drop_pages(mm: mmap.mmap, a: int, b: int) -> None:
    """Unmap the pages holding bytes [a, b) of a read-only file mapping: they fault back in from the
    page cache if read again (a page shared with a neighbouring tensor included, harmlessly)."""
    lo = a // mmap.PAGESIZE * mmap.PAGESIZE
    hi = min(-(-b // mmap.PAGESIZE) * mmap.PAGESIZE, len(mm))
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
