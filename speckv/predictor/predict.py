"""Running the predictor: prompt token ids -> mu, bit-identical on both sidecars.

Lifecycle: ``Predictor.from_checkpoint(ckpt)`` builds the checkpoint's rung
of the predictor ladder (``ladder.py``): the FP8 copy, or the hybrid whose
first k layers are the target's BF16 ones (reading ``weights.safetensors``, or
deriving the weights from the embedded target and checking their digest
against the manifest), or, for rung none, the stored per-channel means;
``Predictor.mu(ids)`` returns the predicted KV
``(layers, 2, kv_heads, tokens, head_dim)`` in BF16.

Determinism: the linears compute ``bf16(x_f32 @ (e4m3 * scale)^T)`` (the FP8
weights dequantised exactly into FP32; FP8 matmul where available is a later
GPU path), attention is torch SDPA in BF16, one fixed thread count and
``torch.use_deterministic_algorithms`` (``target.deterministic_torch``), and
the prompt is always run whole (one fixed shape per prompt; a batched pass,
``stream_batch``, runs only ops whose every row is computed as in the prompt's
own pass), so two processes with the same torch build compute the same bits.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from speckv.errors import CheckpointError, PinMismatchError
from speckv.kv import Fp8Attention

from .checkpoint import Checkpoint, fp8_state
from .fp8 import dequantize_e4m3
from .fp32_linear import LINEAR_NAMES, replace_linears
from .ladder import MEANS, PORTABLE, W8A8, Rung, load_means, mean_model
from .llama import load_config
from .portable import build_portable_model, canary_ids, portable_canary, portable_pass, portable_state
from .store import CONFIG, FP8_SUFFIX, SCALE_SUFFIX, WEIGHTS, state_digest
from .target import LayerSink, emit_all, extract_kv, load_target, reading_fp8
from .w8a8 import build_w8a8_model, load_smooth, w8a8_state
from .w8a8_pass import MuRequest, w8a8_kv, w8a8_passes
from .weights import TargetWeights, derivation_source

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .target import Target

logger = logging.getLogger(__name__)
SELF_CHECK_TOKENS = 64  # the prompt of a sidecar's load-time self-check (two passes: ~0.2 s here)
MuPrompt = tuple  # (ids, on_layer, fp8_attention | None): one prompt of ``Predictor.stream_batch``


def rung_state(target_state: Mapping[str, "torch.Tensor"], rung: Rung, config: Any = None,
               smooth: dict[str, np.ndarray] | None = None) -> dict[str, "torch.Tensor"]:
    """The weights ``rung`` computes with, from the target's (fp8, hybrid:k, portable:
    which needs the target's ``config`` for its tables; w8a8:k: and the smoothing exponents)."""
    if rung.kind == PORTABLE:
        return portable_state(target_state, config, rung.bf16_layers)
    if rung.kind == W8A8:
        if smooth is None:
            raise CheckpointError("a w8a8 checkpoint needs its smoothing exponents (smooth.npz)")
        return w8a8_state(target_state, config, rung.bf16_layers, smooth)
    return fp8_state(target_state, rung)


def build_model(config: Any, state: dict[str, "torch.Tensor"], rung: Rung | None = None) -> Any:
    """The rung's model over ``state``: for fp8 and hybrid:k an emulated-BF16 causal LM
    whose linears use the FP8 weights in ``state`` (a linear with BF16 weights in
    ``state`` instead, the first layers of a ``hybrid:k`` rung, runs exactly as
    ``target.load_target`` runs it); for portable[:k] and w8a8[:k] their own models.
    """
    import torch

    if rung is not None and rung.kind == PORTABLE:
        return build_portable_model(config, state, rung.bf16_layers)
    if rung is not None and rung.kind == W8A8:
        return build_w8a8_model(config, state, rung.bf16_layers, rung.int_attention, rung.own_silu, rung.kv_low)

    from transformers import AutoModelForCausalLM  # NOTE: here: the rungs above need none of transformers

    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain = {k: v for k, v in state.items() if not k.endswith((FP8_SUFFIX, SCALE_SUFFIX))}
    missing, unexpected = model.load_state_dict(plain, strict=False)
    missing = [m for m in missing if not m.endswith(".weight") or m.rsplit(".", 2)[-2] not in LINEAR_NAMES]
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise CheckpointError(f"predictor weights do not fit the config: missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]}")

    def fp8_weight(name: str, w: "torch.Tensor") -> "torch.Tensor":
        if name + FP8_SUFFIX in state:
            q, s = state[name + FP8_SUFFIX], state[name + SCALE_SUFFIX]
            return dequantize_e4m3(q, s[:, None])
        if name + ".weight" not in state:
            raise CheckpointError(f"predictor weights have neither FP8 nor BF16 weights for {name}")
        return w.float()  # w was loaded from state: the target's BF16 weight, as the target runs it

    replace_linears(model, fp8_weight)
    model.eval()
    return model


