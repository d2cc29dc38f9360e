"""The early-exit rung ``early:k``: the target's first k decoder layers, then every
later layer's K/V projected from the hidden state after layer k.

Lifecycle: ``early_state(target_state, rung)`` picks the weights the rung needs
(all of layers < k; of each later layer only its input norm and K/V
projections; the embeddings), all the target's BF16 tensors, so the manifest's
weight digest covers exactly them; ``build_early_model(config, state, k)``
builds the model (an ``EarlyExitKV`` torch module) from them; ``early_kv(model, ids, on_layer)`` runs
it: layers < k exactly as ``target.py`` runs the target (so their mu is the
target's KV bit for bit on the same machine), then for each layer l >= k (layer
k's input is that hidden state, so its mu is exact too)::

    h = hidden state after layer k - 1      # (1, tokens, hidden), BF16, before any norm
    x = input_layernorm_l(h)                # the layer's own RMSNorm
    K = rope(k_proj_l(x)),  V = v_proj_l(x)  # FP32-accumulating linears, BF16 out

Cost: k layers plus (L - k) pairs of K/V projections (``ladder.EARLY_TAIL_COST``
of a layer each). The per-channel mu correction and sigma of the tuned residual
model (calibrated like every rung) absorb the scale drift of skipping layers.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from speckv.errors import CheckpointError
from speckv.kv import bf16_bits

from .fp32_linear import fp32_linear_class, replace_linears
from .ladder import Rung, layer_index
from .target import LayerSink, cache_layer, deterministic_torch, hooked_forward, output_cache

if TYPE_CHECKING:  # pragma: no cover
    import torch

TAIL_PARTS = (".input_layernorm.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight")
EMBED = "model.embed_tokens.weight"


def early_state(target_state: Mapping[str, "torch.Tensor"], rung: Rung) -> dict[str, "torch.Tensor"]:
    """The target's BF16 tensors ``early:k`` computes with, nothing else."""
    out = {}
    for name, t in target_state.items():
        index = layer_index(name)
        keep = name == EMBED or (index is not None and (index < rung.bf16_layers or name.endswith(TAIL_PARTS)))
        if keep:
            out[name] = t.detach().clone()
    return out


def build_early_model(config: Any, state: dict[str, "torch.Tensor"], k: int) -> Any:
    """``early:k`` over ``state`` (``early_state``'s tensors) for a model of ``config``."""
    model = exact_head(config, state, k, f"early:{k}")
    return _make(config, model, [_tail_layer(config, state, i, model) for i in range(k, config.num_hidden_layers)])


def exact_head(config: Any, state: dict[str, "torch.Tensor"], k: int, rung: str) -> Any:
    """The target's first k decoder layers over ``state``, run exactly as ``target.py`` runs them:
    a truncated causal LM whose ``last_hidden_state`` is h after layer k - 1 (no final norm)."""
    import torch
    from transformers import AutoModelForCausalLM

    head = copy.deepcopy(config)
    head.num_hidden_layers = k
    head._attn_implementation = "sdpa"
    with torch.device("meta"):  # NOTE: no weights allocated: the state's own tensors are assigned below
        model = AutoModelForCausalLM.from_config(head, dtype=torch.bfloat16)
    first = {n: t for n, t in state.items() if n == EMBED or (layer_index(n) or 0) < k}
    missing, unexpected = model.load_state_dict(first, strict=False, assign=True)  # shared, not copied
    missing = [m for m in missing if m not in ("lm_head.weight", "model.norm.weight")]
    if missing or unexpected:
        raise CheckpointError(f"{rung} weights do not fit the config: missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]}")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=head)  # its buffers were made on meta
    model.model.norm = torch.nn.Identity()  # NOTE: last_hidden_state is then h after layer k - 1
    model.lm_head = None  # never computes logits
    replace_linears(model, lambda _name, w: w.float())  # exactly as the target runs them
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{rung}: the exact head has tensors with no weights: {left[:4]}")
    return model


def _tail_layer(config: Any, state: dict[str, "torch.Tensor"], i: int, model: Any) -> Any:
    import torch

    names = [f"model.layers.{i}{part}" for part in TAIL_PARTS]
    if any(n not in state for n in names):
        raise CheckpointError(f"early-exit weights lack layer {i}'s norm or K/V projections")
    norm = type(model.model.layers[0].input_layernorm)(config.hidden_size, eps=config.rms_norm_eps)
    norm.weight = torch.nn.Parameter(state[names[0]].to(torch.bfloat16), requires_grad=False)
    linear = fp32_linear_class()
    return torch.nn.ModuleDict({"norm": norm, "k_proj": linear(state[names[1]].float()),
                                "v_proj": linear(state[names[2]].float())})


@functools.cache
def _module_class() -> type:
    """EarlyExitKV, made on first use (``import speckv`` never imports torch)."""
    import torch

    class EarlyExitKV(torch.nn.Module):
        """The first k layers (a truncated causal LM) and the later layers' K/V heads."""

        def __init__(self, config: Any, head: Any, tail: list[Any]) -> None:
            super().__init__()
            self.config = config  # the full model's: layers, heads, vocab, context
            self.head = head
            self.tail = torch.nn.ModuleList(tail)

    return EarlyExitKV


def _make(config: Any, head: Any, tail: list[Any]) -> Any:
    return _module_class()(config, head, tail).eval()


def early_kv(model: Any, ids: np.ndarray, on_layer: LayerSink | None = None) -> "torch.Tensor":
    """mu ``(layers, 2, kv_heads, tokens, head_dim)`` BF16 of ``early:k``; ``on_layer`` as in
    ``target.extract_kv`` (layers < k as their decoder layer runs, then each tail layer)."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = model.config
    H = cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    k = len(model.head.model.layers)
    if len(ids) == 0:
        return torch.empty((cfg.num_hidden_layers, 2, H, 0, D), dtype=torch.bfloat16)
    with deterministic_torch():
        out = hooked_forward(model.head, ids, on_layer)
        cache, h = output_cache(out), out.last_hidden_state  # h: (1, tokens, hidden)
        layers = [cache_layer(cache, i) for i in range(k)]
        pos = torch.arange(len(ids), device=h.device)[None]
        cos, sin = model.head.model.rotary_emb(h, position_ids=pos)
        for i, t in enumerate(model.tail, start=k):
            x = t["norm"](h)
            key = t["k_proj"](x).view(1, len(ids), H, D).transpose(1, 2)
            value = t["v_proj"](x).view(1, len(ids), H, D).transpose(1, 2)
            key = apply_rotary_pos_emb(key, key, cos, sin)[1]
            layers.append(torch.stack([key[0], value[0]]))  # (2, kv_heads, tokens, head_dim)
            if on_layer is not None:
                on_layer(i, bf16_bits(layers[-1].to(torch.bfloat16).contiguous().cpu()))
    return torch.stack(layers).to(torch.bfloat16).contiguous().cpu()
