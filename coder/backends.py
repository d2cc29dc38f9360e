"""Which coder runs the per-scalar pipeline: ``--coder numpy|native|cuda|auto``.

- ``numpy``: the reference (coder/model.py, coder/rans.py) and every test's oracle.
- ``native``: the CPU extension built at install (``coder/native.py``).
- ``cuda``: the fused CuPy kernels on a CUDA device (``coder/cuda.py``).
- ``auto``: native where built, else numpy; cuda too once ``CUDA_IN_AUTO`` is set.

All write the same bytes. A backend that is asked for but missing falls back with
one log line (``native`` -> numpy, ``cuda`` -> native); with
``SPECKV_REQUIRE_NATIVE=1`` (set by CI) a missing extension is an error instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from . import native

logger = logging.getLogger(__name__)

CODERS = ("auto", "native", "numpy", "cuda")
# NOTE: the CUDA kernels pass benchmarks/gpu_check.py on an H200 (byte identity with the CPU
# coders, 2026-12-04) but code only 4-5.5 GB/s there, 1 GB/s at streaming granularity
# (benchmarks/RESULTS.md "The first GPU run"); until they beat the CPU path where KV lives on
# the host, ``auto`` does not pick them and ``--coder cuda`` is an explicit opt-in
CUDA_IN_AUTO = False
_warned: set[str] = set()


def cuda_available() -> bool:
    """A CUDA device and CuPy (``speckv[cuda]``) are both present."""
    try:
        import cupy as cp

        return bool(cp.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # noqa: BLE001 -- ImportError, or CUDA driver errors when there is no device
        return False


def native_missing_message() -> str:
    return (f"speckv: the native coder was not built with this installation ({native.IMPORT_ERROR}); "
            "using the numpy coder (reinstall with a C++17 compiler present: pip install .)")


def _native_or_numpy(threads: int) -> Any:
    if native.available():
        return native.NativeCoder(threads)
    if os.environ.get("SPECKV_REQUIRE_NATIVE") == "1":
        raise native.NativeUnavailable(native_missing_message() + " [SPECKV_REQUIRE_NATIVE=1]")
    _warn_once("native", native_missing_message())
    return None


def select_backend(coder: str, threads: int) -> Any:
    """The backend object for ``coder`` (None = numpy): NativeCoder, or the process's CudaCoder behind
    its queue (QueuedCuda)."""
    if coder not in CODERS:
        raise ValueError(f"coder must be one of {CODERS}, not {coder!r}")
    if coder == "numpy":
        return None
    if (coder == "cuda" or (coder == "auto" and CUDA_IN_AUTO)) and cuda_available():
        from .cuda_queue import QueuedCuda

        return QueuedCuda.load()  # NOTE: concurrent transfers' calls share a launch a pass
    if coder == "cuda":
        _warn_once("cuda", "speckv: --coder cuda: no CUDA device or CuPy (pip install 'speckv[cuda]'); "
                   "using the CPU coder")
    return _native_or_numpy(threads)


def backend_name(backend: Any) -> str:
    """What ``speckv bench --json`` reports as ``coder``."""
    return "numpy" if backend is None else str(backend.name)


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg)
