"""The int8 x int8 -> int32 products of the integer rungs (w8a8, portable), exact on every path.

Integer sums are associative, so any correct kernel gives the same integers: torch's
``_int_mm`` (oneDNN, VNNI or AMX on CPUs with them; int8 tensor cores on a GPU), the
native product ``spk_igemm.h`` (AVX2 ``vpmaddwd``: on CPUs without VNNI, where torch
2.13's CPU ``_int_mm`` is a ~2 GMAC/s reference loop), or int64 ``torch.mm`` (the
reference). ``int_mm`` picks the route by device and CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch


def native_with(stage: str) -> Any:
    """The native extension where it is built and has ``stage`` (an older build may not); else None."""
    try:
        from speckv.coder import _native as nat
    except ImportError:
        return None
    return nat if hasattr(nat, stage) else None


INT_MM_NATIVE: bool | None = None  # None: the native product on CPUs without VNNI (int8_vnni()); tests set it


def int8_vnni() -> bool:
    """Whether this CPU has VNNI or AMX int8 instructions, which oneDNN's int8 GEMM (torch._int_mm) uses;
    without them torch 2.13's CPU _int_mm is a reference loop, ~2 GMAC/s (benchmarks/RESULTS.md)."""
    flags = _cpu_flags()
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _native_int_mm() -> Any:
    use = INT_MM_NATIVE if INT_MM_NATIVE is not None else not _INT8_VNNI
    return native_with("igemm") if use else None


def int_mm(a: "torch.Tensor", bt: "torch.Tensor", exact: bool = False,
           out: "torch.Tensor | None" = None) -> "torch.Tensor":
    """int8 a (m, k) @ bt (n, k)^T -> int32 (m, n), exact for |a| <= 127, |bt| <= B_MAX;
    ``exact`` uses int64 torch.mm (the reference: no BLAS, no oneDNN). ``out`` (CPU): a reused
    contiguous (m, n) int32 buffer (fresh large buffers page-fault on every call here). On a CPU
    without VNNI the native product (spk_igemm.h) runs it: integer sums, so the same bits."""
    import torch

    if exact:
        return torch.mm(a.long(), bt.long().t()).to(torch.int32)
    nat = _native_int_mm() if a.device.type == "cpu" else None
    if nat is not None:
        a, bt = a.contiguous(), bt.contiguous()
        m, n = a.shape[0], bt.shape[0]
        if out is None:
            out = torch.empty((m, n), dtype=torch.int32)
        if a.dtype != torch.int8 or bt.dtype != torch.int8 or out.dtype != torch.int32 or out.shape != (m, n) \
                or bt.shape[1] != a.shape[1] or not out.is_contiguous():
            raise ValueError(f"int_mm: int8 {tuple(a.shape)} @ int8 {tuple(bt.shape)}^T into {out.dtype} "
                             f"{tuple(out.shape)}")
        # NOTE: integer sums: the thread count (torch's, COMPUTE_THREADS inside a pass) changes no bit
        nat.igemm(a.numpy(), bt.numpy(), out.numpy(), m, n, a.shape[1], torch.get_num_threads(), False)
        return out
    if a.shape[1] < 8:  # NOTE: torch 2.13's CPU _int_mm returns garbage for k == 1; zeros add nothing
        k8 = 8
        a = torch.nn.functional.pad(a, (0, k8 - a.shape[1]))
        bt = torch.nn.functional.pad(bt, (0, k8 - bt.shape[1]))
    if a.is_cuda:  # NOTE: CUDA's int8 GEMM wants m > 16 and k, n multiples of 8: zero padding adds nothing
        m, k, n = a.shape[0], a.shape[1], bt.shape[0]
        pad = lambda t, r, c: torch.nn.functional.pad(t, (0, c - t.shape[1], 0, r - t.shape[0]))  # noqa: E731
        k8 = -(-k // 8) * 8
        out = torch._int_mm(pad(a, max(17, -(-m // 8) * 8), k8), pad(bt, -(-n // 8) * 8, k8).t())
        return out[:m, :n]
    if out is not None:
        return torch._int_mm(a.contiguous(), bt.t(), out=out)
    return torch._int_mm(a.contiguous(), bt.t())


_INT8_VNNI = int8_vnni()
