"""The target's FP32-accumulating linears: every decoder-layer linear swapped for one that
computes bf16(x_f32 @ W_f32^T), the way the sidecars' target (and the predictors built on it)
runs its products."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from speckv.errors import ModelLoadError

if TYPE_CHECKING:  # pragma: no cover
    import torch

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp32_linear_class() -> type:
    import torch
    import torch.nn.functional as F

    class Fp32AccumLinear(torch.nn.Module):
        """y = bf16(x_f32 @ W_f32^T): BF16 in and out, FP32 accumulation."""

        weight_f32: "torch.Tensor"  # a non-persistent buffer

        def __init__(self, weight_f32: "torch.Tensor") -> None:
            super().__init__()
            self.register_buffer("weight_f32", weight_f32.contiguous(), persistent=False)

        def forward(self, x: "torch.Tensor") -> "torch.Tensor":
            return F.linear(x.float(), self.weight_f32).to(torch.bfloat16)

    return Fp32AccumLinear


def replace_linears(model: Any, weight_fn: Callable[[str, "torch.Tensor"], "torch.Tensor"]) -> None:
    """Swap every decoder-layer linear for an FP32-accumulating one.

    ``weight_fn(name, bf16_weight) -> fp32 weight`` lets the predictor put its
    FP8-dequantized weights in; the target passes the exact BF16 upcast.
    """
    cls = fp32_linear_class()
    for i, layer in enumerate(model.model.layers):
        for part in ("self_attn", "mlp"):
            parent = getattr(layer, part)
            for name in LINEAR_NAMES:
                lin = getattr(parent, name, None)
                if lin is None:
                    continue
                path = f"model.layers.{i}.{part}.{name}"
                if getattr(lin, "bias", None) is not None:
                    raise ModelLoadError(f"{path}: biased linears are not supported yet")
                setattr(parent, name, cls(weight_fn(path, lin.weight.detach())))
