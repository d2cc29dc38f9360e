"""The native coder's rANS stage (``spk_encode.h``: ``rans_block``, and ``rans_block_avx2`` and
``rans_block_avx512`` where the CPU has AVX2 / AVX-512) against the numpy reference ``coder/rans.py``
on raw ops: the same final states, word counts and words, with the frequencies at their extremes (1,
where every step renormalises, and PROB_SCALE, the no-op). The vector paths divide in float32 and
correct the quotient by one either way; 96 blocks of 1024 steps (3.1 M ops, a chunk's worth) reach
both corrections (without either, cases fail)."""

from __future__ import annotations

import numpy as np
import pytest
from native_helpers import need_native

from speckv.coder import native
from speckv.coder.rans import LANES, PROB_SCALE, rans_encode


def native_rans(start: np.ndarray, freq: np.ndarray, path: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks, steps, _ = start.shape
    ops = (start.astype(np.uint32) | freq.astype(np.uint32) << 16).ravel()
    states, counts, words = native._native.rans_blocks(ops, steps, path)
    return (np.frombuffer(states, np.uint32).reshape(blocks, LANES), np.frombuffer(counts, np.uint32),
            np.frombuffer(words, np.uint16))


PATHS = {"scalar": 0, "avx2": 1, "avx512": 2}


def paths() -> list[str]:
    return ["scalar"] + (["avx2"] if native.vector_path() else []) + (["avx512"] if native.wide_path() else [])


def random_ops(rng: np.random.Generator, blocks: int, steps: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    shape = (blocks, steps, LANES)
    if kind == "extremes":  # 1 (renormalise every step), small, PROB_SCALE (the no-op), and in between
        freq = rng.choice(np.array([1, 2, 3, 5, 255, 4096, PROB_SCALE - 1, PROB_SCALE]), shape)
    elif kind == "small":  # states climb to the top of their range before each renormalisation
        freq = rng.integers(1, 8, shape)
    else:
        freq = rng.integers(1, PROB_SCALE + 1, shape)
    start = (rng.random(shape) * (PROB_SCALE - freq + 1)).astype(np.int64)  # start + freq <= PROB_SCALE
    return start, freq


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("kind", ["extremes", "small", "uniform"])
@pytest.mark.parametrize("blocks,steps", [(1, 1), (3, 7), (2, 64), (1, 1024), (96, 1024)])
def test_native_rans_blocks_equal_the_reference(path, kind, blocks, steps):
    need_native()
    rng = np.random.default_rng([blocks, steps, ord(kind[0])])
    start, freq = random_ops(rng, blocks, steps, kind)
    want = rans_encode(start, freq)
    states, counts, words = native_rans(start, freq, PATHS[path])
    assert np.array_equal(states, want.states)
    assert np.array_equal(counts, want.word_counts)
    assert words.tobytes() == want.words.tobytes()


def test_native_rans_rejects_bad_ops():
    need_native()
    with pytest.raises(ValueError, match="whole blocks"):
        native._native.rans_blocks(np.zeros(LANES * 3 - 1, np.uint32), 3, 0)
    with pytest.raises(ValueError, match="whole blocks"):
        native._native.rans_blocks(np.zeros(0, np.uint32), 2**59, 0)  # steps * LANES would overflow
    with pytest.raises(ValueError, match="no rANS path"):
        native._native.rans_blocks(np.full(LANES * 3, PROB_SCALE << 16, np.uint32), 3, 7)
    with pytest.raises(ValueError, match="freq 0"):
        native._native.rans_blocks(np.zeros(LANES * 3, np.uint32), 3, 0)
    with pytest.raises(ValueError, match="start 1, freq 32768"):
        native._native.rans_blocks(np.full(LANES, 1 | PROB_SCALE << 16, np.uint32), 1, 0)
