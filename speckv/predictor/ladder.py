"""The predictor ladder: how much of a model the sidecars run to predict mu.

Rungs (the checkpoint manifest's ``rung`` field, covered by the pin; a
manifest without the field is ``fp8``, so the shipped default keeps its pin):

- ``fp8``: the FP8 (e4m3, fp32 scale per output channel) copy of the target.
- ``hybrid:k``: the target's own first ``k`` decoder layers in BF16 (computed
  exactly as ``target.py`` runs the target: BF16 weights, FP32-accumulating
  linears, the same deterministic settings), then layers ``k..`` of the FP8
  copy, continuing from the BF16 hidden state after layer ``k``. Layers ``< k``
  of mu therefore equal the target's KV bit for bit on the same machine.
  The predictor weights hold those layers' BF16 linears instead of e4m3 ones,
  so the manifest's weight digest covers them. ``hybrid:L`` (L = all layers) is
  the target itself (0 residual, twice the prefill).
- ``portable``: the target's shape computed in integers only (``portable.py``):
  int8 weights (one scale per output channel), 14-bit activations as two int8
  products with exact int32 sums, integer attention and tables for exp, SiLU and
  RoPE; mu is the same bits on every CPU and GPU.
- ``portable:k``: ``portable``'s first ``k`` decoder layers, then, for every later
  layer, only its input norm, K/V projections and RoPE of the hidden state after
  layer ``k - 1``, in the same integers: an early exit from the portable
  rung. Its mu is the same bits on every machine too, so no layer is exact and
  none is fragile when the engine's kernels differ.
- ``w8a8`` / ``w8a8:k``: the FP8 copy's shape (after the target's own first
  ``k`` layers, as in ``hybrid:k``) with every linear one int8 x int8 product
  (``w8a8.py``): int8 weights smoothed by power-of-two channel factors
  calibrated on the target's activations, int8 activations per token.
- ``w8a8i`` / ``w8a8i:k``: ``w8a8[:k]`` with attention in int8 too
  (``int8_attention.py``: per-token int8 q, k and v, uint8 softmax weights,
  exact int32 sums), 2.6-2.7x faster than float32 SDPA here at +0.03-0.04 bits.
- ``w8a8x`` / ``w8a8x:k``: ``w8a8i[:k]`` with speckv's own SiLU (``silu.py``: exp through
  int8_attention's exp2 polynomial, one IEEE operation a step) instead of torch's, so the whole
  MLP runs as one native pass on AMX tiles (``coder/kernels/spk_mlp_amx.h``).
- Any w8a8 rung built now has ``kv_activation_bits: 14`` in its manifest: its K/V projections, whose
  outputs are mu, read 14-bit activations (``w8a8.py``), 0.12-0.16 bits/scalar less for a few
  percent of the pass; a manifest without the field (built before it existed) means 8.
- ``none``: no model: mu is a per-(layer, kv, head, channel) constant, the
  calibration mean of the target's KV rounded to BF16, stored in ``means.npz``.

Nominal cost, in BF16 prefills, counts an FP8 layer as half a BF16 layer (as
on an FP8 tensor-core GPU), and so an int8 one of ``w8a8:k``: ``(k + (L - k) / 2) / L``; ``portable``
1 (two int8 products per linear, as one BF16 product on int8 tensor cores), ``portable:k``
``(k + EXIT_TAIL_COST (L - k)) / L``; ``none`` costs 0.

NOTE: there is no ``early:k`` rung any more (the target's first k BF16 layers, then the same exit):
it coded better than the FP8 copy only through its exact layers, and on another engine's KV, whose
rounding differs, it coded up to 0.81 bits (BF16) and 1.20 bits (FP8) a scalar worse than the FP8
copy (benchmarks/RESULTS.md, "Every rung on every engine"). ``parse_rung`` says so and names the
rungs to use instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from speckv.errors import CheckpointError

from .store import save_npz_stable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .target import Target

FP8, NONE, HYBRID, PORTABLE, W8A8 = "fp8", "none", "hybrid", "portable", "w8a8"
REMOVED_EARLY = "early"  # the early-exit rung, removed (module docstring)
MEANS = "means.npz"  # rung none: the BF16 bit patterns of the per-channel means
MEANS_KEY = "mean_bf16"
KINDS = {FP8: "fp8-copy", HYBRID: "hybrid-bf16-fp8", NONE: "channel-mean",
         PORTABLE: "integer-portable", W8A8: "w8a8-copy"}
_KRUNG_RE = re.compile(r"(hybrid|w8a8i|w8a8x|w8a8|portable):([0-9]{1,4})")
INT_ATTENTION = "w8a8i"  # the w8a8 rungs' spelling with int8 attention
OWN_SILU = "w8a8x"  # ... with int8 attention and speckv's own SiLU
KV_BITS_FIELD = "kv_activation_bits"  # a w8a8 rung's K/V projections' activations, bits:
KV_ACTIVATION_BITS = (8, 14)  # one int8 product, or two (w8a8.py ``norm_linear``'s low_cols)
KV_BITS_SPLIT = KV_ACTIVATION_BITS[1]  # two products: what a w8a8 rung is built with now
# portable:k's later layers run only their input norm and K/V projections: per token 2*h*2*kv of a
# decoder layer's ~2*(h*(q + 2*kv) + q*h + 3*h*i) multiply-adds (SmolLM2-135M: 221,184 of 3,538,944)
EXIT_TAIL_COST = 0.0625
# portable:k skips the last layers - 1 - k layers but their K/V projections. NOTE: measured on the embedded
# model (30 layers; benchmarks/RESULTS.md "Portable early exit portable:k"), each skipped layer costs
# ~0.13 bits a scalar, and an exit skipping more than a fifth of the layers (portable:22 and earlier)
# codes worse than the FP8 copy on every engine (portable:22: +0.147 bits on FP8 KV; portable:20 +0.44)
# for no less cost (predictor_cost 0.37 at portable:20 and portable:23 alike): those are refused.
EXIT_MAX_SKIPPED = 0.2  # of the layers, rounded down


@dataclass(frozen=True)
class Rung:
    """A parsed rung: ``kind`` (fp8, hybrid, w8a8, portable or none); ``bf16_layers`` the k of
    hybrid:k, w8a8:k and portable:k (whose first k layers are integer ones, not BF16);
    ``int_attention``: a w8a8 rung's attention in int8 (``w8a8i``); ``own_silu``: and speckv's SiLU
    (``w8a8x``, which implies ``int_attention``); ``kv_low``: a w8a8 rung's K/V projections read 14-bit
    activations (the manifest's ``kv_activation_bits``; not part of the name)."""

    kind: str
    bf16_layers: int = 0
    int_attention: bool = False
    own_silu: bool = False
    kv_low: bool = False

    def __post_init__(self) -> None:
        if self.kv_low and self.kind != W8A8:
            raise ValueError(f"kv_low is a w8a8 rung's, not {self.kind}'s")
        if self.own_silu and not (self.kind == W8A8 and self.int_attention):
            raise ValueError(f"own_silu is a w8a8 rung with int8 attention (w8a8x), not {self.kind} "
                             f"(int_attention={self.int_attention})")

    @property
    def name(self) -> str:
        k_rung = self.kind == HYBRID or (self.kind in (W8A8, PORTABLE) and self.bf16_layers)
        kind = OWN_SILU if self.own_silu else INT_ATTENTION if self.int_attention else self.kind
        return f"{kind}:{self.bf16_layers}" if k_rung else kind

    @property
    def has_model(self) -> bool:
        return self.kind != NONE

    def nominal_cost(self, layers: int) -> float:
        """Predictor cost in BF16 prefills, an FP8 layer counted as half a BF16 one."""
        if self.kind == NONE:
            return 0.0
        if self.kind == PORTABLE and not self.bf16_layers:
            return 1.0
        tail = EXIT_TAIL_COST if self.kind == PORTABLE else 0.5
        return (self.bf16_layers + tail * (layers - self.bf16_layers)) / layers


def parse_rung(text: Any, layers: int) -> Rung:
    """``fp8``, ``none``, ``portable``, ``w8a8``, ``w8a8i``, ``hybrid:k``, ``w8a8:k``,
    ``w8a8i:k``, ``w8a8x[:k]`` or ``portable:k`` with k in range; else CheckpointError."""
    if text in (FP8, NONE, PORTABLE, W8A8):
        return Rung(text)
    if text in (INT_ATTENTION, OWN_SILU):
        return Rung(W8A8, int_attention=True, own_silu=text == OWN_SILU)
    m = _KRUNG_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None and isinstance(text, str) and text.split(":")[0] == REMOVED_EARLY:
        raise CheckpointError(f"predictor rung {text!r}: the early-exit rungs were removed; on other engines' "
                              "KV they coded worse than fp8 (benchmarks/RESULTS.md, 'Every rung on every "
                              "engine'); use hybrid:K or w8a8x:K for exact first layers, portable:K for a "
                              "cheap exit")
    if m is None:
        raise CheckpointError(f"unknown predictor rung {text!r}: use fp8, hybrid:K, w8a8[:K], "
                              "w8a8i[:K], w8a8x[:K], portable[:K] or none")
    k, top = int(m.group(2)), layers if m.group(1) == HYBRID else layers - 1
    if not 1 <= k <= top or str(k) != m.group(2):
        raise CheckpointError(f"predictor rung {text!r}: K must be a plain integer in 1..{top}")
    if m.group(1) in (INT_ATTENTION, OWN_SILU):
        return Rung(W8A8, k, int_attention=True, own_silu=m.group(1) == OWN_SILU)
    least = layers - 1 - int(EXIT_MAX_SKIPPED * layers)  # the earliest portable exit taken
    if m.group(1) == PORTABLE and k < least:
        raise CheckpointError(f"predictor rung {text!r}: an exit this early codes worse than the fp8 rung on every "
                              f"engine for no less cost (benchmarks/RESULTS.md, 'Portable early exit "
                              f"portable:k'); use portable:{least} or later")
    return Rung(m.group(1), k)


def manifest_rung(manifest: dict[str, Any]) -> Rung:
    """The rung a manifest pins (no ``rung`` field: fp8, the format's first rung; a w8a8 rung without
    ``kv_activation_bits``: 8, as before the field existed)."""
    try:
        layers = int(manifest["arch"]["layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"manifest has no usable arch.layers: {e}") from e
    rung = parse_rung(manifest.get("rung", FP8), layers)
    bits = manifest.get(KV_BITS_FIELD)
    if bits is None:
        return rung
    if rung.kind != W8A8:
        raise CheckpointError(f"manifest {KV_BITS_FIELD} {bits!r}: only for a w8a8 rung, not {rung.name}")
    return with_kv_bits(rung, bits)


def with_kv_bits(rung: Rung, bits: Any) -> Rung:
    """A w8a8 rung whose K/V projections read ``bits``-bit activations (other rungs: as they are);
    bits not in KV_ACTIVATION_BITS: CheckpointError."""
    if isinstance(bits, bool) or bits not in KV_ACTIVATION_BITS:
        raise CheckpointError(f"{KV_BITS_FIELD} {bits!r}: one of {KV_ACTIVATION_BITS}")
    return replace(rung, kv_low=bits == KV_BITS_SPLIT) if rung.kind == W8A8 else rung


def manifest_fields(rung: Rung) -> dict[str, Any]:
    """What a rung adds to (or changes in) the manifest; fp8 adds nothing."""
    out: dict[str, Any] = {"kind": KINDS[rung.kind]}
    if rung.kind != FP8:
        out["rung"] = rung.name
    if rung.kind == W8A8:
        out[KV_BITS_FIELD] = KV_BITS_SPLIT if rung.kv_low else KV_ACTIVATION_BITS[0]
    return out


def weights_quant(rung: Rung) -> str:
    if rung.kind == PORTABLE:
        out = ("int8, float64 scale per output channel (q/k/v and gate/up fused), round half to even; "
               "BF16 norms and embeddings; integer rope, exp and silu tables")
        k = rung.bf16_layers
        return f"{out}; decoder layers >= {k}: only their input norm and K/V projections (k/v fused)" if k else out
    fp8 = "e4m3, fp32 scale per output channel, round to nearest even"
    if rung.kind == W8A8:
        int8 = ("int8 of W * 2^e (e per input channel, smooth.npz), fp32 scale per output channel, round half "
                "to even (q/k/v and gate/up fused); BF16 norms and embeddings")
        if rung.int_attention:
            int8 += "; attention in int8 (per-token q, k, v; uint8 softmax weights per 64 keys)"
        if rung.own_silu:
            int8 += "; speckv's SiLU (exp2 polynomial)"
        if rung.kv_low:
            int8 += "; K/V projections of 14-bit activations (two int8 products)"
        k = rung.bf16_layers
        return f"decoder layers < {k}: the target's BF16 weights; the others {int8}" if k else int8
    if rung.kind == HYBRID:
        return f"decoder layers < {rung.bf16_layers}: the target's BF16 weights; the others {fp8}"
    return fp8


def layer_index(name: str) -> int | None:
    """N of a ``model.layers.N.*`` parameter name (None for other parameters)."""
    if ".layers." not in name:
        return None
    index = name.split(".layers.", 1)[1].split(".", 1)[0]
    return int(index) if index.isdigit() else None


def is_bf16_layer(name: str, rung: Rung) -> bool:
    """Whether a ``model.layers.N.*`` parameter stays BF16 under ``rung``."""
    index = layer_index(name)
    return rung.kind in (HYBRID, W8A8) and index is not None and index < rung.bf16_layers


# ------------------------------------------------------------------ rung none


def kv_means_bf16(kvs: list["torch.Tensor"]) -> np.ndarray:
    """Per-(layer, kv, head, channel) mean of the finite KV scalars, as BF16 bit patterns."""
    import torch

    total, count = 0.0, 0
    for kv in kvs:
        x = kv.double().numpy()
        ok = np.isfinite(x)
        total = total + np.where(ok, x, 0.0).sum(axis=3)
        count = count + ok.sum(axis=3)
    mean = np.where(count > 0, total / np.maximum(count, 1), 0.0)
    return torch.from_numpy(mean).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def save_means(path: Path, bits: np.ndarray) -> None:
    save_npz_stable(path, {MEANS_KEY: np.ascontiguousarray(bits, np.uint16)})


def load_means(path: Path, shape: tuple[int, ...]) -> np.ndarray:
    try:
        with np.load(path, allow_pickle=False) as z:
            bits = z[MEANS_KEY]
    except (OSError, KeyError, ValueError) as e:
        raise CheckpointError(f"bad means file {path}: {e}") from e
    if bits.dtype != np.uint16 or bits.shape != shape:
        raise CheckpointError(f"{path}: means must be uint16 {shape}, not {bits.dtype} {bits.shape}")
    return bits


def mean_model(config: Any, bits: np.ndarray) -> Any:
    """A weightless stand-in for the predictor model: ``mean_kv(tokens)`` broadcasts the means.

    It is a torch Module holding the means as its one (frozen) parameter, so
    ``Predictor.to`` / ``.device`` and ``model.config`` work as for the other rungs.
    """
    import torch

    class MeanKV(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = config
            mean = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
            self.mean = torch.nn.Parameter(mean, requires_grad=False)  # (layers, 2, heads, dim)

        def mean_kv(self, tokens: int) -> "torch.Tensor":
            L, two, H, D = self.mean.shape
            m = self.mean.detach().cpu()[:, :, :, None, :]
            return m.expand(L, two, H, tokens, D).contiguous()

    return MeanKV().eval()


class CachedKV:
    """A target stand-in for ``calibrate``: its KV of each segment, computed once."""

    def __init__(self, target: "Target", kvs: list["torch.Tensor"]) -> None:
        self.config = target.config
        self._kvs = iter(kvs)

    def kv(self, _ids: np.ndarray) -> "torch.Tensor":
        return next(self._kvs)
