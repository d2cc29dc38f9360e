"""The predictor checkpoint's files: names, canonical bytes, hashes and the
calibration statistics (``Calibration``). Nothing here runs a model; the
checkpoint as a whole (verification, the FP8 weights) is ``checkpoint.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from speckv.errors import CheckpointError

from .mapped import hash_into

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from numpy.typing import ArrayLike

logger = logging.getLogger(__name__)

FORMAT_NAME = "speckv-predictor"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CALIB = "calib.npz"
WEIGHTS = "weights.safetensors"
CONFIG = "config.json"
TABLES = "tables.npz"
SMOOTH_FILE = "smooth.npz"  # rung w8a8: int8 smoothing exponents per input channel of each fused linear
FP8_SUFFIX = ".weight_fp8"  # e4m3 symbols of a linear weight, stored as uint8
SCALE_SUFFIX = ".weight_scale"  # its fp32 per-output-channel scales


SHIPPED_RUNG = "w8a8x:4"  # the rung of the shipped default checkpoint (benchmarks/RESULTS.md says why)


def default_checkpoint_dir() -> Path:
    """The embedded model's default predictor, shipped as package data."""
    return Path(str(resources.files("speckv.predictor") / "data" / "default_predictor"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def state_digest(state: Mapping[str, "torch.Tensor"]) -> str:
    """sha256 over a state dict's (name, dtype, shape, bytes) in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if not hash_into(h, t):  # NOTE: a mapped tensor's pages are read and dropped window by window
            t = t.contiguous().cpu()
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # the tensor's bytes, not a copy
    return h.hexdigest()


def save_npz_stable(path: Path, arrays: Mapping[str, ArrayLike]) -> None:
    """An ``.npz`` whose bytes depend only on the arrays.

    NOTE: ``np.savez`` stamps each member with the current time, so the pinned
    checkpoint would change on every rebuild; here every member has a fixed date
    and is stored uncompressed (deflate output differs between zlib builds).
    """
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED  # deflate output varies across zlib builds
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.require(arrays[name], requirements="C"), allow_pickle=False)
            zf.writestr(info, buf.getvalue())


@dataclass
class Calibration:
    """Frozen statistics of the residual KV_target - mu (see ``calibrate``)."""

    sigma2: np.ndarray  # (layers, 2, kv_heads, head_dim) float64 residual variance
    sigma_log2_q: np.ndarray  # same shape, int32: round(SIGMA_ONE * log2 sigma), for the coder
    hist_bf16: np.ndarray  # (65536,) int64 counts of target BF16 symbols
    hist_fp8: np.ndarray  # (256,) int64 counts of target e4m3 symbols
    mixture: tuple[float, float, float]  # weights of N(s), N(wide*s), empirical
    wide: float  # the wide Gaussian's sigma multiplier
    # the tuned residual model (``residual.py``; None in checkpoints built before it)
    mu_scale: np.ndarray | None = None  # (layers, 2, kv_heads, head_dim) float32 a of mu' = a mu + b
    mu_shift: np.ndarray | None = None  # same shape, float32 b
    tuned_sigma2: np.ndarray | None = None  # residual variance of x - mu', float64
    tuned_sigma_log2_q: np.ndarray | None = None  # its fixed-point log2 sigma, int32

    def save(self, path: Path) -> None:
        arrays: dict[str, np.ndarray | np.generic] = {"sigma2": self.sigma2, "sigma_log2_q": self.sigma_log2_q,
                  "hist_bf16": self.hist_bf16, "hist_fp8": self.hist_fp8,
                  "mixture": np.asarray(self.mixture, np.float64), "wide": np.float64(self.wide)}
        for name in TUNED_KEYS:
            if getattr(self, name) is not None:
                arrays[name] = getattr(self, name)
        save_npz_stable(path, arrays)

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls(sigma2=z["sigma2"].astype(np.float64), sigma_log2_q=z["sigma_log2_q"].astype(np.int32),
                           hist_bf16=z["hist_bf16"],
                           hist_fp8=z["hist_fp8"],
                           mixture=cast("tuple[float, float, float]", tuple(float(v) for v in z["mixture"])),
                           wide=float(z["wide"]), **{k: z[k] for k in TUNED_KEYS if k in z.files})
        except (OSError, KeyError, ValueError) as e:
            raise CheckpointError(f"bad calibration file {path}: {e}") from e


TUNED_KEYS = ("mu_scale", "mu_shift", "tuned_sigma2", "tuned_sigma_log2_q")
TUNED_TABLES = "tuned_"  # prefix of the tuned model's arrays in tables.npz


def write_manifest(out: Path, manifest: dict[str, Any]) -> str:
    """Write canonical manifest bytes; returns the pin (their sha256)."""
    data = canonical_json(manifest)
    (out / MANIFEST).write_bytes(data)
    return hashlib.sha256(data).hexdigest()
