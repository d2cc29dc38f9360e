"""The W8A8 rung's forward pass, for one prompt or a batch of them with the same bits.

A sidecar under load runs many short predictor passes; each pays a fixed cost per
layer (dozens of small ops) whatever its length. ``w8a8_passes`` runs several
prompts as one pass: each prompt's exact head (the target's first k layers) alone,
exactly as ``target.py`` runs it, then every later layer over the prompts' rows
stacked, with attention per prompt::

    h = cat(h_1, ..., h_n)                      # (sum T_r, hidden) BF16
    y = norm_linear(h)                          # per row: quantise, int32 sums, dequantise
    for r: k_r, v_r = rope(y[rows r]); emit; att_r = SDPA(q_r, k_r, v_r)   # per prompt
    h = o(cat(att_r)) + h;  h = down(silu(g) * u) + h                      # per row

A ``w8a8x`` rung's MLP (``_mlp``) takes speckv's SiLU (``silu.py``) instead of torch's, which lets
it run as one native pass per 128 rows on AMX tiles (``coder/kernels/spk_mlp_amx.h``).

Batch invariance (a prompt's mu never depends on what else is in the batch) holds
by construction: every op on stacked rows is row-wise (per-token quantisation, exact
integer sums, elementwise dequantisation, norms over a row), and what mixes tokens
(RoPE tables, attention, the exact head) runs per prompt; tests compare bit for bit.

One prompt's error stays its own: an ``on_layer`` that raises (a transfer that
stopped) ends that prompt only, at once (its exact head stops at that layer, its
rows leave the batch before the next layer). An error of the batch itself (a
non-finite activation) is raised to the caller, who runs the prompts alone to
find whose it is.

NOTE: batch invariance is measured on CPUs, where a reduction over a row (the
RMSNorm's mean of squares) runs the same whatever the row count. On CUDA the
split of a row's sum across threads depends on the row count, so a GPU sidecar
runs one pass per prompt (``Predictor.batches``) until a device check shows otherwise.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from speckv.heap import release_free
from speckv.kv import Fp8Attention, bf16_bits

from . import int8_attention
from . import w8a8 as stages
from .integer import native_with
from .llama import amx_attend, rope, rope_tables
from .mapped import take_rows
from .silu import silu_mul
from .target import FP8_ATTENTION, LayerSink, deterministic_torch
from .w8a8 import W8, WS, ActivationRangeError, Scratch, linear, norm_linear, quantise_rows, scratch_buffer

if TYPE_CHECKING:  # pragma: no cover
    import torch

MLP_ROWS = 1024  # rows of the MLP at a time (_block_rest); the trade-off: benchmarks/mlp_rows.py
TRIM_TOKENS = 512  # from this many tokens on, the heap is trimmed between the exact heads and the later layers


@dataclass
class MuRequest:
    """One prompt of a pass: its ids, where its layers go, how its engine's attention reads FP8."""

    ids: np.ndarray
    on_layer: LayerSink | None = None
    fp8: tuple[Fp8Attention, int] | None = None  # (fa, n): attention of layers < n reads K/V rounded
    keep: bool = True  # keep the layers (the result); False: on_layer has them
    layers: list = field(default_factory=list)  # (2, kv_heads, T, head_dim) BF16 each, when keep
    error: BaseException | None = None

    def deliver(self, i: int, bits: np.ndarray) -> None:
        """Layer i's BF16 bits to ``on_layer``; what it raises becomes this prompt's error and is
        raised again (inside the exact head's forward that ends this prompt's head at once)."""
        if self.error is not None:
            raise self.error
        if self.on_layer is None:
            return
        try:
            self.on_layer(i, bits)
        except Exception as e:  # noqa: BLE001 -- the prompt's own error (e.g. its transfer stopped)
            self.error = e
            raise

    def emit(self, i: int, kv_i: "torch.Tensor") -> None:
        """Layer i of a later layer: to ``on_layer`` (if any) and kept (if asked); a failed prompt's
        error stays on it (the batch goes on without it)."""
        if self.error is not None:
            return
        if self.on_layer is not None:
            with contextlib.suppress(Exception):
                self.deliver(i, bf16_bits(kv_i.contiguous().cpu()))
        if self.keep and self.error is None:
            self.layers.append(kv_i)


