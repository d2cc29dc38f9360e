"""The portable rung: the target's shape computed in integers only, so mu is the
same bits on every CPU and GPU (``integer.py`` says why each step is exact).

Lifecycle: ``portable_state(target_state, config)`` quantises every decoder
linear the rung computes to int8 (one float64 scale per output channel; q, k, v
fused, gate and up fused) and adds the integer tables (``integer.tables``);
the manifest's weight digest covers all of it, so a machine whose libm would
build different tables refuses the checkpoint (``PinMismatchError``) instead of
computing another mu. ``build_portable_model(config, state)`` wraps them in a
``PortableKV`` module; ``portable_kv(model, ids, on_layer)`` runs it::

    h = embed(ids)                                   # int64, FRAC fractional bits
    for each layer l:
        q, k, v = norm_linear(h, qkv_l);  q, k = rope(q), rope(k)
        mu_l = bf16(k), bf16(v)                      # one rounding each, in integers
        h += linear(attention(q, k, v), o_l)         # (not after the last layer)
        h += linear(silu(g) * u, down_l) with g, u = norm_linear(h, gate_up_l)

``integer.py`` has the arithmetic; ``int_attention.py`` the attention.

Cost on a CPU: int8 products (oneDNN VNNI through ``torch._int_mm``) instead of the
FP32 ones of the emulated-BF16 rungs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from speckv.errors import CheckpointError
from speckv.kv import bf16_bits

from . import integer as ix
from .int_attention import attention
from .target import LayerSink, deterministic_torch

if TYPE_CHECKING:  # pragma: no cover
    import torch

EMBED = "model.embed_tokens.weight"
CANARY_TOKENS = 256  # the start-up canary: mu of fixed ids, recorded in the manifest at build
NORMS = ("input_layernorm", "post_attention_layernorm")
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def _quantise_weight(w: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    q, amax = ix.quantise(w)
    return q.contiguous(), ix.div(amax, ix.Q_MAX)


def portable_state(target_state: Mapping[str, "torch.Tensor"], config: Any) -> dict[str, "torch.Tensor"]:
    """int8 fused linears + float64 scales, the BF16 norms and embeddings, the integer tables."""
    import torch

    out: dict[str, torch.Tensor] = {EMBED: target_state[EMBED].detach().clone()}
    layers = config.num_hidden_layers
    for i in range(layers):
        p = f"model.layers.{i}."
        for norm in NORMS:
            out[p + norm + ".weight"] = target_state[p + norm + ".weight"].detach().clone()
        for fused, parts in FUSED.items():
            if i == layers - 1 and fused != "qkv":
                continue  # the last layer's K and V need nothing after its projections
            w = torch.cat([target_state[p + part + ".weight"] for part in parts])
            out[p + fused + ".w8"], out[p + fused + ".ws"] = _quantise_weight(w)
    out.update(ix.tables(config))
    return out


@functools.cache
def _module_class() -> type:
    import torch

    class PortableKV(torch.nn.Module):
        """The portable rung's tensors (buffers; the embedding is the one parameter)."""

        def __init__(self, config: Any, state: dict[str, "torch.Tensor"]) -> None:
            super().__init__()
            self.config = config
            self.embed = torch.nn.Parameter(state[EMBED], requires_grad=False)
            self.names = sorted(n for n in state if n != EMBED)
            for j, name in enumerate(self.names):
                self.register_buffer(f"t{j}", state[name], persistent=False)

        def get(self, name: str) -> "torch.Tensor":
            return getattr(self, f"t{self.names.index(name)}")

    return PortableKV


def build_portable_model(config: Any, state: dict[str, "torch.Tensor"]) -> Any:
    want = set(portable_state_names(config))
    if set(state) != want:
        raise CheckpointError(f"portable weights do not fit the config: missing {sorted(want - set(state))[:4]}, "
                              f"unexpected {sorted(set(state) - want)[:4]}")
    return _module_class()(config, state).eval()


