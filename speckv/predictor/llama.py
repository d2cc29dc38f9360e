"""The target's first decoder layers in plain torch, bit for bit as ``target.py`` runs them.

A rung with exact layers (``w8a8:k``, ``w8a8i:k``) needs the target's first k
layers computed exactly as the target computes them. Building them as a
transformers causal LM costs a sidecar ~100 MiB of resident memory for the
import of transformers' Llama modelling code alone, and ``target.py``'s FP32
copy of every linear (the emulated BF16 GEMM) doubles their weights. This module
runs the same operations in the same order on the target's BF16 tensors::

    h = embed[ids]                                        # (T, hidden) BF16
    for layer i < k:
        x = rms_norm(h, g_in)                             # FP32 mean of squares, BF16 out
        q, k, v = linear(x, Wq), linear(x, Wk), linear(x, Wv)   # bf16(x_f32 @ W_f32^T)
        q, k = rope(q), rope(k)                           # BF16: x cos + rotate_half(x) sin
        emit (k, v); attention reads them (FP8-rounded where the engine's does)
        h = h + linear(SDPA(q, k, v, causal, GQA, scale D^-0.5), Wo)
        h = h + linear(silu(linear(x', Wg)) * linear(x', Wu), Wd),  x' = rms_norm(h, g_post)

NOTE: a linear upcasts its BF16 weight per call (exact), so the weights stay
resident once, in BF16; the product is the same FP32 GEMM ``Fp32AccumLinear`` runs.
tests/predictor/test_llama.py checks every output bit against the transformers model.

Lifecycle: ``ExactHead(config, state, k)`` over the rung's state (the tensors are
shared, not copied); ``head.run(ids, on_layer, fp8)`` -> h after layer k - 1 and
the k layers' K/V; ``rope_tables`` and ``rope`` serve the later layers too.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

from speckv.errors import CheckpointError
from speckv.kv import Fp8Attention

from .ladder import layer_index
from .mapped import take_rows

if TYPE_CHECKING:  # pragma: no cover
    import torch

EMBED = "model.embed_tokens.weight"
NORMS = ("input_layernorm", "post_attention_layernorm")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

# config.json keys a Llama directory may leave out, with LlamaConfig's defaults
CONFIG_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "rope_theta": 10000.0, "rope_scaling": None, "rope_parameters": None}
CONFIG_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

# The MLP runs over blocks of HEAD_MLP_ROWS to 2 * HEAD_MLP_ROWS - 1 token rows (the last block takes
# the rest): at 2,048 tokens its FP32 products and BF16 temporaries (T, intermediate) shrink
# fourfold, and a lone pass's live peak (memray) fell from 113.8 to 99.0 MB. NOTE: a row's FP32 GEMM
# result depends on the rows beside it when the block is small: the BLAS then splits the
# reduction, not the output, across threads (two threads, down_proj's K = 1536, under ~256
# rows) or runs a GEMV (one row), and bits change; so no block is under HEAD_MLP_ROWS.
# Wider MLPs are not so lucky: with K = 4096 or 8192 (a 1B Llama's down_proj), 512-row blocks
# changed 186-747 of a (T, 2048) product's elements at 1100 and 2048 tokens. So a head uses blocks
# only where ``blocks_keep_bits`` finds them equal to the whole prompt for its own weights, on
# the CPU, and both sidecars run the same plan (NOTE: never blocks on one side and the whole
# prompt on the other: their mu would then rest on the BLAS giving a row the same bits in any
# block, which it does not promise). tests/predictor/test_llama.py checks blocked prompts
# against the target bit for bit. Cost: blocks quadruple the MLP's GEMM calls; beside a busy
# process on the same core (a prefill engine) each call's OpenMP barrier can wait out that
# process's time slice, and the head ran 20% slower (0.82 -> 0.99 s at 2,048 tokens; 4% alone).
HEAD_MLP_ROWS = 512  # NOTE: not w8a8_pass.MLP_ROWS (the integer layers' blocks, exact at any size)
# prompt lengths ``blocks_keep_bits`` checks: two full blocks, two with the longest tail, four full
# blocks. NOTE: a sample, not a proof: both sidecars agree because they run the same plan, and the
# check keeps a model's exact layers exact where it finds blocks change bits.
HEAD_PROBE_ROWS = (2 * HEAD_MLP_ROWS, 3 * HEAD_MLP_ROWS - 1, 4 * HEAD_MLP_ROWS)

Emit = Callable[[int, "torch.Tensor"], None]  # (layer, its K/V (2, kv_heads, T, head_dim) BF16)


def read_config(path: Path) -> SimpleNamespace | None:
    """A Llama directory's ``config.json`` as plain attributes (what the w8a8 rungs read), or None for
    another model (the caller uses AutoConfig). NOTE: AutoConfig's Llama config class imports most of
    transformers' model-loading code with it, ~77 MiB resident in a sidecar that never builds a model."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if d.get("model_type") != "llama" or d.get("hidden_act", "silu") != "silu" or \
            any(not isinstance(d.get(k), int) for k in CONFIG_REQUIRED):
        return None
    c = {**CONFIG_DEFAULTS, **d}
    params = c["rope_parameters"]
    # NOTE: only the plain default RoPE is read here; any scaling (llama3, yarn, ...) or a dict in another
    # shape goes to AutoConfig, which standardises it, and rope_tables then runs transformers' own RoPE
    if c["rope_scaling"] is not None or c.get("sliding_window") is not None or (params is not None and (
            set(params) - {"rope_type", "rope_theta"} or params.get("rope_type") != "default"
            or not isinstance(params.get("rope_theta"), (int, float)))):
        return None
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
    c["head_dim"] = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    c["rope_parameters"] = params or {"rope_type": "default", "rope_theta": c["rope_theta"]}
    return SimpleNamespace(**c)


