"""speckv's own SiLU, for the ``w8a8x`` rungs (``coder/kernels/spk_silu.h`` runs it natively)::

    e    = exp2_det(-|x| * log2(e))             in [2^-126, 1]: exp(-|x|) in int8_attention's steps
    silu = (x if x >= 0 else x * e) / (1 + e)   x sigmoid(x), stable in both signs

Every step is one IEEE float32 operation per element, so torch's elementwise ops here, the
extension's scalar loop and its AVX2 and AVX-512 lanes write the same bits, and so would any
device's; torch's own ``F.silu`` calls its vectorised exp (Sleef), whose bits differ by build and
CPU path. The whole later-layer pass of a ``w8a8x`` rung is then speckv's own arithmetic:
exact integer sums and single float operations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import w8a8 as stages
from .int8_attention import LOG2E, exp2_det
from .integer import native_with

if TYPE_CHECKING:  # pragma: no cover
    import torch

SILU_LOG2E = float(np.float32(LOG2E))  # log2(e) rounded to float32 once (spk_silu.h)


def silu_det(x: "torch.Tensor") -> "torch.Tensor":
    """speckv's SiLU of float32 x (the module docstring's steps)."""
    import torch

    f = lambda v: torch.tensor(v, dtype=torch.float32, device=x.device)  # noqa: E731
    e = exp2_det(x.abs() * f(-SILU_LOG2E))
    return torch.where(x < 0, x * e, x) / (e + f(1.0))


def silu_mul(y: "torch.Tensor", native: bool = True) -> "torch.Tensor":
    """float32 (T, 2n): gate columns, then up -> silu_det(gate) * up, float32 (T, n)."""
    import torch

    n = y.shape[1] // 2
    nat = native_with("w8a8_silu_mul") if native and stages.NATIVE else None
    if nat is None or y.device.type != "cpu":
        g, u = y.float().split(n, dim=1)
        return silu_det(g) * u
    m = torch.empty((y.shape[0], n), dtype=torch.float32)
    nat.w8a8_silu_mul(y.float().contiguous().numpy(), m.numpy(), n, stages.NATIVE_THREADS, stages.NATIVE_SCALAR,
                      stages.NATIVE_NO_AVX512)
    return m