def portable_state_names(config: Any) -> list[str]:
    names = [EMBED, *ix.TABLE_NAMES]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + n + ".weight" for n in NORMS]
        fused = ["qkv"] if i == config.num_hidden_layers - 1 else list(FUSED)
        names += [p + f + s for f in fused for s in (".w8", ".ws")]
    return names


def portable_kv(model: Any, ids: np.ndarray, on_layer: LayerSink | None = None,
                exact: bool = False) -> "torch.Tensor":
    """mu ``(layers, 2, kv_heads, tokens, head_dim)`` BF16; ``exact``: the reference path
    (int64 products, no native stage), which must give the same bits."""
    import torch

    cfg = model.config
    L, H, Hk = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    T = len(ids)
    if T == 0:
        return torch.empty((L, 2, Hk, 0, D), dtype=torch.bfloat16)
    if T > cfg.max_position_embeddings:
        raise ix.IntegerRangeError(f"{T} tokens exceed the rope table's {cfg.max_position_embeddings} positions")
    get, eps = model.get, float(cfg.rms_norm_eps)
    layers = []
    with deterministic_torch():
        dev = model.embed.device
        tok = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=dev)
        h = torch.round(model.embed[tok].double() * float(1 << ix.FRAC)).to(torch.int64)  # (T, hidden)
        cos, sin = get("portable.rope_cos")[:T], get("portable.rope_sin")[:T]
        for i in range(L):
            p = f"model.layers.{i}."
            last = i == L - 1
            w8, ws = get(p + "qkv.w8"), get(p + "qkv.ws")
            if last:  # only K and V
                w8, ws = w8[H * D:], ws[H * D:]
            qkv = ix.norm_linear(h, get(p + "input_layernorm.weight"), eps, w8, ws, exact)
            kv = qkv if last else qkv[:, H * D:]
            k = ix.rope(kv[:, : Hk * D].reshape(T, Hk, D), cos, sin)
            v = kv[:, Hk * D:].reshape(T, Hk, D)
            layer = torch.stack([ix.to_bf16(k).transpose(0, 1), ix.to_bf16(v).transpose(0, 1)]).cpu()
            layers.append(layer)  # (2, kv_heads, tokens, head_dim)
            if on_layer is not None:
                on_layer(i, bf16_bits(layer.contiguous()))
            if last:
                break
            q = ix.rope(qkv[:, : H * D].reshape(T, H, D), cos, sin)
            h = _block_rest(model, p, h, attention(q, k, v, get("portable.exp"), exact), eps, exact)
    return torch.stack(layers).contiguous()


def _block_rest(model: Any, p: str, h: "torch.Tensor", att: "torch.Tensor", eps: float,
                exact: bool) -> "torch.Tensor":
    """The layer after attention: output projection, residual, MLP, residual."""
    get = model.get
    h = ix.linear(att.reshape(h.shape[0], -1), get(p + "o.w8"), get(p + "o.ws"), exact, add=h)
    gu = ix.norm_linear(h, get(p + "post_attention_layernorm.weight"), eps, get(p + "gate_up.w8"),
                        get(p + "gate_up.ws"), exact)
    m = ix.silu_mul(gu, get("portable.silu"), exact)
    return ix.linear(m, get(p + "down.w8"), get(p + "down.ws"), exact, add=h)


def canary_ids(vocab: int, tokens: int = CANARY_TOKENS) -> np.ndarray:
    """Fixed token ids (no tokenizer needed): a stride through the vocabulary."""
    return (np.arange(tokens, dtype=np.int64) * 7919 + 11) % vocab


def portable_canary(model: Any) -> dict[str, Any]:
    """``{"tokens", "mu_sha256"}`` of the rung's mu of ``canary_ids``: the same on every machine."""
    import hashlib

    tokens = min(CANARY_TOKENS, model.config.max_position_embeddings)
    mu = portable_kv(model, canary_ids(model.config.vocab_size, tokens))
    return {"tokens": tokens, "mu_sha256": hashlib.sha256(bf16_bits(mu.contiguous()).tobytes()).hexdigest()}
