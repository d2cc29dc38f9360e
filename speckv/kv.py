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


E4M3_MAX = 448.0  # the largest finite e4m3 value


@dataclass(frozen=True)
class Fp8Attention:
    """How an engine's attention reads its FP8 KV cache: each layer's K and V rounded to e4m3 at
    that layer's scale (value = code * scale), to nearest even or toward zero (vLLM's CPU cache
    writer). An engine whose attention reads such a cache computes every later layer's K/V from
    the rounded ones; a predictor told so rounds its own K/V the same way before its attention
    (``Predictor.mu(..., fp8_attention=)``), so its mu follows the engine's.
    """

    k_scales: tuple[float, ...]  # one per layer (fp32)
    v_scales: tuple[float, ...]
    toward_zero: bool = False
    # the engine's attention is vLLM's CPU ``amx`` kernel: codes widened to BF16 unscaled, products on
    # AMX tiles (``speckv.predictor.amx_fp8`` replays it where a W8A8 rung's attention reads the cache)
    amx: bool = False

    def __post_init__(self) -> None:
        if len(self.k_scales) != len(self.v_scales) or not self.k_scales:
            raise ValueError("fp8_attention: one K and one V scale per layer")
        scales = np.asarray(self.k_scales + self.v_scales, np.float64).astype(np.float32)  # as round() uses them
        if not (np.isfinite(scales).all() and (scales > 0).all()):
            raise ValueError("fp8_attention: scales must be finite and positive fp32 values")

    @property
    def key(self) -> bytes:
        """A stable identity (what a mu cache keys on)."""
        scales = np.asarray(self.k_scales + self.v_scales, np.float32)
        return scales.tobytes() + bytes([self.toward_zero | self.amx << 1])

    def round(self, x: "torch.Tensor", layer: int, kv: int) -> "torch.Tensor":
        """``x`` (K if ``kv`` is 0, else V, of ``layer``) as the engine's attention reads it: e4m3 at the
        layer's scale (saturating at +-448), back in ``x``'s dtype."""
        import torch

        scale = float(np.float32((self.k_scales if kv == 0 else self.v_scales)[layer]))
        y = (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX)
        q = y.to(torch.float8_e4m3fn)
        if self.toward_zero:  # one code back where nearest rounded away from zero
            codes = q.view(torch.uint8).clone()
            codes[(q.float().abs() > y.abs()) & ((codes & 0x7F) > 0)] -= 1
            q = codes.view(torch.float8_e4m3fn)
        return (q.float() * scale).to(x.dtype)


@dataclass(frozen=True)
class HeadRange:
    """Heads ``start .. start + count - 1`` of a model's ``total`` KV heads: what one
    tensor-parallel rank holds (its KV is ``(layers, 2, count, tokens, head_dim)``)."""

    start: int
    count: int
    total: int

    def __post_init__(self) -> None:
        if not (0 <= self.start and 1 <= self.count and self.start + self.count <= self.total):
            raise ValueError(f"head range {self.start}+{self.count} does not fit {self.total} heads")

    @property
    def stop(self) -> int:
        return self.start + self.count

    @property
    def whole(self) -> bool:
        return self.count == self.total

    @classmethod
    def of_rank(cls, rank: int, ranks: int, total: int) -> "HeadRange":
        """Rank ``rank`` of ``ranks``'s heads when they split ``total`` evenly (as tensor
        parallelism does while ``ranks`` <= heads; ValueError otherwise)."""
        if not 0 <= rank < ranks or total % ranks:
            raise ValueError(f"{total} KV heads do not split over {ranks} ranks (rank {rank})")
        per = total // ranks
        return cls(rank * per, per, total)

    def __str__(self) -> str:
        return f"heads {self.start}..{self.stop - 1} of {self.total}"


def some_heads(heads: HeadRange | None) -> HeadRange | None:
    """``heads`` where it is some of the model's heads; None for all of them (named or not),
    as transfers are keyed and coded."""
    return None if heads is None or heads.whole else heads
