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

``portable:k`` (``exit_layer = k``) runs layers < k so, then for each layer l >= k only::

    mu_l = bf16(rope(k)), bf16(v) with k, v = norm_linear(h, kv_l)   # h: the input of layer k

its state holding no more of those layers than their input norm and fused K/V
weights (``kv``: the K and V rows of ``qkv``, the same int8 codes and scales).

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


def _layer_parts(config: Any, i: int, exit_layer: int) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """(norms, fused linears) layer ``i`` of ``portable[:exit_layer]`` computes with."""
    if exit_layer and i >= exit_layer:
        return NORMS[:1], {"kv": FUSED["qkv"][1:]}  # an exited layer: K and V of layer exit_layer's input
    if i == config.num_hidden_layers - 1:
        return NORMS, {"qkv": FUSED["qkv"]}  # the last layer's K and V need nothing after its projections
    return NORMS, FUSED


def portable_state(target_state: Mapping[str, "torch.Tensor"], config: Any,
                   exit_layer: int = 0) -> dict[str, "torch.Tensor"]:
    """int8 fused linears + float64 scales, the BF16 norms and embeddings, the integer tables
    (``exit_layer``: the k of portable:k)."""
    import torch

    out: dict[str, torch.Tensor] = {EMBED: target_state[EMBED].detach().clone()}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        norms, fused = _layer_parts(config, i, exit_layer)
        for norm in norms:
            out[p + norm + ".weight"] = target_state[p + norm + ".weight"].detach().clone()
        for name, parts in fused.items():
            w = torch.cat([target_state[p + part + ".weight"] for part in parts])
            out[p + name + ".w8"], out[p + name + ".ws"] = _quantise_weight(w)
    out.update(ix.tables(config))
    return out


@functools.cache
def _module_class() -> type:
    import torch

    class PortableKV(torch.nn.Module):
        """The portable rung's tensors (buffers; the embedding is the one parameter). Where the
        fused kernel runs (AVX-512 VNNI), each linear's int8 weights are kept only in its packed
        layout (``ix.wide_pack``): ``get`` unpacks them for the reference and unfused paths."""

        def __init__(self, config: Any, state: dict[str, "torch.Tensor"], exit_layer: int = 0) -> None:
            super().__init__()
            self.config = config
            self.exit_layer = exit_layer  # portable:k's k; 0: every layer whole
            self.embed = torch.nn.Parameter(state[EMBED], requires_grad=False)
            self.names = sorted(n for n in state if n != EMBED)
            for j, name in enumerate(self.names):
                self.register_buffer(f"t{j}", state[name], persistent=False)
            self._packed: dict[tuple[str, int], torch.Tensor] = {}
            self._shapes: dict[str, tuple[int, int]] = {}  # weights kept packed only
            self.silu_packed: set[str] = set()  # gate_up weights packed for the SiLU epilogue (ix.wide_interleave)
            self._unpacked: dict[tuple[str, str], torch.Tensor] = {}  # packed weights, plain on a device
            if ix.fused_hardware():
                self._pack(config)

        def _pack(self, config: Any) -> None:
            import torch

            H, L = config.num_attention_heads, config.num_hidden_layers
            D = getattr(config, "head_dim", None) or config.hidden_size // H
            for j, name in enumerate(self.names):
                w = getattr(self, f"t{j}")
                if not name.endswith(".w8") or w.shape[1] > ix.WIDE_FUSED_MAX_K:
                    continue
                if name == f"model.layers.{L - 1}.qkv.w8":  # the last layer computes only K and V
                    self._packed[(name, H * D)] = ix.wide_pack(w[H * D:])
                if name.endswith("gate_up.w8") and w.shape[0] % 64 == 0:
                    self.silu_packed.add(name)
                    w = ix.wide_interleave(w)
                self._packed[(name, 0)] = ix.wide_pack(w)
                self._shapes[name] = tuple(w.shape)
                setattr(self, f"t{j}", torch.empty(0, dtype=torch.int8))  # NOTE: one copy of the weights

        def get(self, name: str) -> "torch.Tensor":
            if name in self._shapes:
                dev = self.embed.device
                if dev.type != "cpu" and (name, str(dev)) in self._unpacked:  # NOTE: a device keeps them plain
                    return self._unpacked[(name, str(dev))]
                w = ix.wide_unpack(self._packed[(name, 0)], *self._shapes[name])
                w = (ix.wide_interleave(w, inverse=True) if name in self.silu_packed else w).to(dev)
                if dev.type != "cpu":
                    self._unpacked[(name, str(dev))] = w
                return w
            return getattr(self, f"t{self.names.index(name)}")

        def weights(self, name: str, rows: int, exact: bool) -> tuple["torch.Tensor | None", "torch.Tensor | None"]:
            """(int8 weights ``name`` from output row ``rows`` on, None) for the reference and unfused
            paths, or (None, their packed layout) where the fused kernel runs."""
            fused = not exact and ix.NATIVE and ix.FUSED and self.embed.device.type == "cpu"
            if fused and (name, rows) in self._packed:
                return None, self._packed[(name, rows)]
            return self.get(name)[rows:], None
    return PortableKV


def build_portable_model(config: Any, state: dict[str, "torch.Tensor"], exit_layer: int = 0) -> Any:
    want = set(portable_state_names(config, exit_layer))
    if set(state) != want:
        raise CheckpointError(f"portable weights do not fit the config: missing {sorted(want - set(state))[:4]}, "
                              f"unexpected {sorted(set(state) - want)[:4]}")
    return _module_class()(config, state, exit_layer).eval()


