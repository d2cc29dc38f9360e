"""Calibration and checkpoint building: run target and predictor on a text once.

Lifecycle: ``build_checkpoint(target, text, out)`` quantises the target into
the FP8 copy, runs both models on the first ``tokens`` tokens of the text in
fixed-length segments, and freezes: sigma^2 per (layer, kv, head, channel)
(residual variance of KV_target - mu over finite scalars), the empirical BF16
and e4m3 symbol histograms (the mixture's third component), and the mixture
weights. It writes the checkpoint and returns its pin. ``rung`` picks the
predictor of the ladder (``ladder.py``): ``fp8`` (default), ``hybrid:k``, or
``none`` (whose per-channel means are computed here and stored in the checkpoint).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np

from speckv.coder.residual import TUNED_MIXTURE, AffineFit
from speckv.coder.tables import SIGMA_ONE, build_tables
from speckv.errors import CalibrationError

from .fp8 import kv_to_fp8
from .ladder import (
    KV_BITS_SPLIT,
    MEANS,
    PORTABLE,
    W8A8,
    CachedKV,
    Rung,
    kv_means_bf16,
    manifest_fields,
    mean_model,
    parse_rung,
    save_means,
    weights_quant,
    with_kv_bits,
)
from .portable import portable_canary
from .predict import build_model, predictor_kv, rung_state
from .store import (
    CALIB,
    CONFIG,
    FORMAT_NAME,
    FORMAT_VERSION,
    SMOOTH_FILE,
    TABLES,
    TUNED_TABLES,
    WEIGHTS,
    Calibration,
    save_npz_stable,
    sha256_file,
    state_digest,
    write_manifest,
)
from .target import CANARY_TOKENS, COMPUTE_THREADS, Target, numeric_env
from .w8a8 import save_smooth, smooth_exponents

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

MIXTURE = (0.95, 0.03, 0.02)  # N(mu, s^2), N(mu, (WIDE*s)^2), empirical symbols
WIDE = 3.0
SIGMA2_FLOOR = 1e-12  # keeps a channel whose residual is always 0 codable
DEFAULT_CALIB_TOKENS = 4096
DEFAULT_SEGMENT = CANARY_TOKENS  # calibration segments run at the canary's shape (target.numeric_env)
VOLATILE_CONFIG_KEYS = ("quantization_config", "_name_or_path", "transformers_version")


@dataclass
class ResidualStats:
    """Running sums over calibration segments."""

    sum_r2: np.ndarray  # (layers, 2, kv_heads, head_dim) float64
    count: np.ndarray  # same shape, int64
    hist_bf16: np.ndarray  # (65536,) int64
    hist_fp8: np.ndarray  # (256,) int64
    affine: AffineFit  # the tuned model's per-channel mu correction

    @classmethod
    def empty(cls, layers: int, heads: int, dim: int) -> "ResidualStats":
        shape = (layers, 2, heads, dim)
        return cls(np.zeros(shape), np.zeros(shape, np.int64), np.zeros(65536, np.int64),
                   np.zeros(256, np.int64), AffineFit.empty(shape))

    def add(self, kv: "torch.Tensor", mu: "torch.Tensor") -> None:
        x, m = kv.double().numpy(), mu.double().numpy()  # (layers, 2, heads, tokens, dim)
        r = x - m
        ok = np.isfinite(r)
        self.sum_r2 += np.where(ok, r, 0.0).__pow__(2).sum(axis=3)
        self.count += ok.sum(axis=3)
        self.affine.add(x, m)
        del x, m, r, ok
        self.hist_bf16 += np.bincount(bf16_symbols(kv).ravel(), minlength=65536)
        q, _ = kv_to_fp8(kv)
        self.hist_fp8 += np.bincount(q.numpy().ravel(), minlength=256)

    def freeze(self) -> Calibration:
        if (self.count == 0).any():
            raise CalibrationError("calibration left a channel without any finite residual")
        sigma2 = np.maximum(self.sum_r2 / self.count, SIGMA2_FLOOR)
        a, b, tuned = self.affine.solve()
        tuned2 = np.maximum(tuned, SIGMA2_FLOOR)
        return Calibration(sigma2=sigma2, sigma_log2_q=log2_sigma_q(sigma2), hist_bf16=self.hist_bf16.copy(),
                           hist_fp8=self.hist_fp8.copy(), mixture=MIXTURE, wide=WIDE, mu_scale=a, mu_shift=b,
                           tuned_sigma2=tuned2, tuned_sigma_log2_q=log2_sigma_q(tuned2))


def log2_sigma_q(sigma2: np.ndarray) -> np.ndarray:
    """round(SIGMA_ONE * log2 sigma) as int32.

    NOTE: the one float log of the coder, taken here once and stored (pinned)."""
    return np.round(np.log2(sigma2) * (SIGMA_ONE / 2.0)).astype(np.int32)


def coding_tables(calib: Calibration) -> dict[str, np.ndarray]:
    """tables.npz: the seed model's tables, and the tuned model's under TUNED_TABLES."""
    arrays = build_tables(calib.mixture, calib.wide)
    if calib.tuned_sigma_log2_q is not None:
        arrays |= {TUNED_TABLES + k: v for k, v in build_tables(TUNED_MIXTURE, calib.wide).items()}
    return arrays


def bf16_symbols(kv: "torch.Tensor") -> np.ndarray:
    """The 16-bit patterns of a BF16 tensor, as uint16 numpy."""
    import torch

    return kv.contiguous().view(torch.int16).numpy().view(np.uint16)


def segments(ids: np.ndarray, tokens: int, seg: int) -> list[np.ndarray]:
    """The first ``tokens`` ids in segments of ``seg``; the text must be long enough."""
    if len(ids) < tokens:
        raise CalibrationError(f"calibration text has {len(ids)} tokens, {tokens} needed")
    return [ids[i : min(i + seg, tokens)] for i in range(0, tokens, seg)]


class KVSource(Protocol):
    """What ``calibrate`` reads of a target: its config and each segment's KV
    (a :class:`Target`, or the ladder's ``CachedKV``)."""

    @property
    def config(self) -> Any: ...

    def kv(self, ids: np.ndarray, /) -> "torch.Tensor": ...


def calibrate(target: KVSource, mu_fn: Callable[[np.ndarray], "torch.Tensor"],
              segs: list[np.ndarray], progress: Callable[[int], None] | None = None) -> Calibration:
    cfg = target.config
    heads = cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    stats = ResidualStats.empty(cfg.num_hidden_layers, heads, dim)
    for i, seg in enumerate(segs):
        stats.add(target.kv(seg), mu_fn(seg))
        if progress:
            progress(i + 1)
    return stats.freeze()


def read_text(path: str | Path, chars: int | None = None) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(chars) if chars else f.read()


def build_checkpoint(target: "Target", calib_text: Path, out: Path, *, tokens: int = DEFAULT_CALIB_TOKENS,
                     segment: int = DEFAULT_SEGMENT, derive_weights: bool = False,
                     source: str = "path", progress: Callable[[int], None] | None = None,
                     rung: str = "fp8", kv_activation_bits: int = KV_BITS_SPLIT) -> str:
    """Write a predictor checkpoint for ``target`` into ``out``; returns the pin. ``kv_activation_bits``: a
    w8a8 rung's K/V projections' activations, 14 (two int8 products) or 8 (one, as built before)."""
    ladder = with_kv_bits(parse_rung(rung, target.config.num_hidden_layers), kv_activation_bits)
    out.mkdir(parents=True, exist_ok=True)
    config = target.config.to_dict()
    for volatile in VOLATILE_CONFIG_KEYS:  # where the model was loaded from is not what it is
        config.pop(volatile, None)
    (out / CONFIG).write_bytes(json.dumps(config, sort_keys=True, indent=1).encode() + b"\n")
    ids = target.tokenize(read_text(calib_text, chars=tokens * 16), tokens)
    segs = segments(ids, tokens, segment)
    smooth = None
    if ladder.kind == W8A8:  # its weights need the target's activations on the calibration text
        smooth = smooth_exponents(target, segs, ladder.bf16_layers)
        save_smooth(out, smooth)
    state = rung_state(target.state, ladder, target.config, smooth) if ladder.has_model else None
    model = None
    if state is None:
        calib = calibrate_none(target, segs, out, progress)
    else:
        model = build_model(type(target.config).from_dict(config), state, ladder)
        calib = calibrate(target, lambda s: predictor_kv(model, s), segs, progress)
    calib.save(out / CALIB)
    save_npz_stable(out / TABLES, coding_tables(calib))
    files = {name: sha256_file(out / name) for name in (CALIB, CONFIG, TABLES)}
    if smooth is not None:
        files[SMOOTH_FILE] = sha256_file(out / SMOOTH_FILE)
    if state is None:  # rung none: the means instead of weights
        files[MEANS] = sha256_file(out / MEANS)
    elif not derive_weights:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS))
        files[WEIGHTS] = sha256_file(out / WEIGHTS)
    for stale in {WEIGHTS, MEANS, SMOOTH_FILE} - set(files):  # left by an earlier build into the same dir
        (out / stale).unlink(missing_ok=True)
    manifest = _manifest(target, calib_text, state, files, tokens, segment, derive_weights, source, ladder)
    if model is not None and ladder.kind == PORTABLE:  # the same on every machine: checked at start-up
        manifest["canary"] = portable_canary(model)
    return write_manifest(out, manifest)


