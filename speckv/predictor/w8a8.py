"""The W8A8 rung ``w8a8`` / ``w8a8:k``: the FP8 copy's shape with int8 products.

The FP8 copy emulates BF16 in FP32 on a CPU and so costs about a prefill; this
rung runs every decoder linear of layers ``>= k`` as one int8 x int8 product
with exact int32 sums (``torch._int_mm``: oneDNN VNNI on CPUs, int8 tensor
cores on GPUs), which is 4-5x faster than the FP32 product here and, per
weight, more accurate than e4m3 (``benchmarks/RESULTS.md``).

Lifecycle: at build, ``smooth_exponents(target, segments, k)`` runs the target
on the calibration text and picks, per input channel of each fused linear, a
power of two ``2^e`` that moves the activation's outlier channels into the
weights (SmoothQuant, alpha ``SMOOTH_ALPHA``); the exponents are the
checkpoint's ``smooth.npz``. ``w8a8_state(target_state, config, k, smooth)``
derives the int8 weights from the target's BF16 ones and the exponents
(exact IEEE steps only, so a derived checkpoint rebuilds them bit for bit);
``build_w8a8_model`` wraps them; ``w8a8_pass.w8a8_kv(model, ids, on_layer)`` runs::

    layers < k: the target's own, exactly as target.py runs them (hybrid)
    for each layer l >= k, x = h (BF16, the residual stream):
        q8, xs = quantise(x * g * 2^-e)          # per token: amax / 127, round half even
        xs    *= rsqrt(mean(x^2) + eps)           # RMSNorm folds into the row scale
        y      = float(q8 @ w8^T) * xs * ws       # int32 sums, exact; w8 = round(W 2^e / ws)
        q, k, v = y; rope; mu_l = bf16(k), bf16(v)
        # kv_activation_bits 14 (the manifest's; 8 without it): K and V read 14-bit activations,
        #   lo = round((x * g * 2^-e / xs' - q8) * 2^7), k, v += float(lo @ w8^T) * (xs 2^-7) * ws
        h += bf16(o(SDPA(q, k, v)));  h += bf16(down(silu(g) * u)),  g, u = gate_up(norm(h))

On a CPU with AMX int8 tiles, ``linear`` runs the product and the dequantisation in one native pass
(``coder/kernels/spk_w8a8_amx.h``): the int32 sums never go to memory, and integer sums in any order
are the same bits as ``torch._int_mm``'s.

mu is deterministic for one torch build and machine type, like the other float
rungs (only ``portable`` is the same bits everywhere).

NOTE: on a CPU without VNNI, oneDNN multiplies u8 x s8 pairs into saturating
int16 sums (vpmaddubsw), so products of two operands near +-127 can saturate
there: mu stays deterministic per machine type but is then worse, and differs
from a VNNI machine's. ``speckv predictor check`` shows it (ONEDNN_MAX_CPU_ISA=AVX2).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from speckv.errors import CheckpointError

from .integer import int_mm, native_with
from .ladder import layer_index
from .llama import EMBED, exact_head
from .store import SMOOTH_FILE, save_npz_stable
from .target import (
    COMPUTE_THREADS,
    deterministic_torch,
    hooked_forward,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .target import Target

Q_MAX = 127.0  # int8 range of weights and activations, symmetric
LO_SHIFT = 7  # spk_w8a8.h W8A8_LO_SHIFT: a 14-bit activation's low part weighs 2^-7 of its int8 part
SMOOTH_ALPHA = 0.6  # SmoothQuant's migration strength: s = amax_x^a / amax_w^(1 - a)
SMOOTH_LIMIT = 24  # |e| bound: 2^e stays far from float32 under- and overflow
NORMS = ("input_layernorm", "post_attention_layernorm")
# RMSNorm's FP32 mean of squares runs over blocks of this many token rows (two (T, hidden) FP32
# temporaries, 9.4 MB at 2,048 tokens, become a block's). A row's sum does not depend on the rows
# beside it (torch reduces each row alone, blocks of 1 to 4,096 rows checked bit for bit).
NORM_ROWS = 512
FUSED: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
LAST: dict[str, tuple[str, ...]] = {"kv": ("self_attn.k_proj", "self_attn.v_proj")}  # the last layer: K and V only
INPUT_OF = {"qkv": "self_attn.q_proj", "kv": "self_attn.q_proj", "o": "self_attn.o_proj",
            "gate_up": "mlp.gate_proj", "down": "mlp.down_proj"}  # the linear whose input a fused one reads
SMOOTH = ".smooth"  # int8 exponents e per input channel
W8, WS = ".w8", ".ws"  # int8 (out, in) weights, float32 per-output-channel scales


def fused_of(layers: int, i: int) -> dict[str, tuple[str, ...]]:
    return LAST if i == layers - 1 else FUSED


# ------------------------------------------------------------------ build


def smooth_exponents(target: "Target", segments: list[np.ndarray], k: int) -> dict[str, np.ndarray]:
    """Per fused linear of layers >= k: int8 e with 2^e ~ amax_x^a / amax_w^(1-a) per input channel,
    amax_x over the target's activations on ``segments`` (the calibration text)."""
    import torch

    L = target.config.num_hidden_layers
    amax: dict[str, torch.Tensor] = {}
    mods = dict(target.model.named_modules())

    def hook(name: str) -> Callable[..., None]:
        def pre(_m: Any, args: tuple) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs().amax(0)
            amax[name] = torch.maximum(amax[name], x) if name in amax else x
        return pre

    with deterministic_torch():
        handles = [mods[f"model.layers.{i}.{INPUT_OF[f]}"].register_forward_pre_hook(hook(f"{i}.{f}"))
                   for i in range(k, L) for f in fused_of(L, i)]
        try:
            for seg in segments:
                hooked_forward(target.model, seg, None)
        finally:
            for h in handles:
                h.remove()
    out = {}
    for i in range(k, L):
        for f, parts in fused_of(L, i).items():
            w = torch.cat([target.state[f"model.layers.{i}.{p}.weight"] for p in parts]).float()
            wmax = w.abs().amax(0).clamp_min(1e-30).double()
            xmax = amax[f"{i}.{f}"].double().clamp_min(1e-30)
            e = torch.round(SMOOTH_ALPHA * torch.log2(xmax) - (1 - SMOOTH_ALPHA) * torch.log2(wmax))
            out[f"model.layers.{i}.{f}{SMOOTH}"] = e.clamp(-SMOOTH_LIMIT, SMOOTH_LIMIT).to(torch.int8).numpy()
    return out


