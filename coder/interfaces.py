"""What the coder needs of the predictor layer above it, as protocols: the coder
never imports ``speckv.predictor``; a ``Checkpoint`` and a ``Predictor`` satisfy these."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from .tables import CodingTables

if TYPE_CHECKING:  # pragma: no cover
    import torch


class CalibrationLike(Protocol):
    """The checkpoint's frozen residual statistics the coder reads
    (``speckv.predictor.store.Calibration``)."""

    sigma_log2_q: np.ndarray
    mu_scale: np.ndarray | None
    mu_shift: np.ndarray | None
    tuned_sigma_log2_q: np.ndarray | None


class CheckpointLike(Protocol):
    """What the coder needs of a pinned predictor checkpoint
    (``speckv.predictor.checkpoint.Checkpoint``): the pin, the calibration, the tables."""

    pin: str
    calib: CalibrationLike
    tuned_tables: CodingTables | None

    @property
    def seed_tables(self) -> CodingTables: ...


class MuSource(Protocol):
    """What the codec needs of a predictor (``speckv.predictor.predict.Predictor``):
    mu for prompt token ids, in the canonical KV layout, as BF16."""

    checkpoint: CheckpointLike

    def mu(self, ids: np.ndarray) -> "torch.Tensor | np.ndarray": ...
