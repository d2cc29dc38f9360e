"""The fused CUDA coder's kernels on the CPU, for tests: ``CudaCoder(emulated_cupy(dir))`` runs
coder/cuda.py as it is, with CuPy replaced by numpy and a RawModule whose kernels are
coder/kernels/spk_fused.cu compiled by g++ against a warp emulator (tests/emu/cuda_emu.h).

So the kernels' own logic (warp scans, ballots, bit placement, the decoder's early exits) runs,
and is checked against the native coder byte for byte, where no GPU is. NOTE: an emulator, not a
GPU: it says nothing about speed, and it runs one thread at a time (in reverse order, so a missing
barrier reads stale data, but no two threads ever race).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
from require import missing

from speckv.coder.cuda import source_dir

EMU_DIR = Path(__file__).parent / "emu"


class _Kernel:
    """One kernel: called as CuPy's RawKernel is, ``k(grid, block, args, shared_mem=)``."""

    def __init__(self, lib: ctypes.CDLL, name: str, device_only: bool) -> None:
        self.lib, self.name, self.device_only = lib, name, device_only
        self.addr = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        self.max_dynamic_shared_size_bytes = 0
        kinds = (ctypes.c_int * 64)()
        self.params = list(kinds[:getattr(lib, f"spk_emu_sig_{name}")(kinds, 64)])

    def _check(self, args: tuple) -> None:
        """Each argument as CuPy packs it for this kernel's parameter: an array for a pointer, a numpy
        scalar of the parameter's width and signedness for an integer (a mismatch would shift every
        later parameter on a device)."""
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        for i, (a, kind) in enumerate(zip(args, self.params, strict=True)):
            if kind == 0:
                ok = isinstance(a, np.ndarray)
            else:
                ok = isinstance(a, np.integer) and a.dtype.itemsize == abs(kind) and (a.dtype.kind == "i") == (kind > 0)
            if not ok:
                sign = "signed" if kind > 0 else "unsigned"
                want = "an array" if kind == 0 else f"a {sign} {8 * abs(kind)}-bit scalar"
                raise TypeError(f"{self.name}: argument {i} is {type(a).__name__}, the kernel takes {want}")

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        if len(grid) != 1 or len(block) != 1:
            raise ValueError("the emulator launches 1-D grids only")
        self._check(args)
        words = []
        for a in args:
            if isinstance(a, np.ndarray):
                if self.device_only and not isinstance(a, DeviceArray):
                    raise TypeError(f"{self.name}: a host array as an argument (CuPy takes device arrays only)")
                if not a.flags.c_contiguous:
                    raise ValueError(f"{self.name}: a non-contiguous array argument")
                words.append(a.ctypes.data)
            elif isinstance(a, (np.integer, int)):
                words.append(int(a) & (1 << 64) - 1)  # NOTE: two's complement; the callee reads its width
            else:
                raise TypeError(f"{self.name}: argument of type {type(a).__name__}")
        argv = (ctypes.c_uint64 * max(len(words), 1))(*words)
        rc = self.lib.spk_emu_launch(ctypes.c_void_p(self.addr), ctypes.c_uint(int(grid[0])),
                                     ctypes.c_uint(int(block[0])), ctypes.c_ulonglong(int(shared_mem)), argv,
                                     ctypes.c_int(len(words)))
        if rc:
            raise ValueError(f"{self.name}: the emulator refused the launch ({rc})")


class _Module:
    def __init__(self, lib: ctypes.CDLL, device_only: bool = False) -> None:
        self.lib, self.device_only = lib, device_only

    def get_function(self, name: str) -> _Kernel:
        return _Kernel(self.lib, name, self.device_only)


def build(code: str, work: Path, options: tuple[str, ...] = ()) -> ctypes.CDLL:
    """spk_fused.cu's text (as coder/cuda.py hands it to CuPy), compiled for the emulator with the
    macros of ``options``' -D flags (the others are NVRTC's)."""
    gxx = shutil.which("g++")
    if gxx is None:
        missing("GXX", "g++ not found (the CUDA emulator compiles the kernels with it)")
    # NOTE: a static __shared__ array is a function-level static here (cuda_emu.h), and `extern` and
    # `static` clash: the source and the kernel headers it includes are compiled from copies without it
    def emulable(text: str) -> str:
        return text.replace("extern __shared__", "extern")

    headers = {p.name: emulable(p.read_text()) for p in sorted(source_dir().glob("*.cuh")) + sorted(
        source_dir().glob("*.h"))}
    text = (f'#include "cuda_emu.h"\nstruct spk_emu_kernels_begin;\n{emulable(code)}\n'
            'struct spk_emu_kernels_end;\n#include "cuda_emu_run.h"\n')
    defines = [o for o in options if o.startswith("-D")]
    digest = hashlib.sha256(text.encode() + " ".join(defines).encode())
    for name, h in headers.items():
        digest.update(name.encode() + h.encode())
    for p in (EMU_DIR / "cuda_emu.h", EMU_DIR / "cuda_emu_run.h"):
        digest.update(p.read_bytes())
    key = digest.hexdigest()[:16]
    so = work / f"fused_emu_{key}.so"
    if not so.exists():
        inc = work / f"include_{key}"
        inc.mkdir(exist_ok=True)
        for name, h in headers.items():
            (inc / name).write_text(h)
        src = work / f"fused_emu_{key}.cpp"
        flags = ["-std=c++17", f"-I{EMU_DIR}", f"-I{inc}", *defines]
        src.write_text(text)
        pre = _run([gxx, *flags, "-E", str(src)])
        src.write_text(text + _signatures(pre))
        _run([gxx, *flags, "-O1", "-g", "-fPIC", "-shared", "-ffp-contract=off", str(src), "-o", str(so)])
    lib = ctypes.CDLL(str(so))
    lib.spk_emu_launch.restype = ctypes.c_int
    return lib


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"the CUDA emulator build failed:\n{proc.stderr[-4000:]}")
    return proc.stdout


