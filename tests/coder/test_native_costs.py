"""The native coder's cost sample (``NativeCoder.group_costs``) against numpy's
``adapt._group_costs``: the same integers (costs in 1/256 bits, surprises) on random and
adversarial BF16 patterns, FP8 codes with fp32 mu', under shifts across the whole range,
on every native path; and ``choose_shifts`` picking the same shifts either way."""

from __future__ import annotations

import numpy as np
import pytest
from codec_helpers import ADVERSARIAL
from native_helpers import need_native

from speckv.coder import adapt, native
from speckv.coder.model import BF16, E4M3, FP32
from speckv.coder.residual import MODEL_TUNED, models_of

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
GROUPS, TOKENS, DIM = 12, 9, 64


def _paths() -> list[str]:
    return ["lookup", "computed"] + native.vector_paths()


def _bf16_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    shape = (GROUPS, TOKENS, DIM)
    x = rng.integers(0, 1 << 16, shape).astype(np.uint16)
    near = (x.astype(np.int64) + rng.integers(-40, 40, shape)).clip(0, 0xFFFF).astype(np.uint16)
    mu = np.where(rng.random(shape) < 0.7, near, rng.integers(0, 1 << 16, shape).astype(np.uint16))
    flat = x.reshape(-1)
    flat[: len(ADVERSARIAL)] = ADVERSARIAL[: flat.size]  # NaN payloads, infinities, subnormals, zeros
    return x, mu.astype(np.uint16)


def _fp8_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    shape = (GROUPS, TOKENS, DIM)
    x = rng.integers(0, 256, shape).astype(np.uint8)
    mu = rng.normal(0, 30, shape).astype(np.float32).view(np.uint32).copy()
    special = np.array([0x7FC00000, 0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x7F7FFFFF], np.uint32)
    mu.reshape(-1)[: len(special)] = special
    return x, mu


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("shift", [0, -40, 8, 64, 124])
@pytest.mark.parametrize("threaded", [False, True])
def test_group_costs_match_numpy(ckpt, dtype, shift, threaded, monkeypatch):
    """``threaded``: on 2 threads however small the call (PARALLEL_MIN_ELEMENTS would keep
    this case's 6,912 elements on one)."""
    need_native()
    if threaded:
        monkeypatch.setattr(native, "PARALLEL_MIN_ELEMENTS", 0)
    rng = np.random.default_rng(abs(shift) + (dtype == "fp8"))
    tab = models_of(ckpt)[MODEL_TUNED].tables
    x, mu = _bf16_case(rng) if dtype == "bf16" else _fp8_case(rng)
    fx, fm = (BF16, BF16) if dtype == "bf16" else (E4M3, FP32)
    lg = rng.integers(-60, 40, (GROUPS, DIM)).astype(np.int64)
    shifts = np.full(GROUPS, shift, np.int64)
    want = adapt._group_costs(fx, fm, tab, x, mu, lg, shifts)
    assert want[1].sum() > 0  # the case holds surprises (escapes included)
    for path in _paths():
        got = adapt._group_costs(fx, fm, tab, x, mu, lg, shifts, native.NativeCoder(2, path))
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), path


def test_choose_shifts_native_picks_numpys_shifts(ckpt):
    """KV whose first layers differ from mu in the last bit (another engine): searched groups."""
    need_native()
    rng = np.random.default_rng(3)
    m = models_of(ckpt)[MODEL_TUNED]
    layers = m.log2_sigma.shape[0]
    mu = (rng.normal(0, 1, (layers, 2, 3, 40, DIM)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    x = mu.copy()
    x[:4] ^= (rng.random(x[:4].shape) < 0.5).astype(np.uint16)
    mu2 = m.correct(mu, slice(0, layers))
    want = adapt.choose_shifts(BF16, BF16, m.tables, x, mu2, m.log2_sigma)
    assert (want != 0).any()
    for path in _paths():
        got = adapt.choose_shifts(BF16, BF16, m.tables, x, mu2, m.log2_sigma, native.NativeCoder(1, path))
        assert np.array_equal(got, want), path