def w8a8_kv(model: Any, ids: np.ndarray, on_layer: LayerSink | None = None,
            keep: bool = True) -> "torch.Tensor | None":
    """mu ``(layers, 2, kv_heads, tokens, head_dim)`` BF16 of ``w8a8:k``; ``on_layer`` as in
    ``target.extract_kv`` (an error it raises ends the pass); ``keep=False``: each layer is dropped
    once ``on_layer`` has it, and the result is None."""
    import torch

    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if len(ids) == 0:
        return torch.empty((cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 0, D), dtype=torch.bfloat16)
    fp8 = FP8_ATTENTION.get()
    req = MuRequest(np.asarray(ids), on_layer, fp8, keep)
    w8a8_passes(model, [req])
    if req.error is not None:
        raise req.error
    return torch.stack(req.layers).to(torch.bfloat16).contiguous().cpu() if keep else None


def w8a8_passes(model: Any, reqs: list[MuRequest]) -> None:
    """Every request's mu in one pass (module docstring); each request's layers go to its
    ``on_layer`` as they exist, its error to ``req.error``. Prompts must not be empty."""
    import torch

    cfg = model.config
    L, H, Hk, eps = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, float(cfg.rms_norm_eps)
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    with deterministic_torch():
        heads = [(r, hr) for r in reqs if (hr := _head(model, r)) is not None]  # a failed prompt leaves here
        if not heads:
            return
        if model.head is not None and sum(len(r.ids) for r, _ in heads) >= TRIM_TOKENS:
            release_free()  # NOTE: the heads' freed activations, ~60 MiB at 2048 tokens, leave the peak
        reqs = [r for r, _ in heads]
        h = torch.cat([hr for _, hr in heads]) if len(heads) > 1 else heads[0][1]  # (sum T_r, hidden) BF16
        tables = [rope_tables(cfg, len(hr), h.device) for _, hr in heads]
        del heads
        rows = np.cumsum([0] + [len(r.ids) for r in reqs])
        scratch: Scratch = {}
        for i in range(model.k, L):
            if any(r.error is not None for r in reqs):  # NOTE: rows are independent: drop a failed prompt's
                if all(r.error is not None for r in reqs):
                    return  # no request wants the later layers
                live = [j for j, r in enumerate(reqs) if r.error is None]
                h = torch.cat([h[rows[j]:rows[j + 1]] for j in live])
                reqs, tables = [reqs[j] for j in live], [tables[j] for j in live]
                rows = np.cumsum([0] + [len(r.ids) for r in reqs])
            t = functools.partial(model.t, i)
            last = i == L - 1
            y = norm_linear(h, t, "kv" if last else "qkv", eps, scratch, low_cols=2 * Hk * D if model.kv_low else 0)
            att = []
            for r, (cos, sin), a, b in zip(reqs, tables, rows[:-1], rows[1:], strict=True):
                k0 = 0 if last else H * D  # y's columns: [q,] k, v
                key = _rope(y[a:b], k0, Hk, cos, sin)
                value = y[a:b, k0 + Hk * D:].to(torch.bfloat16).view(b - a, Hk, D).transpose(0, 1)
                r.emit(i, torch.stack([key[0], value]))  # (2, kv_heads, tokens, head_dim)
                if not last:
                    query, replay = _rope(y[a:b], 0, H, cos, sin), None
                    if r.fp8 is not None and i < r.fp8[1]:  # attention reads the engine's K/V
                        key, value = r.fp8[0].round(key, i, 0), r.fp8[0].round(value, i, 1)
                        replay = amx_attend(query, key, value[None], r.fp8[0], i)  # an amx engine's (llama.py)
                    att.append(_attend(query, key, value[None], model.int_attention) if replay is None else replay)
            if att:
                h = _block_rest(h, t, torch.cat(att) if len(att) > 1 else att[0], eps, scratch, model.own_silu)


