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
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from speckv.coder.tables import CodingTables
from speckv.errors import CheckpointError, PinMismatchError

from .fp8 import weight_to_fp8
from .fp32_linear import LINEAR_NAMES
from .ladder import MEANS, NONE, W8A8, Rung, is_bf16_layer, manifest_rung
from .store import (
    CALIB,
    CONFIG,
    FORMAT_NAME,
    FORMAT_VERSION,
    FP8_SUFFIX,
    MANIFEST,
    SCALE_SUFFIX,
    SMOOTH_FILE,
    TABLES,
    TUNED_TABLES,
    WEIGHTS,
    Calibration,
    canonical_json,
    sha256_file,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch


def fp8_state(target_state: Mapping[str, "torch.Tensor"], rung: "Rung | None" = None) -> dict[str, "torch.Tensor"]:
    """The predictor's weights: e4m3 decoder-layer linears, everything else as is.

    Under a ``hybrid:k`` rung the linears of layers < k stay the target's BF16 ones.
    """
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


@dataclass
class Checkpoint:
    """A verified predictor checkpoint directory."""

    path: Path
    pin: str
    manifest: dict[str, Any]
    calib: Calibration
    tables: CodingTables  # the seed model's
    tuned_tables: CodingTables | None = None  # the tuned model's (``residual.py``)

    @property
    def seed_tables(self) -> CodingTables:
        return self.tables

    @property
    def rung(self) -> Rung:
        """The predictor ladder rung this checkpoint pins (``ladder.py``)."""
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
                "mixture": m["mixture"], "numeric_env": m.get("numeric_env")}


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
    rung = manifest_rung(manifest)  # CheckpointError on an unknown rung
    weights = manifest.get("weights")
    if (weights is None) != (rung.kind == NONE) or not (weights is None or isinstance(weights, dict)):
        raise CheckpointError(f"{mpath}: rung {rung.name} and the weights entry {weights!r:.80} disagree")
    required = {CALIB, TABLES, CONFIG} | ({WEIGHTS} if (weights or {}).get("file") else set())
    required |= {MEANS} if rung.kind == NONE else set()
    required |= {SMOOTH_FILE} if rung.kind == W8A8 else set()
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
