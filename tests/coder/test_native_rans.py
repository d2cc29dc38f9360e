"""The native coder's rANS stage (``spk_encode.h``: ``rans_block``, and ``rans_block_avx512`` where the
CPU has AVX-512) against the numpy reference ``coder/rans.py`` on raw ops: the same final states, word
counts and words, with the frequencies at their extremes (1, where every step renormalises, and
PROB_SCALE, the no-op) and states near 2^32 (the double-precision quotient of the vector path)."""

from __future__ import annotations

import numpy as np
import pytest
from native_helpers import need_native

from speckv.coder import native
from speckv.coder.rans import LANES, PROB_SCALE, rans_encode


def native_rans(start: np.ndarray, freq: np.ndarray, wide: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks, steps, _ = start.shape
    ops = (start.astype(np.uint32) | freq.astype(np.uint32) << 16).ravel()
    states, counts, words = native._native.rans_blocks(ops, steps, wide)
    return (np.frombuffer(states, np.uint32).reshape(blocks, LANES), np.frombuffer(counts, np.uint32),
            np.frombuffer(words, np.uint16))


def paths() -> list[bool]:
    return [False, True] if native.wide_path() else [False]


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


@pytest.mark.parametrize("wide", paths(), ids=lambda w: "avx512" if w else "scalar")
@pytest.mark.parametrize("kind", ["extremes", "small", "uniform"])
@pytest.mark.parametrize("blocks,steps", [(1, 1), (3, 7), (2, 64), (1, 1024)])
def test_native_rans_blocks_equal_the_reference(wide, kind, blocks, steps):
    need_native()
    rng = np.random.default_rng([blocks, steps, ord(kind[0])])
    start, freq = random_ops(rng, blocks, steps, kind)
    want = rans_encode(start, freq)
    states, counts, words = native_rans(start, freq, wide)
    assert np.array_equal(states, want.states)
    assert np.array_equal(counts, want.word_counts)
    assert words.tobytes() == want.words.tobytes()


def test_native_rans_rejects_partial_blocks():
    need_native()
    with pytest.raises(ValueError, match="whole blocks"):
        native._native.rans_blocks(np.zeros(LANES * 3 - 1, np.uint32), 3, False)