class Predictor:
    """The checkpoint's predictor rung (FP8 copy, hybrid or channel means), as pinned."""

    def __init__(self, checkpoint: Checkpoint, model: Any) -> None:
        self.checkpoint = checkpoint
        self.model = model

    @property
    def pin(self) -> str:
        return self.checkpoint.pin

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, target: "Target | TargetWeights | None" = None) -> "Predictor":
        """Build the checkpoint's rung; derived weights need the (embedded) target, whole or as
        ``weights.TargetWeights`` (read lazily: a sidecar never builds the target)."""
        rung = ckpt.rung
        config = load_config(ckpt.path / CONFIG, light=rung.kind == W8A8)
        if not rung.has_model:
            arch = ckpt.manifest["arch"]
            shape = (arch["layers"], 2, arch["kv_heads"], arch["head_dim"])
            return cls(ckpt, mean_model(config, load_means(ckpt.path / MEANS, shape)))
        if ckpt.derived_weights:
            state = _derive_state(ckpt, target)
        else:
            from safetensors.torch import load_file

            state = load_file(str(ckpt.path / WEIGHTS))
        got = state_digest(state)
        if got != ckpt.manifest["weights"]["sha256"]:
            raise PinMismatchError(f"predictor weights digest {got} does not match the manifest's "
                                   f"{ckpt.manifest['weights']['sha256']}")
        return cls(ckpt, build_model(config, state, rung))

    @property
    def device(self) -> str:
        return str(next(self.model.parameters()).device)

    def to(self, device: str) -> "Predictor":
        """Run the predictor on ``device``: ``cpu``, ``cuda[:N]`` or ``auto`` (cuda when
        torch sees one). Same math on every device (BF16 activations, FP32-accumulated
        linears with the dequantised FP8 weights, TF32 off, deterministic algorithms);
        see README "GPU path" for when two machines reproduce mu bit for bit."""
        import os

        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise CheckpointError(f"predictor device {device!r} requested but torch sees no CUDA device")
            # NOTE: deterministic cuBLAS needs this before the first CUDA matmul
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        elif device != "cpu":
            raise ValueError(f"predictor device must be cpu, cuda[:N] or auto, not {device!r}")
        self.model.to(device)
        return self

    def canary_ok(self) -> bool | None:
        """Whether this machine computes the manifest's canary mu bit for bit (the portable rung
        records one; None for checkpoints without a canary). A False here means mu would differ
        from other machines': ``speckv predictor check`` shows which environment."""
        want = self.checkpoint.manifest.get("canary")
        if not want or not hasattr(self.model, "names"):
            return None
        got = portable_canary(self.model)
        if got != want:
            logger.error("predictor %s: canary mu %s differs from the checkpoint's %s on this machine",
                         self.pin[:12], got["mu_sha256"][:16], str(want.get("mu_sha256"))[:16])
            return False
        return True

    def self_check(self, tokens: int = SELF_CHECK_TOKENS) -> bool:
        """Passes of a fixed prompt (``canary_ids``), each on a fresh thread as a sidecar's passes
        run, compared bit for bit. A sidecar runs it at load: the lazy set-up of a process's first pass
        (thread pools, kernel dispatch, the weights' first page faults) then happens before any
        transfer, and a predictor that computes two mu for one prompt is named before it serves.
        NOTE: where the first two passes differ, a third decides: if it agrees with the second, the
        first pass was the set-up's (RESULTS.md, "A first pass that computed another mu" and "The first
        cos of a process"), logged as
        a warning, and the check passes; else the error names the layers and the check fails."""
        ids = canary_ids(int(self.model.config.vocab_size), tokens)
        runs = [self._check_pass(ids), self._check_pass(ids)]
        if runs[0] == runs[1]:
            return True
        runs.append(self._check_pass(ids))
        if runs[1] == runs[2]:
            logger.warning("predictor %s: its first pass at load computed another mu (layers %s of %d tokens); "
                           "the next two agree", self.pin[:12], _differ(runs[0], runs[1]), tokens)
            return True
        logger.error("predictor %s computed two different mu for one prompt at load (layers %s of %d tokens "
                     "differ between two passes)", self.pin[:12], _differ(runs[1], runs[2]), tokens)
        return False

    def _check_pass(self, ids: np.ndarray) -> list[bytes]:
        """One self-check pass on a fresh thread: each layer's digest."""
        import threading

        from speckv.digests import XXH3_128, digest

        layers: list[bytes] = []
        worker = threading.Thread(target=self.stream, name="speckv-self-check",
                                  args=(ids, lambda i, bits: layers.append(digest(bits, algorithm=XXH3_128))))
        worker.start()
        worker.join()
        want = self.checkpoint.manifest["arch"]["layers"]
        if len(layers) != want:  # NOTE: a pass that failed on its thread left fewer
            raise RuntimeError(f"a self-check pass produced {len(layers)} of {want} layers")
        return layers

    def stream(self, ids: np.ndarray, on_layer: "LayerSink",
               fp8_attention: "Fp8Attention | None" = None) -> None:
        """``mu`` for a caller that takes every layer from ``on_layer`` (a sidecar's LayerMu): a
        rung that can (``w8a8:K``, ``portable[:K]``) keeps no layer once ``on_layer`` has it, which saves the whole
        mu twice over (the layers and their stack) at the sidecar's peak."""
        self._pass(ids, on_layer, fp8_attention, keep=False)

    def mu(self, ids: np.ndarray, on_layer: "LayerSink | None" = None,
           fp8_attention: "Fp8Attention | None" = None) -> "torch.Tensor":
        """Predicted KV ``(layers, 2, kv_heads, tokens, head_dim)`` BF16; ``on_layer(i, bits)``
        (optional) gets each layer's BF16 bits as soon as it exists (see ``extract_kv``).
        ``fp8_attention``: the engine's attention reads its FP8 cache so; the attention of this
        pass then reads its K/V rounded the same way: in the layers this rung computes exactly (the
        target's own first K of ``hybrid:K``, ``w8a8:K``), whose mu is then the
        engine's rounded value itself, and, for rounding toward zero, in every layer (whose mu
        stays unrounded: an approximate value tells the coder more than its rounding).
        NOTE: rounding toward zero shrinks every K/V by half a step on average, a bias every later
        layer inherits and a predictor follows; rounding to nearest is unbiased noise that an
        approximate layer, whose own K/V differ from the engine's, cannot follow (rounding them
        costs more than it wins: benchmarks/RESULTS.md, "FP8 caches that attention reads").
        Rung ``portable``'s integer attention ignores it."""
        mu = self._pass(ids, on_layer, fp8_attention, keep=True)
        assert mu is not None
        return mu

    @property
    def batches(self) -> bool:
        """Whether ``stream_batch`` runs several prompts as one pass: rung ``w8a8:K`` on a CPU
        (NOTE: on CUDA a row's reduction may split by the row count, see ``w8a8_pass``)."""
        return self.checkpoint.rung.kind == W8A8 and self.device == "cpu"

    def stream_batch(self, reqs: "list[MuPrompt]") -> list[BaseException | None]:
        """``stream`` of several (ids, on_layer, fp8_attention) at once: one pass where the rung
        batches (``w8a8_pass``: each prompt's mu bit for bit its ``stream`` alone), else one by one.
        Each prompt's error (its ``on_layer``'s, or its pass's) is its own, returned in order. When
        the batched pass itself fails (a non-finite activation), the prompts still without an error
        run alone, so only the one it came from fails (a layer it already had arrives again: the
        same bits)."""
        errors: list[BaseException | None] = [None] * len(reqs)
        if self.batches and len(reqs) > 1 and all(len(ids) for ids, _, _ in reqs):
            batch: list[MuRequest] = []
            try:
                batch = [MuRequest(np.asarray(ids), self._sink(on_layer, fa), self._reading(fa), keep=False)
                         for ids, on_layer, fa in reqs]
                w8a8_passes(self.model, batch)
                return [r.error for r in batch]
            except Exception as e:  # noqa: BLE001 -- the batch's own: find whose, alone
                logger.warning("a batched predictor pass of %d prompts failed (%s); running them one by one",
                               len(reqs), e)
                errors = [r.error for r in batch] or errors
        for k, (ids, on_layer, fa) in enumerate(reqs):
            if errors[k] is not None:
                continue  # its own error came first
            try:
                self.stream(ids, on_layer, fa)
            except Exception as e:  # noqa: BLE001 -- this prompt's alone
                errors[k] = e
        return errors

    def _exact(self, fa: "Fp8Attention | None") -> int:
        """The layers whose mu is the engine's rounded value under ``fa`` (this rung's exact ones)."""
        layers = self.checkpoint.manifest["arch"]["layers"]
        if fa is not None and len(fa.k_scales) != layers:
            raise ValueError(f"fp8_attention has {len(fa.k_scales)} layers' scales, the model {layers}")
        return self.checkpoint.rung.bf16_layers if fa is not None else 0

    def _reading(self, fa: "Fp8Attention | None") -> "tuple[Fp8Attention, int] | None":
        """(fa, n): the attention of layers < n reads its K/V rounded (``Predictor.mu``)."""
        n = self.checkpoint.manifest["arch"]["layers"] if fa is not None and fa.toward_zero else self._exact(fa)
        return None if fa is None or n <= 0 else (fa, n)

    def _sink(self, on_layer: "LayerSink", fa: "Fp8Attention | None") -> "LayerSink":
        exact = self._exact(fa)
        return on_layer if fa is None or not exact else rounded_sink(on_layer, fa, exact)

    def _pass(self, ids: np.ndarray, on_layer: "LayerSink | None", fp8_attention: "Fp8Attention | None",
              keep: bool) -> "torch.Tensor | None":
        exact = self._exact(fp8_attention)
        fa_n = self._reading(fp8_attention)
        with reading_fp8(*(fa_n or (None, 0))):
            sink = None if on_layer is None else self._sink(on_layer, fp8_attention)
            mu = rung_pass(self.model, ids, sink, keep)
        if mu is None or not keep or not exact:
            return mu if keep else None
        assert fp8_attention is not None
        import torch

        for i in range(exact):  # NOTE: the same rounding rounded_sink applied to what on_layer got
            mu[i] = torch.stack([fp8_attention.round(mu[i, j], i, j) for j in (0, 1)])
        return mu


