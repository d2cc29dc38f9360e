"""Fixtures of the predictor tests: the tiny random Llama's pinned checkpoints (64 tokens
of calibration text), built once both with a weights file and with derived weights, and a
private copy to tamper with."""

from __future__ import annotations

import shutil

import pytest
from predictor_helpers import SEGMENT, TOKENS

from speckv.predictor.calibrate import build_checkpoint


@pytest.fixture(scope="package")
def tiny_ckpts(tiny_target, tiny_text, tmp_path_factory):
    """The tiny Llama's checkpoints, built once: ``{"weights" | "derived": (dir, pin)}``
    (never modified: tests tamper with copies, ``ckpt_copy``)."""
    root = tmp_path_factory.mktemp("ckpt")
    w_dir, d_dir = root / "weights", root / "derived"
    pin_w = build_checkpoint(tiny_target, tiny_text, w_dir, tokens=TOKENS, segment=SEGMENT)
    pin_d = build_checkpoint(tiny_target, tiny_text, d_dir, tokens=TOKENS, segment=SEGMENT,
                             derive_weights=True)
    return {"weights": (w_dir, pin_w), "derived": (d_dir, pin_d)}


@pytest.fixture
def ckpt_copy(tiny_ckpts, tmp_path):
    """A private copy of the weights-file checkpoint, for tampering."""
    src, pin = tiny_ckpts["weights"]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst, pin