def load_config(path: Path, light: bool = True) -> Any:
    """``config.json`` at ``path`` (a file, or a directory holding it): ``read_config``'s plain
    attributes when ``light`` and it applies, else transformers' AutoConfig."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    config = read_config(file) if light else None
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
    return config


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_theta(config: Any) -> float | None:
    """The base of the target's RoPE when it is the plain default one (computed here), else None
    (transformers' LlamaRotaryEmbedding computes it: ``rope_tables``)."""
    params = getattr(config, "rope_parameters", None) or {
        "rope_type": (getattr(config, "rope_scaling", None) or {}).get("rope_type", "default"),
        "rope_theta": getattr(config, "rope_theta", 10000.0)}
    return params["rope_theta"] if params.get("rope_type", "default") == "default" else None


def _hf_rotary(config: Any) -> Any:
    """transformers' rotary embedding of a config with scaled RoPE (llama3, linear, yarn: a static
    table; the ones whose table follows the sequence length are refused). NOTE: built per pass (a
    config is not hashable; building it is one small table)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config=config)
    kind = str(rotary.rope_type)
    if "dynamic" in kind or kind == "longrope":
        raise CheckpointError(f"RoPE type {kind!r} (tables that follow the sequence length) "
                              "is not supported by the exact head")
    return rotary


@functools.lru_cache(maxsize=8)
def _inv_freq(theta: float, dim: int) -> "torch.Tensor":
    import torch

    # NOTE: the very expression transformers' default RoPE evaluates (float32 pow, then a division)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def rope_tables(config: Any, tokens: int, device: Any = "cpu") -> tuple["torch.Tensor", "torch.Tensor"]:
    """BF16 cos, sin (1, tokens, head_dim) at positions 0..tokens-1, as LlamaRotaryEmbedding gives them."""
    import torch

    theta = rope_theta(config)
    if theta is None:
        pos = torch.arange(tokens, device=device)[None]
        return _hf_rotary(config).to(device)(torch.empty(0, dtype=torch.bfloat16, device=device), pos)
    inv = _inv_freq(float(theta), head_dim(config)).to(device)
    freqs = torch.arange(tokens, device=device)[None, :, None].float() * inv  # (1, T, D/2) float32
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def rope(x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
    """BF16 (1, heads, T, D) rotated: x cos + rotate_half(x) sin, each product rounded to BF16."""
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None]) + (rotated * sin[:, None])


def rms_norm(h: "torch.Tensor", gain: "torch.Tensor", eps: float) -> "torch.Tensor":
    """LlamaRMSNorm: FP32 h * rsqrt(mean(h^2) + eps), back to BF16, times the BF16 gain."""
    import torch

    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return gain * x.to(h.dtype)


def linear(x: "torch.Tensor", w: "torch.Tensor") -> "torch.Tensor":
    """bf16(x_f32 @ W_f32^T) of BF16 rows and a BF16 weight (``target.Fp32AccumLinear``)."""
    import torch
    import torch.nn.functional as F

    return F.linear(x.float(), w.float().contiguous()).to(torch.bfloat16)


def attend(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor") -> "torch.Tensor":
    """Causal GQA attention (1, heads, T, D) x (1, kv_heads, T, D) -> rows (T, heads * D), as
    transformers' SDPA path calls it with no mask (a one-token prompt is not causal there)."""
    import torch.nn.functional as F

    T = q.shape[2]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=q.shape[-1] ** -0.5,
                                         is_causal=T > 1, enable_gqa=True)
    return out.transpose(1, 2).contiguous().reshape(T, -1)