def _manifest(target: "Target", calib_text: Path, state: dict | None, files: dict, tokens: int,
              segment: int, derive_weights: bool, source: str, ladder: "Rung") -> dict:
    cfg = target.config
    weights: dict[str, Any] | None = None if state is None else {
        "file": None if derive_weights else WEIGHTS, "sha256": state_digest(state), "quant": weights_quant(ladder)}
    if weights is not None and ladder.bf16_layers:  # portable:k's first k layers are integer ones
        weights["exit_layer" if ladder.kind == PORTABLE else "bf16_layers"] = ladder.bf16_layers
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, **manifest_fields(ladder),
        "target": {"name": target.name, "source": source, "weights_sha256": target.weights_sha256},
        "arch": {"layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
                 "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                 "model_type": cfg.model_type},
        "weights": weights,
        "files": files,
        "calibration": {"text": Path(calib_text).name, "text_sha256": sha256_file(Path(calib_text)),
                        "tokens": tokens, "segment_tokens": segment},
        "mixture": {"weights": list(MIXTURE), "wide": WIDE},
        "models": {"seed": {"id": 1, "mixture": list(MIXTURE)},
                   "tuned": {"id": 2, "mixture": list(TUNED_MIXTURE), "mu": "bf16(a * mu + b) per channel"}},
        "compute_threads": COMPUTE_THREADS,
        "numeric_env": numeric_env(target),  # where the calibration bytes are reproducible
    }


def calibrate_none(target: Target, segs: list[np.ndarray], out: Path,
                   progress: Callable[[int], None] | None = None) -> Calibration:
    """Rung none: write the means file, then freeze the residual statistics around them."""
    kvs = [target.kv(seg) for seg in segs]
    bits = kv_means_bf16(kvs)
    save_means(out / MEANS, bits)
    model = mean_model(target.config, bits)
    return calibrate(CachedKV(target, kvs), lambda s: model.mean_kv(len(s)), segs, progress)
