"""Calibration and checkpoint building: run target and predictor on a text once.

Lifecycle: ``build_checkpoint(target, text, out)`` quantises the target into
the FP8 copy, runs both models on the first ``tokens`` tokens of the text in
fixed-length segments, and freezes: sigma^2 per (layer, kv, head, channel)
(residual variance of KV_target - mu over finite scalars), the empirical BF16
and e4m3 symbol histograms (the mixture's third component), and the mixture
weights. It writes the checkpoint and returns its pin.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from .errors import CalibrationError
from .predictor import (CALIB, CONFIG, FORMAT_NAME, FORMAT_VERSION, TABLES, WEIGHTS, Calibration,
                        fp8_state, save_npz_stable, sha256_file, state_digest, write_manifest)
from .tables import SIGMA_ONE, build_tables

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .target import Target

logger = logging.getLogger(__name__)

MIXTURE = (0.95, 0.03, 0.02)  # N(mu, s^2), N(mu, (WIDE*s)^2), empirical symbols
WIDE = 3.0
SIGMA2_FLOOR = 1e-12  # keeps a channel whose residual is always 0 codable
DEFAULT_CALIB_TOKENS = 4096
DEFAULT_SEGMENT = 2048
VOLATILE_CONFIG_KEYS = ("quantization_config", "_name_or_path", "transformers_version")


@dataclass
class ResidualStats:
    """Running sums over calibration segments."""

    sum_r2: np.ndarray  # (layers, 2, kv_heads, head_dim) float64
    count: np.ndarray  # same shape, int64
    hist_bf16: np.ndarray  # (65536,) int64
    hist_fp8: np.ndarray  # (256,) int64

    @classmethod
    def empty(cls, layers: int, heads: int, dim: int) -> "ResidualStats":
        shape = (layers, 2, heads, dim)
        return cls(np.zeros(shape), np.zeros(shape, np.int64), np.zeros(65536, np.int64),
                   np.zeros(256, np.int64))

    def add(self, kv: "torch.Tensor", mu: "torch.Tensor") -> None:
        from .fp8 import kv_to_fp8

        r = kv.double().numpy() - mu.double().numpy()  # (layers, 2, heads, tokens, dim)
        ok = np.isfinite(r)
        self.sum_r2 += np.where(ok, r, 0.0).__pow__(2).sum(axis=3)
        self.count += ok.sum(axis=3)
        self.hist_bf16 += np.bincount(bf16_symbols(kv).ravel(), minlength=65536)
        q, _ = kv_to_fp8(kv)
        self.hist_fp8 += np.bincount(q.numpy().ravel(), minlength=256)

    def freeze(self) -> Calibration:
        if (self.count == 0).any():
            raise CalibrationError("calibration left a channel without any finite residual")
        sigma2 = np.maximum(self.sum_r2 / self.count, SIGMA2_FLOOR)
        # NOTE: the one float log of the coder, taken here once and stored (pinned)
        log2q = np.round(np.log2(sigma2) * (SIGMA_ONE / 2.0)).astype(np.int32)
        return Calibration(sigma2=sigma2, sigma_log2_q=log2q, hist_bf16=self.hist_bf16.copy(),
                           hist_fp8=self.hist_fp8.copy(), mixture=MIXTURE, wide=WIDE)


def bf16_symbols(kv: "torch.Tensor") -> np.ndarray:
    """The 16-bit patterns of a BF16 tensor, as uint16 numpy."""
    import torch

    return kv.contiguous().view(torch.int16).numpy().view(np.uint16)


def segments(ids: np.ndarray, tokens: int, seg: int) -> list[np.ndarray]:
    """The first ``tokens`` ids in segments of ``seg``; the text must be long enough."""
    if len(ids) < tokens:
        raise CalibrationError(f"calibration text has {len(ids)} tokens, {tokens} needed")
    return [ids[i : min(i + seg, tokens)] for i in range(0, tokens, seg)]


def calibrate(target: "Target", mu_fn: Callable[[np.ndarray], "torch.Tensor"],
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
                     source: str = "path", progress: Callable[[int], None] | None = None) -> str:
    """Write a predictor checkpoint for ``target`` into ``out``; returns the pin."""
    from .predict import build_model

    out.mkdir(parents=True, exist_ok=True)
    state = fp8_state(target.state)
    config = target.config.to_dict()
    for volatile in VOLATILE_CONFIG_KEYS:  # where the model was loaded from is not what it is
        config.pop(volatile, None)
    (out / CONFIG).write_bytes(json.dumps(config, sort_keys=True, indent=1).encode() + b"\n")
    model = build_model(type(target.config).from_dict(config), state)
    from .target import extract_kv

    ids = target.tokenize(read_text(calib_text, chars=tokens * 16), tokens)
    calib = calibrate(target, lambda s: extract_kv(model, s), segments(ids, tokens, segment), progress)
    calib.save(out / CALIB)
    save_npz_stable(out / TABLES, build_tables(calib.mixture, calib.wide))
    files = {name: sha256_file(out / name) for name in (CALIB, CONFIG, TABLES)}
    if not derive_weights:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS))
        files[WEIGHTS] = sha256_file(out / WEIGHTS)
    elif (out / WEIGHTS).exists():
        (out / WEIGHTS).unlink()
    return write_manifest(out, _manifest(target, calib_text, state, files, tokens, segment,
                                         derive_weights, source))


def _manifest(target: "Target", calib_text: Path, state: dict, files: dict, tokens: int,
              segment: int, derive_weights: bool, source: str) -> dict:
    from .target import COMPUTE_THREADS

    cfg = target.config
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "kind": "fp8-copy",
        "target": {"name": target.name, "source": source, "weights_sha256": target.weights_sha256},
        "arch": {"layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
                 "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                 "model_type": cfg.model_type},
        "weights": {"file": None if derive_weights else WEIGHTS, "sha256": state_digest(state),
                    "quant": "e4m3, fp32 scale per output channel, round to nearest even"},
        "files": files,
        "calibration": {"text": Path(calib_text).name, "text_sha256": sha256_file(Path(calib_text)),
                        "tokens": tokens, "segment_tokens": segment},
        "mixture": {"weights": list(MIXTURE), "wide": WIDE},
        "compute_threads": COMPUTE_THREADS,
    }


