"""The native model's contexts against numpy's ``model.context`` (through
``ContextTable``, which tabulates it): every BF16 mu pattern at every sigma level in a
wide range, on the integer path the CPU coder runs, on the float reference path the
CUDA kernels run, and through the scale-invariant table the CPU coder looks them up in."""
from __future__ import annotations

import numpy as np
import pytest
from native_helpers import need_native

from speckv.coder import native
from speckv.coder.model import BF16, ContextTable

LEVELS = np.arange(-220, 80)  # 1/8 octaves: far beyond any calibrated sigma either way


@pytest.fixture(scope="module")
def reference():
    need_native()
    return ContextTable(BF16, BF16, LEVELS[None, :])


@pytest.mark.parametrize("path", [0, 1, 2, 3, 4], ids=["integer", "float", "lookup", "vector", "vector512"])
def test_every_bf16_pattern_at_every_level(reference, path):
    if path == 3 and not native.vector_path():
        pytest.skip("the vector path needs a CPU with AVX2")
    if path == 4 and not native.wide_path():
        pytest.skip("the vector512 path needs a CPU with AVX-512")
    mu = np.tile(np.arange(1 << 16, dtype=np.uint16), len(reference.levels))
    L = np.repeat(reference.levels, 1 << 16).astype(np.int32)
    out = np.empty(len(mu), np.uint32)
    native._native.contexts(False, mu, L, out, path)
    bad = np.flatnonzero(out != reference.packed)
    assert len(bad) == 0, f"{len(bad)} contexts differ, first mu {mu[bad[0]]:#06x} at level {L[bad[0]]}"


@pytest.mark.parametrize("shape", [(2, 2, 3, 40, 64), (1, 2, 1, 7, 3), (3, 2, 2, 5, 13)],
                         ids=["whole", "tiny", "odd"])
def test_every_native_path_codes_the_same_bytes(ckpt, shape):
    """The coder's paths (vector and vector512 where the CPU has AVX2 / AVX-512, table lookup,
    computed): same streams; at odd sizes too, so that the AVX-512 raw-bit stage (eight fields a
    step) meets blocks whose element count leaves a tail, and random bit patterns put the rare
    kinds (escapes, subnormals, NaN) among every step's eight."""
    need_native()
    rng = np.random.default_rng(5)
    x = rng.integers(0, 1 << 16, shape).astype(np.uint16)
    mu = (x.astype(np.int64) + rng.integers(-300, 300, shape)).clip(0, 0xFFFF).astype(np.uint16)
    lg = rng.integers(-200, 60, (shape[0], 2, shape[2], shape[4])).astype(np.int32)  # beyond the binades too
    counts = [1] * shape[0]
    outs = []
    for path in ["lookup", "computed", *native.vector_paths()]:
        nat = native.NativeCoder(1, path=path)
        parts = nat.encode(x, mu, lg, counts, 8, ckpt.tables)
        back = np.empty_like(x)
        nat.decode(mu, lg, counts, 8, [(p.blocks, p.bits) for p in parts], ckpt.tables, back)
        assert back.tobytes() == x.tobytes()
        outs.append([(p.blocks.states.tobytes(), p.blocks.words.tobytes(), p.bits) for p in parts])
    assert all(o == outs[0] for o in outs[1:])


def test_fp8_contexts_vector_path_on_spread_fp32_patterns():
    """FP8 KV's mu' is fp32 (mu / scale): the AVX2 context stage against the scalar one on
    every high half-word with spread low halves (NaN, inf, subnormals, zeros included) at
    levels far beyond any calibration."""
    need_native()
    if not native.vector_path():
        pytest.skip("the vector path needs a CPU with AVX2")
    paths = [3] + ([4] if native.wide_path() else [])  # the AVX2 stage and its AVX-512 build
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    lo = np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF, 0x1234], np.uint32)
    mu = (hi[:, None] | lo[None, :]).ravel()
    for level in range(-120, 60, 7):
        L = np.full(len(mu), level, np.int32)
        want, got = np.empty(len(mu), np.uint32), np.empty(len(mu), np.uint32)
        native._native.contexts(True, mu, L, want, 0)
        for path in paths:
            native._native.contexts(True, mu, L, got, path)
            bad = np.flatnonzero(want != got)
            assert len(bad) == 0, f"path {path}: {len(bad)} differ at level {level}, first mu {mu[bad[0]]:#010x}"
