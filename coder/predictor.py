"""The pinned predictor checkpoint: an FP8 copy of the target plus calibration.

Lifecycle:
1. ``build_checkpoint`` (CLI ``speckv predictor build``) quantises the target's
   linear weights to e4m3 with one fp32 scale per output channel, calibrates
   sigma and the symbol histograms on a text (``calibrate``), and writes
   ``manifest.json`` + ``calib.npz`` (+ ``config.json`` and
   ``weights.safetensors`` unless the weights are derived from the target).
2. The pin is the sha256 of ``manifest.json``, whose bytes are canonical JSON
   listing the sha256 of every other file and of the FP8 weights.
3. ``load_checkpoint(dir, pin=...)`` verifies every hash (typed
   ``PinMismatchError`` on any mismatch) and returns a :class:`Checkpoint`.
4. ``Predictor`` runs the FP8 copy on prompt token ids and returns mu in the
   canonical KV layout; both sidecars compute it bit for bit (see
   ``target.deterministic_torch``).

The embedded model's default checkpoint ships only its small files as package
data; its FP8 weights are derived from the embedded GGUF at load time and
checked against the manifest's weight digest.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import CheckpointError, PinMismatchError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .ladder import Rung
    from .tables import CodingTables
    from .target import Target

logger = logging.getLogger(__name__)

FORMAT_NAME = "speckv-predictor"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CALIB = "calib.npz"
WEIGHTS = "weights.safetensors"
CONFIG = "config.json"
TABLES = "tables.npz"
FP8_SUFFIX = ".weight_fp8"  # e4m3 symbols of a linear weight, stored as uint8
SCALE_SUFFIX = ".weight_scale"  # its fp32 per-output-channel scales


SHIPPED_RUNG = "hybrid:4"  # the rung of the shipped default checkpoint (benchmarks/RESULTS.md says why)


def default_checkpoint_dir() -> Path:
    """The embedded model's default predictor, shipped as package data."""
    return Path(str(resources.files("speckv.coder") / "data" / "default_predictor"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def state_digest(state: dict[str, "torch.Tensor"]) -> str:
    """sha256 over a state dict's (name, dtype, shape, bytes) in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fp8_state(target_state: dict[str, "torch.Tensor"], rung: "Rung | None" = None) -> dict[str, "torch.Tensor"]:
    """The predictor's weights: e4m3 decoder-layer linears, everything else as is.

    Under a ``hybrid:k`` rung the linears of layers < k stay the target's BF16 ones.
    """
    from .fp8 import weight_to_fp8
    from .ladder import is_bf16_layer
    from .target import LINEAR_NAMES

    out: dict[str, torch.Tensor] = {}
    for name, t in target_state.items():
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        if (stem and ".layers." in stem and stem.rsplit(".", 1)[-1] in LINEAR_NAMES
                and not (rung is not None and is_bf16_layer(stem, rung))):
            q, s = weight_to_fp8(t)
            out[stem + FP8_SUFFIX], out[stem + SCALE_SUFFIX] = q, s
        elif name != "lm_head.weight":  # the predictor never computes logits
            out[name] = t.detach().clone()
    return out


def save_npz_stable(path: Path, arrays: dict[str, np.ndarray]) -> None:
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
        arrays = {"sigma2": self.sigma2, "sigma_log2_q": self.sigma_log2_q,
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
                           hist_fp8=z["hist_fp8"], mixture=tuple(float(v) for v in z["mixture"]),
                           wide=float(z["wide"]), **{k: z[k] for k in TUNED_KEYS if k in z.files})
        except (OSError, KeyError, ValueError) as e:
            raise CheckpointError(f"bad calibration file {path}: {e}") from e


TUNED_KEYS = ("mu_scale", "mu_shift", "tuned_sigma2", "tuned_sigma_log2_q")
TUNED_TABLES = "tuned_"  # prefix of the tuned model's arrays in tables.npz


@dataclass
class Checkpoint:
    """A verified predictor checkpoint directory."""

    path: Path
    pin: str
    manifest: dict[str, Any]
    calib: Calibration
    tables: "CodingTables"  # the seed model's
    tuned_tables: "CodingTables | None" = None  # the tuned model's (``residual.py``)

    @property
    def seed_tables(self) -> "CodingTables":
        return self.tables

    @property
    def rung(self) -> "Rung":
        """The predictor ladder rung this checkpoint pins (``ladder.py``)."""
        from .ladder import manifest_rung

        return manifest_rung(self.manifest)

    @property
    def derived_weights(self) -> bool:
        """Whether the predictor's weights come from the target at load (rung none has none)."""
        return self.manifest["weights"] is not None and self.manifest["weights"]["file"] is None

    def describe(self) -> dict[str, Any]:
        m = self.manifest
        return {"pin": self.pin, "path": str(self.path), "kind": m["kind"], "rung": self.rung.name,
                "target": m["target"],
                "arch": m["arch"], "weights": m["weights"], "calibration": m["calibration"],
                "mixture": m["mixture"]}


def write_manifest(out: Path, manifest: dict[str, Any]) -> str:
    """Write canonical manifest bytes; returns the pin (their sha256)."""
    data = canonical_json(manifest)
    (out / MANIFEST).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def load_checkpoint(path: str | Path, pin: str | None = None) -> Checkpoint:
    """Read and verify a checkpoint; ``pin`` (if given) must equal its sha256."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"no {MANIFEST} in predictor checkpoint {path}")
    raw = mpath.read_bytes()
    actual = hashlib.sha256(raw).hexdigest()
    if pin is not None and pin.lower() != actual:
        raise PinMismatchError(f"predictor pin mismatch: expected {pin}, checkpoint {path} has {actual}")
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise PinMismatchError(f"{mpath} is not valid JSON: {e}") from e
    if canonical_json(manifest) != raw:
        raise PinMismatchError(f"{mpath} is not canonical (edited by hand?)")
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: unsupported format {manifest.get('format')!r} "
                              f"v{manifest.get('format_version')!r}")
    from .ladder import MEANS, NONE, manifest_rung

    rung = manifest_rung(manifest)  # CheckpointError on an unknown rung
    weights = manifest.get("weights")
    if (weights is None) != (rung.kind == NONE) or not (weights is None or isinstance(weights, dict)):
        raise CheckpointError(f"{mpath}: rung {rung.name} and the weights entry {weights!r:.80} disagree")
    required = {CALIB, TABLES, CONFIG} | ({WEIGHTS} if (weights or {}).get("file") else set())
    required |= {MEANS} if rung.kind == NONE else set()
    files = manifest.get("files", {})
    if not required <= set(files) or any("/" in n or "\\" in n or n.startswith(".") for n in files):
        raise PinMismatchError(f"{mpath}: the manifest must list exactly the checkpoint's files, "
                               f"got {sorted(files)}")
    for name, digest in sorted(files.items()):
        fpath = path / name
        if not fpath.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        got = sha256_file(fpath)
        if got != digest:
            raise PinMismatchError(f"{fpath}: sha256 {got} does not match manifest {digest}")
    from .tables import CodingTables

    try:
        with np.load(path / TABLES, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        tables = CodingTables.from_arrays(arrays)
        tuned = {k[len(TUNED_TABLES):]: v for k, v in arrays.items() if k.startswith(TUNED_TABLES)}
        tuned_tables = CodingTables.from_arrays(tuned) if tuned else None
    except (OSError, KeyError, ValueError) as e:
        raise CheckpointError(f"bad coding tables in {path}: {e}") from e
    return Checkpoint(path=path, pin=actual, manifest=manifest, calib=Calibration.load(path / CALIB),
                      tables=tables, tuned_tables=tuned_tables)