def amx_attend(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", fa: Fp8Attention,
               layer: int) -> "torch.Tensor | None":
    """``attend`` as vLLM's amx kernel computes it over an FP8 cache (``amx_fp8``), when ``fa`` says the
    engine runs it and this process can replay it (CPU tensors, head size 64, AMX BF16 tiles); else
    None (``attend``'s FP32 model)."""
    if not fa.amx or q.device.type != "cpu":
        return None
    from . import amx_fp8

    if q.shape[-1] != amx_fp8.HEAD_DIM or not amx_fp8.usable():
        return None
    out = amx_fp8.attention(q[0], k[0], v[0], fa, layer, q.shape[-1] ** -0.5)  # (T, heads, D) BF16
    return out.reshape(q.shape[2], -1)


@functools.cache
def _module_class() -> type:
    """ExactHead, made on first use (``import speckv`` never imports torch)."""
    import torch

    class ExactHead(torch.nn.Module):
        """The target's embeddings and first k decoder layers over its BF16 tensors (shared)."""

        def __init__(self, config: Any, state: dict[str, "torch.Tensor"], k: int, rung: str) -> None:
            super().__init__()
            self.config, self.k, self.eps = config, k, float(config.rms_norm_eps)
            if rope_theta(config) is None:
                _hf_rotary(config)  # NOTE: fail at load, not at the first request
            act, kind = getattr(config, "hidden_act", "silu"), getattr(config, "model_type", "llama")
            if act != "silu" or kind != "llama" or getattr(config, "sliding_window", None) is not None:
                raise CheckpointError(f"{rung}: the exact head computes Llama layers (SiLU, full attention), "
                                      f"not {kind} with {act}")
            names = [EMBED] + [f"model.layers.{i}.{part}.weight" for i in range(k)
                               for part in (*NORMS, *(f"self_attn.{n}" for n in ATTN), *(f"mlp.{n}" for n in MLP))]
            missing = [n for n in names if n not in state]
            extra = [n for n in state if (layer_index(n) or 0) < k and layer_index(n) is not None and n not in names]
            if missing or extra:
                raise CheckpointError(f"{rung} weights do not fit the config: missing {missing[:4]}, "
                                      f"unexpected {extra[:4]}")
            if any(getattr(config, b, False) for b in ("attention_bias", "mlp_bias")):
                raise CheckpointError(f"{rung}: biased linears are not supported yet")
            self.embed = torch.nn.Parameter(state[EMBED], requires_grad=False)
            self.slots = {n: f"w{j}" for j, n in enumerate(names[1:])}
            for n, slot in self.slots.items():
                self.register_buffer(slot, state[n], persistent=False)
            self.mlp_rows: int | None = HEAD_MLP_ROWS if self.blocks_keep_bits() else None  # None: whole prompts

        def w(self, i: int, name: str) -> "torch.Tensor":
            return getattr(self, self.slots[f"model.layers.{i}.{name}.weight"])

        def run(self, ids: "torch.Tensor", emit: Emit | None = None,
                fp8: tuple[Fp8Attention, int] | None = None) -> tuple["torch.Tensor", list["torch.Tensor"]]:
            """int64 ids (T,) -> (h after layer k - 1 (T, hidden) BF16, [K/V (2, kv_heads, T, D)] * k).
            ``emit(i, kv_i)`` as soon as layer i's K/V exist; ``fp8 = (fa, n)``: the attention of layers
            < n reads its K/V rounded as ``fa`` says (the K/V emitted and returned stay as computed)."""
            cfg, T = self.config, int(ids.shape[0])
            H, Hk, D = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(cfg)
            h = take_rows(self.embed, ids)  # (T, hidden) BF16
            cos, sin = rope_tables(cfg, T, h.device)
            layers = []
            for i in range(self.k):
                x = rms_norm(h, self.w(i, "input_layernorm"), self.eps)
                q = rope(linear(x, self.w(i, "self_attn.q_proj")).view(1, T, H, D).transpose(1, 2), cos, sin)
                key = rope(linear(x, self.w(i, "self_attn.k_proj")).view(1, T, Hk, D).transpose(1, 2), cos, sin)
                value = linear(x, self.w(i, "self_attn.v_proj")).view(1, T, Hk, D).transpose(1, 2)
                layers.append(torch.stack([key[0], value[0]]))  # (2, kv_heads, T, D)
                if emit is not None:
                    emit(i, layers[-1])
                att = None
                if fp8 is not None and i < fp8[1]:
                    key, value = fp8[0].round(key, i, 0), fp8[0].round(value, i, 1)
                    att = amx_attend(q, key, value, fp8[0], i)
                h = h + linear(attend(q, key, value) if att is None else att, self.w(i, "self_attn.o_proj"))
                x = rms_norm(h, self.w(i, "post_attention_layernorm"), self.eps)
                rows = self.mlp_rows if h.device.type == "cpu" and self.mlp_rows else T
                for a, b in row_blocks(T, rows):  # h is this layer's own sum: add in place
                    h[a:b] += self.mlp(i, x[a:b])
            return h, layers

        def blocks_keep_bits(self) -> bool:
            """Whether layer 0's MLP gives seeded rows the same bits in blocks as whole (``HEAD_MLP_ROWS``),
            at each of ``HEAD_PROBE_ROWS``, under the forward passes' thread count; CPU weights only.
            NOTE: at construction, outside any forward (``deterministic_torch``'s lock is not re-entrant)."""
            from .target import deterministic_torch

            if self.embed.device.type != "cpu" or self.k == 0:
                return False
            gen = torch.Generator().manual_seed(0)
            with deterministic_torch():
                for T in HEAD_PROBE_ROWS:
                    x = torch.randn(T, self.config.hidden_size, generator=gen).to(torch.bfloat16)
                    whole = self.mlp(0, x)
                    parts = torch.cat([self.mlp(0, x[a:b]) for a, b in row_blocks(T, HEAD_MLP_ROWS)])
                    if not torch.equal(whole.view(torch.int16), parts.view(torch.int16)):
                        return False
            return True

        def mlp(self, i: int, x: "torch.Tensor") -> "torch.Tensor":
            """down(silu(gate(x)) * up(x)) of rows x (rows, hidden) BF16."""
            # NOTE: in place, the same kernels and bits: two fewer (rows, 1536) BF16 temporaries
            gate = torch.nn.functional.silu(linear(x, self.w(i, "mlp.gate_proj")), inplace=True)
            return linear(gate.mul_(linear(x, self.w(i, "mlp.up_proj"))), self.w(i, "mlp.down_proj"))

    return ExactHead


def row_blocks(T: int, rows: int) -> list[tuple[int, int]]:
    """[a, b) row blocks of T rows: ``rows`` each, the last taking the rest (none shorter than ``rows``
    unless T is)."""
    cuts = [j * rows for j in range(max(1, T // max(rows, 1)))] + [T]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def exact_head(config: Any, state: dict[str, "torch.Tensor"], k: int, rung: str) -> Any:
    """The target's first k layers over ``state`` (``ExactHead``; its tensors shared, not copied)."""
    return _module_class()(config, state, k, rung).eval()