def _head(model: Any, r: MuRequest) -> "torch.Tensor | None":
    """h after the exact layers (the target's own first k, run on this prompt alone) or the
    embeddings; emits (and keeps) those layers. None when the prompt's ``on_layer`` failed (its
    head stops at that layer)."""
    import torch

    tok = torch.as_tensor(np.asarray(r.ids, dtype=np.int64), device=model.embed.device)
    if model.head is None:
        return take_rows(model.embed, tok)

    def emit(i: int, kv_i: "torch.Tensor") -> None:  # each layer to on_layer as soon as it exists
        r.deliver(i, bf16_bits(kv_i.contiguous().cpu()))

    try:
        h, layers = model.head.run(tok, None if r.on_layer is None else emit, r.fp8)
    except Exception:
        if r.error is None:
            raise  # the forward's own error: the batch's
        return None
    if r.keep:
        r.layers += layers
    return h


# NOTE: the int8 attention is a CPU kernel; on a GPU, sending each layer's q/k/v to it and back made
# the shipped w8a8i:4 cost 8.2x the target's prefill on an H200, torch's attention there 1.3x, both
# deterministic (benchmarks/RESULTS.md "The first GPU run"). A GPU's mu never equals a CPU's (other
# float kernels), so only two GPU sidecars pair, and they agree either way
HOST_INT8_ON_DEVICE = False
NATIVE_ROPE = True  # the extension's fused RoPE on CPUs where it is built (the same bits as torch's ops)