KERNEL = re.compile(r'extern\s+"C"\s+void\s+(\w+)\s*\(')


def _signatures(preprocessed: str) -> str:
    """C++ that exports each kernel's parameter kinds (``spk_emu_sig_<name>``: cuda_emu_run.h
    spk_emu_sig), from the kernels' source between its two markers, macros expanded."""
    body = preprocessed.split("struct spk_emu_kernels_begin;", 1)[1].split("struct spk_emu_kernels_end;", 1)[0]
    return "".join(f'extern "C" int spk_emu_sig_{k}(int* out, int cap) {{ return spk_emu_sig({k}, out, cap); }}\n'
                   for k in KERNEL.findall(body))


class DeviceArray(np.ndarray):
    """A "device" array: numpy's, with CuPy's ``get`` (a copy to the host, into ``out`` if given) and
    ``__cuda_array_interface__`` (its address)."""

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ctypes.data, False), "version": 3}

    def get(self, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return np.array(self, copy=True)
        if type(out) is not np.ndarray or out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError("get(out=): a host array of the same shape and dtype")  # as CuPy's
        if not out.flags.c_contiguous:
            raise RuntimeError("get(out=): a contiguous array")  # CuPy's refuses it too
        # NOTE: as CuPy's (a DMA to out's address): a read-only array is written too
        ctypes.memmove(out.ctypes.data, np.ascontiguousarray(self).ctypes.data, out.nbytes)
        return out


class _Event:
    """cupy.cuda.Event: launches run synchronously here, so a record is a clock reading."""

    t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        if not self.t:
            raise RuntimeError("an event synchronised before it was recorded")  # CuPy's returns at once; ours is a bug


class _Stream:
    """cupy.cuda.Stream: one stream here; waiting on an event checks it was recorded."""

    def wait_event(self, event: _Event) -> None:  # NOTE: the device waits, not the host
        if not event.t:
            raise RuntimeError("a stream waited on an event never recorded")


def _asnumpy(a: np.ndarray, stream: Any = None, order: str = "C", out: np.ndarray | None = None,
             blocking: bool = True) -> np.ndarray:
    """cupy.asnumpy: a copy, as a transfer is (into ``out`` if given; every copy here is done on return)."""
    if out is None:
        return np.array(a, copy=True).view(np.ndarray)
    if type(out) is not np.ndarray or out.shape != a.shape or out.dtype != a.dtype:
        raise ValueError("asnumpy(out=): a host array of the same shape and dtype")
    out[...] = a
    return out


class _Device:
    """cupy.cuda.Device: one device, 0."""

    def __init__(self, i: int = 0) -> None:
        self.id = i

    def synchronize(self) -> None:
        pass

    def use(self) -> None:
        pass

    def __enter__(self) -> "_Device":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _device(fn: Any) -> Any:
    return lambda *a, **k: np.asarray(fn(*a, **k)).view(DeviceArray)


def emulated_cupy(work: Path) -> Any:
    """A stand-in for the ``cupy`` module, as much of it as coder/cuda.py uses."""
    cp = types.SimpleNamespace()
    for name in ("asarray", "ascontiguousarray", "empty", "zeros", "cumsum"):
        setattr(cp, name, _device(getattr(np, name)))
    for name in ("uint8", "uint16", "uint32", "uint64", "int32", "int64", "float32"):
        setattr(cp, name, getattr(np, name))
    cp.asnumpy = _asnumpy
    cp.ones, cp.empty_like = _device(np.ones), _device(np.empty_like)
    cp.cuda = types.SimpleNamespace(Device=_Device, Event=_Event,
                                    get_elapsed_time=lambda a, b: 1e3 * (b.t - a.t),  # ms, as CuPy's
                                    get_current_stream=lambda: _Stream())
    cp.RawModule = lambda code, options: _Module(build(code, work, tuple(options)), device_only=True)
    return cp