def rounded_sink(on_layer: "LayerSink", fa: "Fp8Attention", exact: int) -> "LayerSink":
    """``on_layer`` given layers < ``exact`` rounded as the engine stores them (``fa``)."""
    import torch

    def sink(i: int, bits: np.ndarray) -> None:
        if i < exact:
            t = torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
            t = torch.stack([fa.round(t[j], i, j) for j in (0, 1)])
            bits = t.view(torch.int16).numpy().view(np.uint16)
        on_layer(i, bits)
    return sink


def predictor_kv(model: Any, ids: np.ndarray, on_layer: "LayerSink | None" = None) -> "torch.Tensor":
    """mu of any rung's model (``build_model``, ``ladder.mean_model``) for ``ids``."""
    mu = rung_pass(model, ids, on_layer, keep=True)
    assert mu is not None
    return mu


def _differ(a: list[bytes], b: list[bytes]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def rung_pass(model: Any, ids: np.ndarray, on_layer: "LayerSink | None", keep: bool) -> "torch.Tensor | None":
    """``predictor_kv``; ``keep=False``: as ``Predictor.stream`` (the rungs that cannot drop their
    layers return them anyway)."""
    if hasattr(model, "mean_kv"):  # rung none: every layer at once
        mu = model.mean_kv(len(ids))
        emit_all(mu, on_layer)
        return mu
    if hasattr(model, "names"):  # portable, portable:k
        return portable_pass(model, ids, on_layer, keep=keep)
    if getattr(model, "rung_kind", None) == "w8a8":  # w8a8:k
        return w8a8_kv(model, ids, on_layer, keep)
    return extract_kv(model, ids, on_layer)


def _derive_state(ckpt: Checkpoint, target: "Target | TargetWeights | None") -> dict[str, "torch.Tensor"]:
    want = ckpt.manifest["target"]
    if target is None:
        if want.get("source") != "embedded":
            raise CheckpointError("checkpoint derives its weights from a target that is not embedded; "
                                  "pass the target model")
        target = derivation_source()
    if isinstance(target, TargetWeights) and target.weights_sha256 != want["weights_sha256"]:
        # NOTE: files may name other tensors than the loaded model's state_dict (renamed keys, extra
        # buffers): then the whole target, as the checkpoint was built from it, decides
        logger.info("target %s: its files' digest differs from its state_dict's; loading it whole", target.path)
        target = load_target(target.spec)
    if target.weights_sha256 != want["weights_sha256"]:
        raise PinMismatchError(f"target weights {target.weights_sha256} differ from the ones this "
                               f"predictor was derived from ({want['weights_sha256']})")
    smooth = load_smooth(ckpt.path) if ckpt.rung.kind == W8A8 else None
    return rung_state(target.state, ckpt.rung, target.config, smooth)
