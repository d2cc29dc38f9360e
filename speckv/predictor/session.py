"""A loaded (target, predictor) pair and the measurements made with it.

Lifecycle: ``Session.open(target, predictor_dir, pin)`` verifies the
checkpoint, loads the target and builds the predictor; ``session.prefill(ids)``
returns the target KV and mu for a prompt; ``session.entropy(...)`` gives the
ideal-bits report that ``speckv entropy`` prints.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .calibrate import bf16_symbols
from .checkpoint import load_checkpoint
from .entropy import ideal_bits, order0_bits
from .fp8 import kv_to_fp8
from .predict import Predictor
from .store import default_checkpoint_dir
from .target import load_target

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .predict import Predictor
    from .target import Target

logger = logging.getLogger(__name__)


@dataclass
class Prefill:
    """One prompt through both models."""

    ids: np.ndarray  # (tokens,) int64
    kv: "torch.Tensor"  # (layers, 2, kv_heads, tokens, head_dim) bf16, the target's
    mu: "torch.Tensor"  # same shape and dtype, the predictor's
    target_s: float
    predictor_s: float


@dataclass
class Session:
    target: "Target"
    predictor: "Predictor"

    @classmethod
    def open(cls, target: str | Path = "default", predictor: str | Path | None = None,
             pin: str | None = None) -> "Session":

        ckpt = load_checkpoint(predictor or default_checkpoint_dir(), pin)
        tgt = load_target(target)
        if tgt.weights_sha256 != ckpt.manifest["target"]["weights_sha256"]:
            logger.warning("predictor %s was calibrated for target weights %s, not %s",
                           ckpt.pin[:12], ckpt.manifest["target"]["weights_sha256"][:12],
                           tgt.weights_sha256[:12])
        return cls(tgt, Predictor.from_checkpoint(ckpt, tgt))

    @property
    def pin(self) -> str:
        return self.predictor.pin

    def prefill(self, ids: np.ndarray) -> Prefill:
        t0 = time.perf_counter()
        kv = self.target.kv(ids)
        t1 = time.perf_counter()
        mu = self.predictor.mu(ids)
        t2 = time.perf_counter()
        return Prefill(ids=ids, kv=kv, mu=mu, target_s=t1 - t0, predictor_s=t2 - t1)

    def entropy(self, pre: Prefill, dtype: str = "bf16") -> dict[str, Any]:
        """The ideal-bits report of one prefill (keys as in ``speckv entropy --json``)."""

        calib = self.predictor.checkpoint.calib
        if dtype == "bf16":
            ib = ideal_bits(pre.kv, pre.mu, calib, "bf16")
            o0 = order0_bits(bf16_symbols(pre.kv), 65536)
        elif dtype == "fp8":
            q, scale = kv_to_fp8(pre.kv)
            ib = ideal_bits(q, pre.mu, calib, "fp8", scale)
            o0 = order0_bits(q.numpy(), 256)
        else:
            raise ValueError(f"dtype must be bf16 or fp8, not {dtype!r}")
        return {"bits_per_scalar": ib.per_scalar, "k_bits_per_scalar": ib.part(0),
                "v_bits_per_scalar": ib.part(1), "order0_bits_per_scalar": o0,
                "tokens": int(len(pre.ids)), "scalars": int(pre.kv.numel()), "dtype": dtype,
                "pin": self.pin, "target": self.target.name,
                "target_s": round(pre.target_s, 3), "predictor_s": round(pre.predictor_s, 3)}
