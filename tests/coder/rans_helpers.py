"""Shared helpers of the rANS tests (``test_rans*.py``): a scalar reference encoder
on plain ints (what the CUDA port is checked against) and static-table encode /
decode helpers."""

from __future__ import annotations

import numpy as np

from speckv.coder.rans import LANES, PROB_BITS, PROB_SCALE, RANS_L, WORD_BITS, RansBlocks, RansDecoder, rans_encode

# ---------------------------------------------------------------- reference


def ref_put(x: int, start: int, freq: int) -> tuple[int, int | None]:
    """One scalar encoder op on plain ints: (new state, emitted word or None)."""
    word = None
    x_max = ((RANS_L >> PROB_BITS) << WORD_BITS) * freq
    if x >= x_max:
        word = x & ((1 << WORD_BITS) - 1)
        x >>= WORD_BITS
    x = ((x // freq) << PROB_BITS) + (x % freq) + start
    assert RANS_L <= x < 1 << 32
    return x, word


def ref_encode(start: np.ndarray, freq: np.ndarray) -> RansBlocks:
    """Scalar reference encoder: one block, one step, one lane at a time."""
    n_blocks, steps, lanes = start.shape
    states, counts, words = [], [], []
    for b in range(n_blocks):
        x = [RANS_L] * lanes
        block_words = []
        for s in reversed(range(steps)):  # rANS is LIFO
            for lane in range(lanes):  # ascending lanes = ballot order
                x[lane], w = ref_put(x[lane], int(start[b, s, lane]), int(freq[b, s, lane]))
                if w is not None:
                    block_words.append(w)
        states.append(x)
        counts.append(len(block_words))
        words.extend(block_words)
    return RansBlocks(
        states=np.array(states, dtype=np.uint32).reshape(n_blocks, lanes),
        word_counts=np.array(counts, dtype=np.uint32),
        words=np.array(words, dtype=np.uint16),
    )


def assert_blocks_equal(a: RansBlocks, b: RansBlocks) -> None:
    for name in ("states", "word_counts", "words"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


# ---------------------------------------------------------------- helpers


def cum_of(freqs: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(freqs)[:-1]]).astype(np.uint32)


def encode_static(sym: np.ndarray, freqs: np.ndarray) -> RansBlocks:
    """Encode symbols (blocks, steps, LANES) with one static frequency table."""
    freqs = np.asarray(freqs, dtype=np.uint32)
    return rans_encode(cum_of(freqs)[sym], freqs[sym])


def decode_static(blocks: RansBlocks, steps: int, freqs: np.ndarray) -> np.ndarray:
    """Decode with one static table via a slot -> symbol lookup table."""
    freqs = np.asarray(freqs, dtype=np.uint32)
    cum = cum_of(freqs)
    slot2sym = np.repeat(np.arange(freqs.size), freqs)  # (PROB_SCALE,)
    d = RansDecoder(blocks, steps)
    out = np.empty((blocks.states.shape[0], steps, LANES), dtype=np.int64)
    for s in range(steps):
        sym = slot2sym[d.dec_get()]
        out[:, s, :] = sym
        d.dec_advance(cum[sym], freqs[sym])
    d.finish()
    return out


def skewed_table(n: int = 40) -> np.ndarray:
    p = 0.8 ** np.arange(n)
    freqs = np.maximum(1, np.floor(p / p.sum() * PROB_SCALE)).astype(np.int64)
    freqs[0] += PROB_SCALE - freqs.sum()
    return freqs


def draw_symbols(rng: np.random.Generator, shape: tuple, freqs: np.ndarray) -> np.ndarray:
    return rng.choice(len(freqs), size=shape, p=np.asarray(freqs) / PROB_SCALE)
