"""Adapters between Hugging Face ``DynamicCache`` objects and speckv's canonical
KV layout ``(layers, 2, kv_heads, tokens, head_dim)``.

A prefill engine built on transformers hands ``kv_from_cache(out)`` (its output, or the cache)
to ``EncoderClient.submit``; the decode side rebuilds a cache with
``cache_from_kv(DecoderClient(...).fetch(rid, as_torch=True))`` and continues
generation from it. Both directions copy nothing but the final stack/split and
keep the dtype (BF16 in, BF16 out); only batch size 1 (one request) is taken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import DynamicCache


def kv_from_cache(cache: Any) -> "torch.Tensor":
    """A (batch 1) DynamicCache, or a model output holding one, -> ``(layers, 2, kv_heads, tokens,
    head_dim)`` tensor. NOTE: transformers 5 names an output's cache ``cache`` and deprecates
    ``past_key_values`` (4.x has only that), so an output is read by whichever it has."""
    import torch

    if getattr(cache, "layers", None) is None:  # a model output: its cache
        inner = getattr(cache, "cache", None)
        cache = inner if inner is not None else getattr(cache, "past_key_values", cache)
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"expected a transformers Cache with .layers, got {type(cache).__name__}")
    out = []
    for i, layer in enumerate(layers):
        k, v = layer.keys, layer.values
        if k is None or v is None:
            raise ValueError(f"cache layer {i} is empty")
        if k.shape != v.shape or k.dim() != 4 or k.shape[0] != 1:
            raise ValueError(f"cache layer {i}: keys {tuple(k.shape)} / values {tuple(v.shape)} are not "
                             "(1, kv_heads, tokens, head_dim)")
        out.append(torch.stack([k[0], v[0]]))  # (2, kv_heads, tokens, head_dim)
    if not out:
        raise ValueError("cache has no layers")
    return torch.stack(out).contiguous()  # (layers, 2, kv_heads, tokens, head_dim)


def cache_from_kv(kv: "torch.Tensor | np.ndarray", config: Any = None) -> "DynamicCache":
    """``(layers, 2, kv_heads, tokens, head_dim)`` (torch, or uint16 BF16 bit patterns)
    -> a DynamicCache with batch size 1 (``config``: the model's, for sliding layers)."""
    import torch
    from transformers import DynamicCache

    if isinstance(kv, np.ndarray):
        if kv.dtype != np.uint16:
            raise TypeError(f"numpy KV must be uint16 BF16 bit patterns, not {kv.dtype}")
        kv = torch.from_numpy(np.ascontiguousarray(kv).view(np.int16)).view(torch.bfloat16)
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"KV must be (layers, 2, kv_heads, tokens, head_dim), not {tuple(kv.shape)}")
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for i in range(kv.shape[0]):
        cache.update(kv[i, 0].unsqueeze(0).contiguous(), kv[i, 1].unsqueeze(0).contiguous(), i)
    return cache
