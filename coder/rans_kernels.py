"""The rANS kernels outside numpy: their CUDA build (CuPy RawModule) and their host
build (the same per-lane source compiled with g++, warp emulated; it lets CPU-only
machines and CI check the kernel logic byte for byte against ``coder/rans.py``).

Lifecycle::

    k = HostKernels.load()            # g++ once per source digest, cached .so
    blocks = k.encode(start, freq)    # (blocks, steps, LANES) ops -> RansBlocks
    js = k.decode(blocks, steps, table_ids, gauss)   # symbol index per op

``CudaKernels.load()`` has the same two methods on a CUDA device (arrays are
copied in and out; the container layout is identical). Sources live in
``coder/kernels/`` (``rans_lane.cuh`` shared, ``rans.cu``, ``rans_host.cpp``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from speckv.paths import cache_dir

from .rans import LANES, PROB_SCALE, RansBlocks, RansDecodeError, _check_blocks

logger = logging.getLogger(__name__)

SOURCES = ("rans_lane.cuh", "rans.cu", "rans_host.cpp")
STATUS = {1: "read past the start of its words", 2: "words left unread",
          3: "final state is not RANS_L (corrupt)", 4: "table id out of range"}
_P = ctypes.c_void_p


def source_dir() -> Path:
    return Path(str(resources.files("speckv.coder") / "kernels"))


def source_digest() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((source_dir() / name).read_bytes())
    return h.hexdigest()[:16]


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def table_arrays(gauss: Any) -> dict[str, np.ndarray]:
    """The Gaussian tables as the kernels take them: u16 cum/freq, i32 offset/size."""
    n = len(gauss.cum)
    size = np.diff(np.append(gauss.offset.astype(np.int64), n)).astype(np.int32)
    if int(gauss.freq.max()) > 0xFFFF or int(gauss.cum.max()) >= PROB_SCALE:
        raise ValueError("tables do not fit u16")
    return {"cum": np.ascontiguousarray(gauss.cum, np.uint16), "freq": np.ascontiguousarray(gauss.freq, np.uint16),
            "offset": np.ascontiguousarray(gauss.offset, np.int32), "size": size}


def _ops(start: np.ndarray, freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if start.ndim != 3 or start.shape != freq.shape or start.shape[2] != LANES:
        raise ValueError(f"start/freq must both have shape (blocks, steps, {LANES})")
    return np.ascontiguousarray(start, np.uint32), np.ascontiguousarray(freq, np.uint32)


def _raise_status(status: np.ndarray) -> None:
    bad = np.flatnonzero(status)
    if len(bad):
        b = int(bad[0])
        raise RansDecodeError(f"block {b}: {STATUS.get(int(status[b]), 'error')}")


class HostKernels:
    """The kernels' host build (g++, ctypes)."""

    _lock = threading.Lock()
    _cache: "HostKernels | None" = None

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.spk_host_encode.argtypes = [_P, _P, ctypes.c_int, ctypes.c_int, _P, _P, _P, _P, _P]
        lib.spk_host_decode.argtypes = [_P] * 9 + [ctypes.c_int] * 3 + [_P, _P]
        lib.spk_host_encode.restype = lib.spk_host_decode.restype = None

    @classmethod
    def load(cls, build_dir: str | Path | None = None) -> "HostKernels":
        with cls._lock:
            if cls._cache is None:
                cls._cache = cls(ctypes.CDLL(str(build_host_library(build_dir))))
            return cls._cache

    def encode(self, start: np.ndarray, freq: np.ndarray) -> RansBlocks:
        start, freq = _ops(start, freq)
        nb, steps, _ = start.shape
        states = np.empty((nb, LANES), np.uint32)
        counts = np.empty(nb, np.uint32)
        scratch = np.empty(max(start.size, 1), np.uint16)
        words = np.empty(max(start.size, 1), np.uint16)
        offsets = np.empty(max(nb, 1), np.uint64)
        self.lib.spk_host_encode(_ptr(start), _ptr(freq), nb, steps, _ptr(states), _ptr(counts),
                                 _ptr(scratch), _ptr(words), _ptr(offsets))
        total = int(counts.sum(dtype=np.int64))
        return RansBlocks(states=states, word_counts=counts, words=words[:total].copy())

    # the CudaKernels device-array interface, on host arrays (lets scripts run either)
    def encode_device(self, start: np.ndarray, freq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b = self.encode(start, freq)
        return b.states, b.word_counts, b.words

    def decode_device(self, states: np.ndarray, counts: np.ndarray, words: np.ndarray, tables: np.ndarray,
                      steps: int, gauss: Any) -> np.ndarray:
        return self.decode(RansBlocks(states, counts, words), steps, tables, gauss).astype(np.uint16)

    def _device_tables(self, gauss: Any) -> dict[str, np.ndarray]:
        return table_arrays(gauss)

    def decode(self, blocks: RansBlocks, steps: int, tables: np.ndarray, gauss: Any) -> np.ndarray:
        """Symbol index (within its table) of every op, (blocks, steps, LANES) int32."""
        states, counts, words = _check_blocks(blocks)
        nb = states.shape[0]
        tables = np.ascontiguousarray(tables, np.int32)
        if tables.shape != (nb, steps, LANES):
            raise ValueError(f"tables must have shape {(nb, steps, LANES)}")
        t = table_arrays(gauss)
        offsets = (np.cumsum(counts, dtype=np.uint64) - counts).astype(np.uint64)
        out = np.empty(tables.shape, np.uint16)
        status = np.empty(max(nb, 1), np.int32)
        words = words if words.size else np.zeros(1, np.uint16)
        self.lib.spk_host_decode(_ptr(states), _ptr(counts), _ptr(offsets), _ptr(words), _ptr(tables),
                                 _ptr(t["cum"]), _ptr(t["freq"]), _ptr(t["offset"]), _ptr(t["size"]),
                                 len(t["offset"]), nb, steps, _ptr(out), _ptr(status))
        _raise_status(status[:nb])
        return out.astype(np.int32)


def build_host_library(build_dir: str | Path | None = None) -> Path:
    """Compile rans_host.cpp (g++ -O2) once per source digest; returns the .so path."""
    out_dir = Path(build_dir) if build_dir else cache_dir() / "kernels"
    out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / f"spk_rans_host_{source_digest()}.so"
    if so.exists():
        return so
    cxx = os.environ.get("CXX", "g++")
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_so = Path(tmp) / so.name
        cmd = [cxx, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
               "-I", str(source_dir()), "-o", str(tmp_so), str(source_dir() / "rans_host.cpp")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"building the host kernels failed: {' '.join(cmd)}\n{proc.stderr}")
        os.replace(tmp_so, so)  # atomic: concurrent builders never see a partial file
    logger.info("built host rANS kernels %s", so)
    return so


class CudaKernels:
    """The kernels on a CUDA device (CuPy RawModule, sm_XX of the device)."""

    WARPS_PER_CTA = 4  # rANS blocks (warps) per CUDA block
    _lock = threading.Lock()
    _cache: "CudaKernels | None" = None

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        src = (source_dir() / "rans.cu").read_text()
        self.module = cp.RawModule(code=src, options=("-std=c++17", f"-I{source_dir()}"),
                                   name_expressions=None)
        self.k_encode = self.module.get_function("spk_rans_encode")
        self.k_gather = self.module.get_function("spk_rans_gather")
        self.k_decode = self.module.get_function("spk_rans_decode")
        self._tables: dict[int, dict[str, Any]] = {}

    @classmethod
    def load(cls) -> "CudaKernels":
        with cls._lock:
            if cls._cache is None:
                import cupy as cp

                cls._cache = cls(cp)
            return cls._cache

    def _grid(self, nb: int) -> tuple[tuple[int], tuple[int]]:
        w = self.WARPS_PER_CTA
        return (max(1, -(-nb // w)),), (32 * w,)

    def encode_device(self, start: Any, freq: Any) -> tuple[Any, Any, Any]:
        """Device ops (blocks, steps, LANES) u32 -> device (states, counts, words)."""
        cp = self.cp
        nb, steps, _ = start.shape
        states = cp.empty((nb, LANES), cp.uint32)
        counts = cp.empty(nb, cp.uint32)
        scratch = cp.empty(max(start.size, 1), cp.uint16)
        grid, block = self._grid(nb)
        self.k_encode(grid, block, (start, freq, np.int32(nb), np.int32(steps), states, counts, scratch))
        offsets = cp.cumsum(counts, dtype=cp.uint64) - counts.astype(cp.uint64)
        total = int(counts.sum(dtype=cp.uint64)) if nb else 0
        words = cp.empty(max(total, 1), cp.uint16)
        self.k_gather(grid, block, (scratch, counts, offsets, np.int32(nb), np.int32(steps), words))
        return states, counts, words[:total]

    def encode(self, start: np.ndarray, freq: np.ndarray) -> RansBlocks:
        start, freq = _ops(start, freq)
        states, counts, words = self.encode_device(self.cp.asarray(start), self.cp.asarray(freq))
        return RansBlocks(states=states.get(), word_counts=counts.get(), words=words.get())

    def _device_tables(self, gauss: Any) -> dict[str, Any]:
        key = id(gauss)
        if key not in self._tables:
            t = table_arrays(gauss)  # the very integer arrays the numpy path uses
            self._tables[key] = {k: self.cp.asarray(v) for k, v in t.items()}
        return self._tables[key]

    def decode_device(self, states: Any, counts: Any, words: Any, tables: Any, steps: int, gauss: Any) -> Any:
        cp = self.cp
        nb = states.shape[0]
        t = self._device_tables(gauss)
        n_entries = int(t["cum"].size)
        offsets = cp.cumsum(counts, dtype=cp.uint64) - counts.astype(cp.uint64)
        out = cp.empty(tables.shape, cp.uint16)
        status = cp.zeros(max(nb, 1), cp.int32)
        smem = 4 * n_entries  # cum + freq, u16 each
        self.k_decode.max_dynamic_shared_size_bytes = smem
        grid, block = self._grid(nb)
        words = words if words.size else cp.zeros(1, cp.uint16)
        self.k_decode(grid, block, (states, counts, offsets, words, tables, t["cum"], t["freq"], t["offset"],
                                    t["size"], np.int32(t["offset"].size), np.int32(n_entries), np.int32(nb),
                                    np.int32(steps), out, status), shared_mem=smem)
        _raise_status(status[:nb].get())
        return out

    def decode(self, blocks: RansBlocks, steps: int, tables: np.ndarray, gauss: Any) -> np.ndarray:
        states, counts, words = _check_blocks(blocks)
        tables = np.ascontiguousarray(tables, np.int32)
        if tables.shape != (states.shape[0], steps, LANES):
            raise ValueError(f"tables must have shape {(states.shape[0], steps, LANES)}")
        cp = self.cp
        out = self.decode_device(cp.asarray(states), cp.asarray(counts), cp.asarray(words), cp.asarray(tables),
                                 steps, gauss)
        return out.get().astype(np.int32)


def cuda_available() -> bool:
    """A CUDA device and CuPy (``speckv[cuda]``) are both present."""
    try:
        import cupy as cp

        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 -- ImportError, or CUDA driver errors when there is no device
        return False


CODERS = ("cpu", "cuda", "auto", "host")


def select_kernels(coder: str) -> "HostKernels | CudaKernels | None":
    """The rANS backend for ``--coder``: None = numpy (cpu). ``auto`` takes CUDA when a
    device and CuPy are present; ``cuda`` without them warns and falls back to numpy;
    ``host`` is the kernels' g++ build (tests, and a check on machines with a compiler)."""
    if coder not in CODERS:
        raise ValueError(f"coder must be one of {CODERS}, not {coder!r}")
    if coder == "cpu":
        return None
    if coder == "host":
        return HostKernels.load()
    if cuda_available():
        return CudaKernels.load()
    if coder == "cuda":
        logger.warning("--coder cuda: no CUDA device or CuPy (pip install 'speckv[cuda]'); using the numpy coder")
    return None
