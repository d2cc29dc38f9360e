"""KV caches as the wire and the coder see them: BF16 bit patterns and FP8 codes.

The canonical layout is ``(layers, 2, kv_heads, tokens, head_dim)``; BF16 travels as
its uint16 bit patterns (torch is imported only when a torch tensor is passed in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class Fp8KV:
    """An FP8 KV cache: e4m3 codes and their per-(layer, kv) fp32 scales."""

    codes: np.ndarray  # (layers, 2, kv_heads, tokens, head_dim) uint8
    scales: np.ndarray  # (layers, 2) float32


def bf16_bits(t: "torch.Tensor | np.ndarray") -> np.ndarray:
    """A BF16 tensor's bit patterns as uint16 numpy (numpy uint16 passes through)."""
    if isinstance(t, np.ndarray):
        if t.dtype not in (np.uint16, np.int16):
            raise TypeError(f"BF16 KV as numpy must hold uint16/int16 bit patterns, not {t.dtype}")
        return np.ascontiguousarray(t).view(np.uint16)
    import torch

    if t.dtype != torch.bfloat16:
        raise TypeError(f"KV and mu tensors must be torch.bfloat16, not {t.dtype}")
    return t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
