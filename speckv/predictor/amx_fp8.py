"""Attention over an FP8 cache as vLLM's CPU ``amx`` kernel computes it, bit for bit.

On CPUs with AMX, vLLM's CPU attention widens each e4m3 code of its FP8 cache to BF16 without
its scale (the code's value times 2^-120) and runs both products as AMX BF16 tile products,
which treat denormal inputs as zero and flush tiny partial sums. At that offset it loses what an
FP32 attention keeps (0.24 of its outputs equal FP32 attention over the same cache; no float
model of the flush was found: benchmarks/RESULTS.md). So the predictor's exact layers, told that
the engine reads its cache this way (``Fp8Attention.amx``), replay it (the exact head,
``llama.amx_attend``, and the W8A8 rungs' later layers, ``w8a8_pass``; the other rungs keep the
FP32 model): the products on AMX tiles
in vLLM's operand order (``coder/kernels/spk_fp8_amx.h``), the softmax between them in FP32
as vLLM's kernel does it (the row's max, exp, the sum of the unrounded weights, weights
rounded to BF16), then ``out * (v_scale * 2^120) / sum`` rounded to BF16.
benchmarks/research/vllm_amx_attention.py checks this against vLLM's own op.

A CPU without AMX BF16 cannot replay it: there the attention stays the FP32 model
(``amx_ready`` is False, logged once); a sidecar pair that disagrees on this sends the
affected chunks stored (their mu digests differ), never wrong bytes.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import numpy as np

from .target import COMPUTE_THREADS

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from speckv.kv import Fp8Attention

logger = logging.getLogger(__name__)

UNSCALED = 2.0 ** 120  # what the kernel's BF16 widening of an e4m3 code leaves off (2^(127 - 7))
HEAD_DIM = 64  # the head size the tile products take (spk_fp8_amx.h FP8_AMX_D)
THREADS = COMPUTE_THREADS  # the native kernel's threads


def amx_ready() -> bool:
    """Whether this process can replay the kernel (AMX BF16 tiles, the native extension)."""
    try:
        from speckv.coder import _native
    except ImportError:
        return False
    ready = getattr(_native, "fp8_amx_ready", None)  # NOTE: an extension built before the replay has none
    return ready is not None and bool(ready())


def codes(x: "torch.Tensor", scale: float) -> "torch.Tensor":
    """e4m3 codes (uint8) of ``x``, values already on the grid of ``scale`` (``Fp8Attention.round``)."""
    import torch

    return (x.float() / float(np.float32(scale))).to(torch.float8_e4m3fn).view(torch.uint8)


def folded(fa: "Fp8Attention", layer: int, scaling: float) -> tuple[float, float]:
    """(s, bias) as the kernel folds them in FP32: s = softmax scale * (k_scale * 2^120) onto the
    logits, bias = v_scale * 2^120 onto the output."""
    s = np.float32(scaling) * (np.float32(fa.k_scales[layer]) * np.float32(UNSCALED))
    return float(s), float(np.float32(fa.v_scales[layer]) * np.float32(UNSCALED))


def _operands(query: "torch.Tensor", key: "torch.Tensor", value: "torch.Tensor", fa: "Fp8Attention",
              layer: int) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    import torch

    if query.shape[-1] != HEAD_DIM:
        raise ValueError(f"the AMX FP8 replay takes head size {HEAD_DIM}, not {query.shape[-1]}")
    q = query.to(torch.bfloat16).contiguous()
    return q, codes(key, fa.k_scales[layer]).contiguous(), codes(value, fa.v_scales[layer]).contiguous()


def attention(query: "torch.Tensor", key: "torch.Tensor", value: "torch.Tensor", fa: "Fp8Attention", layer: int,
              scaling: float) -> "torch.Tensor":
    """Causal attention of ``query`` (H, T, 64) over ``key``, ``value`` (Hk, U, 64), U >= T, the
    queries being the last T positions; ``key``/``value`` hold layer ``layer``'s cache values as
    ``fa`` rounds them. Returns (T, H, 64) BF16, the engine's attention output (one native call:
    coder/kernels/spk_fp8_amx.h ``fp8_amx_rows``)."""
    import torch

    from speckv.coder import _native

    q, kc, vc = _operands(query, key, value, fa, layer)
    (H, T, _), (Hk, U) = q.shape, kc.shape[:2]
    out = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16)
    _native.fp8_amx_attention(q.view(torch.int16).numpy(), kc.numpy(), vc.numpy(), out.view(torch.int16).numpy(),
                              H, Hk, T, U, *folded(fa, layer, scaling), THREADS)
    return out


def reference(query: "torch.Tensor", key: "torch.Tensor", value: "torch.Tensor", fa: "Fp8Attention", layer: int,
              scaling: float) -> "torch.Tensor":
    """``attention`` with the softmax in torch between the two native tile products (the replay
    first checked against vLLM's op); its weights can differ from ``attention``'s in the last bit
    of an exp, so rarely in a BF16 weight."""
    import torch

    from speckv.coder import _native

    q, kc, vc = _operands(query, key, value, fa, layer)
    (H, T, D), (Hk, U) = q.shape, kc.shape[:2]
    u16, u32 = -(-U // 16) * 16, -(-U // 32) * 32
    scores = torch.empty(H, T, u16)
    _native.fp8_amx_scores(q.view(torch.int16).numpy(), kc.numpy(), scores.numpy(), H, Hk, T, U, THREADS)
    s, bias = folded(fa, layer, scaling)
    logits = scores[:, :, :U] * torch.tensor(s, dtype=torch.float32)
    keys, rows = torch.arange(U), torch.arange(U - T, U)
    logits = logits.masked_fill(keys[None, None, :] > rows[None, :, None], float("-inf"))
    p = torch.exp(logits - logits.max(-1, keepdim=True).values)
    total = p.sum(-1, keepdim=True)
    weights = torch.zeros(H, T, u32, dtype=torch.bfloat16)
    weights[:, :, :U] = p.to(torch.bfloat16)
    out = torch.empty(H, T, D)
    _native.fp8_amx_pv(weights.view(torch.int16).numpy(), vc.numpy(), out.numpy(), H, Hk, T, U, THREADS)
    return (out * torch.tensor(bias, dtype=torch.float32) / total).to(torch.bfloat16).transpose(0, 1)


def usable() -> bool:
    """``amx_ready``, and a warning the first time it is not (module docstring)."""
    if amx_ready():
        return True
    _warn_unavailable()
    return False


@functools.cache
def _warn_unavailable() -> None:
    logger.warning("the engine reads its FP8 cache with vLLM's amx kernel, but this CPU gives no AMX BF16 "
                   "tiles: this predictor keeps the FP32 attention model (a peer that replays the kernel "
                   "computes another mu; those chunks go stored)")