def portable_state_names(config: Any, exit_layer: int = 0) -> list[str]:
    names = [EMBED, *ix.TABLE_NAMES]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        norms, fused = _layer_parts(config, i, exit_layer)
        names += [p + n + ".weight" for n in norms]
        names += [p + f + s for f in fused for s in (".w8", ".ws")]
    return names


def portable_kv(model: Any, ids: np.ndarray, on_layer: LayerSink | None = None,
                exact: bool = False) -> "torch.Tensor":
    """mu ``(layers, 2, kv_heads, tokens, head_dim)`` BF16; ``exact``: the reference path
    (int64 products, no native stage), which must give the same bits."""
    mu = portable_pass(model, ids, on_layer, exact, keep=True)
    assert mu is not None
    return mu


def portable_pass(model: Any, ids: np.ndarray, on_layer: LayerSink | None, exact: bool = False,
                  keep: bool = False) -> "torch.Tensor | None":
    """``portable_kv``; ``keep=False`` (a sidecar's pass): no layer is kept once ``on_layer`` has
    it, and None comes back (the layers and their stack would be the whole mu twice over)."""
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
        if model.weights("model.layers.0.qkv.w8", 0, exact)[1] is not None:
            # NOTE: the native kernels thread themselves; torch's idle OpenMP workers would spin
            # on the second core between them
            torch.set_num_threads(1)
        dev = model.embed.device
        tok = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=dev)
        h = torch.round(model.embed[tok].double() * float(1 << ix.FRAC)).to(torch.int64)  # (T, hidden)
        work = _Workspace()  # the fused kernels' outputs, reused by every layer; h is updated in place
        cos, sin = get("portable.rope_cos")[:T], get("portable.rope_sin")[:T]
        for i in range(L):
            p = f"model.layers.{i}."
            exited = 0 < model.exit_layer <= i  # portable:k: K and V of layer k's input h, which stays as it is
            kv_only = exited or i == L - 1
            name, rows = (p + "kv", 0) if exited else (p + "qkv", H * D if kv_only else 0)
            (w8, packed), ws = model.weights(name + ".w8", rows, exact), get(name + ".ws")[rows:]
            qkv = ix.norm_linear(h, get(p + "input_layernorm.weight"), eps, w8, ws, exact, packed,
                                 work.get("qkv", (T, ws.shape[0])))
            q, k, v, layer = ix.split_qkv(qkv, cos, sin, 0 if kv_only else H, Hk, D, exact)
            layer = layer.cpu()  # (2, kv_heads, tokens, head_dim)
            if on_layer is not None:
                on_layer(i, bf16_bits(layer))
            if keep:
                layers.append(layer)
            if kv_only:
                continue
            assert q is not None  # a whole layer computes its queries
            h = _block_rest(model, p, h, attention(q, k, v, get("portable.exp"), exact), eps, exact, work)
    return torch.stack(layers).contiguous() if keep else None


class _Workspace:
    """int64 buffers by role, allocated at a forward's first layer and reused by the others."""

    def __init__(self) -> None:
        self.bufs: dict[str, "torch.Tensor"] = {}

    def get(self, role: str, shape: tuple[int, int]) -> "torch.Tensor":
        import torch

        buf = self.bufs.get(role)
        if buf is None or buf.numel() < shape[0] * shape[1]:
            buf = self.bufs[role] = torch.empty(shape[0] * shape[1], dtype=torch.int64)
        return buf[: shape[0] * shape[1]].view(shape)


def _block_rest(model: Any, p: str, h: "torch.Tensor", att: "torch.Tensor", eps: float,
                exact: bool, work: _Workspace) -> "torch.Tensor":
    """The layer after attention: output projection, residual, MLP, residual (the fused kernel
    adds each residual into ``h`` in place)."""
    get = model.get
    T, ws_gu = h.shape[0], get(p + "gate_up.ws")
    w8, packed = model.weights(p + "o.w8", 0, exact)
    h = ix.linear(att.reshape(T, -1), w8, get(p + "o.ws"), exact, add=h, packed=packed, out=h)
    w8, packed = model.weights(p + "gate_up.w8", 0, exact)
    norm, table, mlp = get(p + "post_attention_layernorm.weight"), get("portable.silu"), (T, ws_gu.shape[0] // 2)
    if packed is not None and p + "gate_up.w8" in model.silu_packed:  # SiLU x up in the kernel's epilogue
        m = ix.norm_linear(h, norm, eps, None, ws_gu, exact, packed, work.get("mlp", mlp), silu=table)
    else:
        gu = ix.norm_linear(h, norm, eps, w8, ws_gu, exact, packed, work.get("gate_up", (T, ws_gu.shape[0])))
        m = ix.silu_mul(gu, table, exact, work.get("mlp", mlp))
    w8, packed = model.weights(p + "down.w8", 0, exact)
    return ix.linear(m, w8, get(p + "down.ws"), exact, add=h, packed=packed, out=h)


def canary_ids(vocab: int, tokens: int = CANARY_TOKENS) -> np.ndarray:
    """Fixed token ids (no tokenizer needed): a stride through the vocabulary."""
    return (np.arange(tokens, dtype=np.int64) * 7919 + 11) % vocab


def portable_canary(model: Any) -> dict[str, Any]:
    """``{"tokens", "mu_sha256"}`` of the rung's mu of ``canary_ids``: the same on every machine."""
    import hashlib

    tokens = min(CANARY_TOKENS, model.config.max_position_embeddings)
    mu = portable_kv(model, canary_ids(model.config.vocab_size, tokens))
    return {"tokens": tokens, "mu_sha256": hashlib.sha256(bf16_bits(mu.contiguous()).tobytes()).hexdigest()}