def _rope(y: "torch.Tensor", col0: int, heads: int, cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
    """Columns [col0, col0 + heads * D) of float32 rows y (T, width) -> BF16 (1, heads, T, D) with
    the target's rotary embedding (cos, sin: ``rope_tables``). The result's memory is token-major,
    (T, heads, D), as torch's ops leave it."""
    import torch

    T, D = y.shape[0], cos.shape[-1]
    nat = native_with("w8a8_rope") if NATIVE_ROPE and stages.NATIVE and y.device.type == "cpu" else None
    if nat is not None:
        out = torch.empty((T, heads, D), dtype=torch.bfloat16)
        bits = lambda t: t[0].contiguous().view(torch.int16).numpy()  # noqa: E731 -- (1, T, D) BF16 -> (T, D)
        if nat.w8a8_rope(y.contiguous().numpy(), col0, heads, D, bits(cos), bits(sin), out.view(torch.int16).numpy(),
                         stages.NATIVE_THREADS, stages.NATIVE_SCALAR) == 0:
            return out.view(1, T, heads, D).transpose(1, 2)
        # NOTE: a non-finite input or output: torch's NaN bits, which the kernel does not copy (spk_w8a8.h)
    x = y[:, col0:col0 + heads * D]
    return rope(x.to(torch.bfloat16).view(1, T, heads, D).transpose(1, 2), cos, sin)


def _attend(q: "torch.Tensor", key: "torch.Tensor", value: "torch.Tensor", int8: bool) -> "torch.Tensor":
    """Causal attention of one prompt: (1, heads, T, D) BF16 -> rows (T, heads * D); ``int8``: the
    w8a8i rungs' (int8_attention.py, on the CPU). On a GPU a w8a8i rung runs torch's attention there
    (``HOST_INT8_ON_DEVICE``): its mu is then w8a8:K's, which a GPU's mu is anyway, not the CPU's."""
    import torch.nn.functional as F

    if int8 and (q.device.type == "cpu" or HOST_INT8_ON_DEVICE):
        att = int8_attention.attention(q[0].cpu(), key[0].cpu(), value[0].cpu()).to(q.device)  # (T, heads, D)
        return att.view(q.shape[2], -1)

    att = F.scaled_dot_product_attention(q, key, value, is_causal=True, enable_gqa=True)  # (1, heads, T, D)
    return att[0].transpose(0, 1).reshape(q.shape[2], -1)


def _block_rest(h: "torch.Tensor", t: Callable[[str], "torch.Tensor"], att: "torch.Tensor", eps: float,
                scratch: Scratch, own_silu: bool = False) -> "torch.Tensor":
    """The layer after its attention: o, residual, MLP (``_mlp``), residual; BF16 rows (T, hidden).
    NOTE: the residual stream alternates between two scratch buffers (each update reads the other)."""
    h = linear(*quantise_rows(att, t("in_o")), t("o" + W8), t("o" + WS), add=h, scratch=scratch, name="h.o")
    return _mlp(h, t, eps, scratch, own_silu)


def _silu_mul_torch(y: "torch.Tensor") -> "torch.Tensor":
    """float32 (T, 2n): gate, then up -> torch's silu(gate) * up (the w8a8 and w8a8i rungs')."""
    import torch.nn.functional as F

    g, u = y.chunk(2, dim=1)
    return F.silu(g).mul_(u)


def _mlp(h: "torch.Tensor", t: Callable[[str], "torch.Tensor"], eps: float, scratch: Scratch,
         own_silu: bool = False) -> "torch.Tensor":
    """BF16 rows h (T, hidden) -> h + down(silu(g) * u), g and u = gate_up(norm(h)); ``own_silu``: with
    speckv's SiLU (silu.py, the w8a8x rungs) in place of torch's, which on a CPU with AMX int8 tiles
    runs as one native pass (``spk_mlp_amx.h``). Otherwise ``MLP_ROWS`` rows at a time: every step works
    row by row (the batch invariance above), so the bits are the same either way, and the widest
    activations, (T, 2 * intermediate) float32 and their int32 sums, never exist whole (~55 MiB at 2048
    tokens of the embedded model)."""
    import torch

    q, xs = stages.norm_quantise(h, t, "gate_up", eps)
    w_gu, s_gu, w_d, s_d, f_d = (t(n) for n in ("gate_up" + W8, "gate_up" + WS, "down" + W8, "down" + WS, "in_down"))
    out = scratch_buffer(scratch, "h.down", tuple(h.shape), torch.bfloat16, h.device)  # NOTE: on h's device (a GPU's)
    (T, H), (n, inter) = h.shape, w_d.shape
    nat = stages._native() if own_silu and h.device.type == "cpu" and T else None
    if nat is not None and hasattr(nat, "w8a8_amx_mlp") and stages._amx_fits(nat, H, 2 * inter) \
            and stages._amx_fits(nat, inter, n):
        xs2 = torch.empty(T, dtype=torch.float32)
        c = lambda x: x.contiguous().numpy()  # noqa: E731
        nat.w8a8_amx_mlp(c(q), c(xs), c(w_gu), c(s_gu), c(f_d), c(w_d), c(s_d), c(h.view(torch.int16)),
                         out.view(torch.int16).numpy(), xs2.numpy(), T, inter, H, n, stages.NATIVE_THREADS)
        if not bool(torch.isfinite(xs2).all()):
            raise ActivationRangeError("a non-finite activation reached a w8a8 linear")
        return out
    act = silu_mul if own_silu else _silu_mul_torch
    for a in range(0, T, MLP_ROWS):
        b = min(T, a + MLP_ROWS)
        tag = f"mlp{b - a}"  # NOTE: at most two chunk lengths, so two sets of buffers
        y = linear(q[a:b], xs[a:b], w_gu, s_gu, scratch=scratch, name=tag + ".gate_up")
        out[a:b] = linear(*quantise_rows(act(y), f_d), w_d, s_d, add=h[a:b], scratch=scratch, name=tag + ".down")
    return out
