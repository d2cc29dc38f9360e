"""Shared values of the predictor tests."""

from __future__ import annotations

TOKENS, SEGMENT = 64, 32  # the tiny checkpoints' calibration: tokens, and tokens per segment (conftest.py)