def save_smooth(ckpt_dir: Path, smooth: dict[str, np.ndarray]) -> None:
    save_npz_stable(ckpt_dir / SMOOTH_FILE, smooth)


def load_smooth(ckpt_dir: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(ckpt_dir / SMOOTH_FILE, allow_pickle=False) as z:
            out = {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"bad smoothing file {ckpt_dir / SMOOTH_FILE}: {e}") from e
    if any(v.dtype != np.int8 or v.ndim != 1 for v in out.values()):
        raise CheckpointError(f"{ckpt_dir / SMOOTH_FILE}: exponents must be 1-d int8 arrays")
    return out


def quantise_weight(w: "torch.Tensor", e: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """(out, in) weight, int8 exponents (in,) -> int8 round(W 2^e / ws), float32 ws = amax_row / 127.
    Exact IEEE steps (a power-of-two product, a max, one division each), so any machine derives them."""
    import torch

    ws_in = w.float() * torch.exp2(e.float())[None, :]
    amax = ws_in.abs().amax(1)
    ws = torch.where(amax > 0, amax / Q_MAX, torch.ones_like(amax))
    return torch.round(ws_in / ws[:, None]).clamp(-Q_MAX, Q_MAX).to(torch.int8).contiguous(), ws


def w8a8_state(target_state: Mapping[str, "torch.Tensor"], config: Any, k: int,
               smooth: dict[str, np.ndarray]) -> dict[str, "torch.Tensor"]:
    """The target's BF16 tensors of layers < k, then per later layer its norms and fused int8 linears
    (with their smoothing exponents), and the embeddings."""
    import torch

    L = config.num_hidden_layers
    embed = target_state.mapped(EMBED) if hasattr(target_state, "mapped") else None  # weights.TargetWeights
    out = {EMBED: embed if embed is not None else target_state[EMBED].detach().clone()}  # mapped: rows on demand
    for name in target_state:  # NOTE: by name: a lazy mapping (weights.TargetWeights) reads only these
        index = layer_index(name)
        if index is not None and index < k:
            out[name] = target_state[name].detach().clone()
    for i in range(k, L):
        p = f"model.layers.{i}."
        for norm in NORMS[:1] if i == L - 1 else NORMS:
            out[p + norm + ".weight"] = target_state[p + norm + ".weight"].detach().clone()
        for f, parts in fused_of(L, i).items():
            key = p + f + SMOOTH
            if key not in smooth:
                raise CheckpointError(f"w8a8 smoothing exponents lack {key}")
            e = torch.from_numpy(np.asarray(smooth[key], np.int8).copy())
            w = torch.cat([target_state[p + part + ".weight"] for part in parts])
            if e.shape != (w.shape[1],):
                raise CheckpointError(f"{key}: {tuple(e.shape)} exponents for {w.shape[1]} input channels")
            out[p + f + W8], out[p + f + WS] = quantise_weight(w, e)
            out[key] = e
    return out


# ------------------------------------------------------------------ model


@functools.cache
def _module_class() -> type:
    """W8A8KV, made on first use (``import speckv`` never imports torch)."""
    import torch

    class W8A8KV(torch.nn.Module):
        """The exact head (layers < k, or None), the embeddings, and per later layer its tensors:
        ``t[(i, name)]`` with the smoothing folded into per-channel input factors ``in_<fused>``."""

        rung_kind = "w8a8"  # predict.rung_pass dispatches on it

        def __init__(self, config: Any, head: Any, embed: "torch.Tensor", tensors: dict) -> None:
            super().__init__()
            self.config, self.head, self.k = config, head, config.num_hidden_layers - len(tensors)
            self.embed = torch.nn.Parameter(embed, requires_grad=False)
            self.slots = {(i, n): f"t{j}" for j, (i, n) in enumerate(
                (i, n) for i in sorted(tensors) for n in sorted(tensors[i]))}
            for (i, n), slot in self.slots.items():
                self.register_buffer(slot, tensors[i][n], persistent=False)

        def t(self, i: int, name: str) -> "torch.Tensor":
            return getattr(self, self.slots[(i, name)])

    return W8A8KV


def build_w8a8_model(config: Any, state: dict[str, "torch.Tensor"], k: int, int_attention: bool = False,
                     own_silu: bool = False, kv_low: bool = False) -> Any:
    """``w8a8:k`` (``int_attention``: ``w8a8i:k``; with ``own_silu`` too: ``w8a8x:k``) over ``w8a8_state``'s
    tensors for a model of ``config``; ``kv_low``: its K/V projections read 14-bit activations."""
    import torch

    L = config.num_hidden_layers
    head = exact_head(config, state, k, f"w8a8:{k}") if k else None
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for i in range(k, L):
            p, t = f"model.layers.{i}.", {}
            fused = fused_of(L, i)
            for norm in NORMS[:1] if i == L - 1 else NORMS:
                t[norm] = state[p + norm + ".weight"].float()
            for f in fused:
                t[f + W8], t[f + WS] = state[p + f + W8], state[p + f + WS].float()
                factor = torch.exp2(-state[p + f + SMOOTH].float())  # exact: a power of two
                gain = {"qkv": NORMS[0], "kv": NORMS[0], "gate_up": NORMS[1]}.get(f)
                t["in_" + f] = factor * t[gain] if gain else factor  # the norm's gain, then 2^-e
            tensors[i] = t
        embed = state[EMBED]
    except KeyError as e:
        raise CheckpointError(f"w8a8:{k} weights lack {e}") from e
    want = 1 + sum(1 for n in state if (layer_index(n) or 0) < k and n != EMBED)
    want += sum(len(NORMS[:1] if i == L - 1 else NORMS) + 3 * len(fused_of(L, i)) for i in range(k, L))
    if len(state) != want:
        raise CheckpointError(f"w8a8:{k} weights do not fit the config: {len(state)} tensors, {want} expected")
    model = _module_class()(config, head, embed, tensors).eval()
    model.int_attention, model.own_silu, model.kv_low = int_attention, own_silu, kv_low
    return model


# ------------------------------------------------------------------ forward


class ActivationRangeError(ValueError):
    """A non-finite activation reached a W8A8 linear (not expected for real text)."""


NATIVE = True  # the native extension's stages where it is built (the same bits either way)
NATIVE_THREADS = COMPUTE_THREADS
NATIVE_SCALAR = False  # the extension's scalar loops instead of its vector ones (tests: the same bits)
NATIVE_NO_AVX512 = False  # the row quantisation's AVX2 loop where the CPU has AVX-512 (tests: the same bits)
NATIVE_AMX = True  # linear on AMX tiles where granted (spk_w8a8_amx.h; tests: the same bits as int_mm + dequant)


def _native() -> Any:
    return native_with("w8a8_quantise") if NATIVE else None


def _amx_fits(nat: Any, k: int, n: int) -> bool:
    """Whether ``linear`` runs on AMX tiles here (``NATIVE_AMX``, an extension with the kernel, AMX
    int8 granted, an inner size k and a width n the kernel takes: ``spk_w8a8_amx.h``)."""
    return (NATIVE_AMX and not NATIVE_SCALAR and hasattr(nat, "w8a8_amx_linear") and _amx_ready(nat)
            and bool(nat.w8a8_amx_fits(k, n)))


@functools.cache
def _amx_ready(nat: Any) -> bool:
    return bool(nat.w8a8_amx_ready())


def quantise_rows(x: "torch.Tensor", factor: "torch.Tensor",
                  native: bool = True) -> tuple["torch.Tensor", "torch.Tensor"]:
    """float32 or BF16 rows x (T, in) times float32 ``factor`` (in,) -> int8 round(y * 127 / amax),
    float32 amax / 127 per row (``spk_w8a8.h``: the same operations in one pass)."""
    q, xs, _ = _quantise(x, factor, native, False)
    return q, xs


def quantise_rows_split(x: "torch.Tensor", factor: "torch.Tensor",
                        native: bool = True) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """``quantise_rows`` and each element's low part, int8 round((y * 127 / amax - q) * 2^LO_SHIFT): the
    14-bit activation q + lo * 2^-LO_SHIFT (``spk_w8a8.h``: in the same pass as q)."""
    q, xs, lo = _quantise(x, factor, native, True)
    assert lo is not None
    return q, xs, lo


def _quantise(x: "torch.Tensor", factor: "torch.Tensor", native: bool,
              low: bool) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor | None"]:
    import torch

    nat = _native() if native else None
    lo = None
    if nat is None or x.device.type != "cpu":
        y = x.float() * factor
        amax = y.abs().amax(1)
        # NOTE: a true division: ``Q_MAX / amax`` is reciprocal-then-multiply in torch (another rounding)
        inv = torch.where(amax > 0, torch.full_like(amax, Q_MAX) / amax, torch.zeros_like(amax))
        t = y * inv[:, None]
        q, xs = torch.round(t), amax / Q_MAX
        if low:  # NOTE: t - q is exact (a float less its nearest integer), and so is the scaling
            lo = torch.round((t - q) * float(1 << LO_SHIFT)).to(torch.int8)
        q = q.to(torch.int8)
    else:
        x = x.contiguous()
        q, xs = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[0], dtype=torch.float32)
        lo = torch.empty(x.shape, dtype=torch.int8) if low else None
        bf16 = x.dtype == torch.bfloat16
        nat.w8a8_quantise((x.view(torch.int16) if bf16 else x.float()).numpy(), bf16, factor.contiguous().numpy(),
                          q.numpy(), xs.numpy(), NATIVE_THREADS, NATIVE_SCALAR, NATIVE_NO_AVX512,
                          None if lo is None else lo.numpy())
    if not bool(torch.isfinite(xs).all()):
        raise ActivationRangeError("a non-finite activation reached a w8a8 linear")
    return q, xs, lo


Scratch = dict  # name -> a buffer reused by every layer of one forward (fresh large buffers page-fault)


def scratch_buffer(scratch: Scratch | None, name: str, shape: tuple[int, ...], dtype: Any,
                   device: Any = "cpu") -> "torch.Tensor":
    import torch

    if scratch is None:
        return torch.empty(shape, dtype=dtype, device=device)
    b = scratch.get(name)
    if b is None or b.shape != shape or b.dtype != dtype or b.device != torch.device(device):
        b = scratch[name] = torch.empty(shape, dtype=dtype, device=device)
    return b


def linear(q: "torch.Tensor", xs: "torch.Tensor", w8: "torch.Tensor", ws: "torch.Tensor",
           add: "torch.Tensor | None" = None, native: bool = True, scratch: Scratch | None = None,
           name: str = "") -> "torch.Tensor":
    """float32 (T, out) = float(q @ w8^T) * xs * ws (int32 sums, exact: |q|, |w8| <= 127), or with
    BF16 ``add``: BF16 ``add + bf16(that)``, the residual stream's update. With ``scratch``, the result
    is the buffer ``name`` there (NOTE: valid until the next call with that name)."""
    import torch

    nat = _native() if native else None
    if nat is None or q.device.type != "cpu":
        y = int_mm(q, w8).float() * xs[:, None] * ws
        return y if add is None else add + y.to(torch.bfloat16)
    shape = (q.shape[0], w8.shape[0])
    out = scratch_buffer(scratch, name, shape, torch.float32 if add is None else torch.bfloat16)
    residual = None if add is None else add.contiguous().view(torch.int16).numpy()
    target = out.numpy() if add is None else out.view(torch.int16).numpy()
    if q.shape[0] and _amx_fits(nat, q.shape[1], w8.shape[0]):  # product and dequantisation in one pass
        if q.dtype != torch.int8 or w8.dtype != torch.int8 or q.shape[1] != w8.shape[1] or xs.shape != q.shape[:1] \
                or ws.shape != w8.shape[:1]:
            raise ValueError(f"linear: int8 {tuple(q.shape)} {q.dtype} rows (scales {tuple(xs.shape)}) by int8 "
                             f"{tuple(w8.shape)} {w8.dtype} weights (scales {tuple(ws.shape)})")
        nat.w8a8_amx_linear(q.contiguous().numpy(), xs.contiguous().numpy(), w8.contiguous().numpy(),
                            ws.contiguous().numpy(), residual, target, *shape, q.shape[1], NATIVE_THREADS)
        return out
    acc = int_mm(q, w8, out=scratch_buffer(scratch, name + ".acc", shape, torch.int32))
    nat.w8a8_dequant(acc.numpy(), xs.numpy(), ws.contiguous().numpy(), residual, target, NATIVE_THREADS, NATIVE_SCALAR)
    return out


def norm_quantise(h: "torch.Tensor", t: Callable[[str], "torch.Tensor"], f: str,
                  eps: float) -> tuple["torch.Tensor", "torch.Tensor"]:
    """RMSNorm (its gain and 2^-e in ``in_f``) of BF16 rows h (T, hidden), as linear ``f``'s int8 rows
    and their scales."""
    q, xs, _ = _norm_quantise(h, t, f, eps, False)
    return q, xs


def _norm_quantise(h: "torch.Tensor", t: Callable[[str], "torch.Tensor"], f: str, eps: float,
                   low: bool) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor | None"]:
    """``norm_quantise`` (``low``: and the rows' low parts, as ``quantise_rows_split``)."""
    import torch

    q, xs, lo = _quantise(h, t("in_" + f), True, low)
    for a in range(0, h.shape[0], NORM_ROWS):  # NOTE: the norm's per-row factor cancels in q
        xs[a:a + NORM_ROWS] *= torch.rsqrt(h[a:a + NORM_ROWS].float().pow(2).mean(1) + eps)
    return q, xs, lo


def norm_linear(h: "torch.Tensor", t: Callable[[str], "torch.Tensor"], f: str, eps: float,
                scratch: Scratch | None = None, tag: str = "", low_cols: int = 0) -> "torch.Tensor":
    """RMSNorm (its gain and 2^-e in ``in_f``) then fused linear ``f`` of BF16 rows h (T, hidden);
    the result is scratch buffer ``tag + f``. ``low_cols``: its last that many columns (a layer's K
    and V) read 14-bit activations: y += float(lo @ w8^T) * (xs * 2^-LO_SHIFT) * ws over them."""
    if not low_cols:
        return linear(*norm_quantise(h, t, f, eps), t(f + W8), t(f + WS), scratch=scratch, name=tag + f)
    q, xs, lo = _norm_quantise(h, t, f, eps, True)
    assert lo is not None
    w8, ws = t(f + W8), t(f + WS)
    y = linear(q, xs, w8, ws, scratch=scratch, name=tag + f)
    c = w8.shape[0] - low_cols
    # NOTE: xs * 2^-7 is exact for normal xs, and the sum one IEEE add (no alpha: torch may fuse that)
    y[:, c:] += linear(lo, xs * (1.0 / (1 << LO_SHIFT)), w8[c:], ws[c:], scratch=scratch, name=tag + f + ".lo")
    return y
