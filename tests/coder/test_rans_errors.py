"""Tests of the interleaved rANS core on bad input: corrupt streams (truncated or
flipped words, wrong word counts, bad states, dtypes, shapes and step counts) raise
``RansDecodeError``, and caller misuse of the encoder and decoder raises ``ValueError``."""
from __future__ import annotations

import numpy as np
import pytest
from rans_helpers import decode_static, draw_symbols, encode_static, skewed_table

from speckv.coder.rans import LANES, PROB_SCALE, RANS_L, RansBlocks, RansDecodeError, RansDecoder, rans_encode

# ---------------------------------------------------------------- corrupt input


@pytest.fixture(scope="module")
def stream() -> tuple[RansBlocks, int, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    freqs = skewed_table()
    sym = draw_symbols(rng, (3, 64, LANES), freqs)
    out = encode_static(sym, freqs)
    assert (out.word_counts > 4).all()
    return out, 64, freqs, sym


def with_(b: RansBlocks, **kw: np.ndarray) -> RansBlocks:
    return RansBlocks(**{**{k: getattr(b, k) for k in ("states", "word_counts", "words")}, **kw})


def test_stream_fixture_round_trips(stream) -> None:
    out, steps, freqs, sym = stream
    np.testing.assert_array_equal(decode_static(out, steps, freqs), sym)


def test_truncated_words_inconsistent_counts(stream) -> None:
    out, steps, freqs, _ = stream
    with pytest.raises(RansDecodeError, match="sum"):
        decode_static(with_(out, words=out.words[:-1]), steps, freqs)


@pytest.mark.parametrize("cut", [1, 2, 5])
@pytest.mark.parametrize("where", ["end", "front"])
def test_truncated_words_consistent_counts(stream, cut: int, where: str) -> None:
    out, steps, freqs, _ = stream
    counts = out.word_counts.copy()
    if where == "end":
        counts[-1] -= cut
        words = out.words[:-cut]
    else:
        counts[0] -= cut
        words = out.words[cut:]
    with pytest.raises(RansDecodeError):
        decode_static(with_(out, word_counts=counts, words=words), steps, freqs)


@pytest.mark.parametrize("k", [0, 1, 17, 100, -40, -2, -1])
@pytest.mark.parametrize("bit", [0, 7, 15])
def test_flipped_word(stream, k: int, bit: int) -> None:
    out, steps, freqs, _ = stream
    words = out.words.copy()
    words[k] ^= np.uint16(1 << bit)
    with pytest.raises(RansDecodeError):
        decode_static(with_(out, words=words), steps, freqs)


@pytest.mark.parametrize("delta", [(1, -1, 0), (-1, 1, 0), (0, 3, -3), (2, 0, -2)])
def test_wrong_word_counts(stream, delta: tuple[int, int, int]) -> None:
    out, steps, freqs, _ = stream
    counts = (out.word_counts.astype(np.int64) + delta).astype(np.uint32)
    with pytest.raises(RansDecodeError):
        decode_static(with_(out, word_counts=counts), steps, freqs)


@pytest.mark.parametrize("value", [0, 1, RANS_L - 1])
def test_state_below_range(stream, value: int) -> None:
    out, steps, freqs, _ = stream
    states = out.states.copy()
    states[1, 5] = value
    with pytest.raises(RansDecodeError, match="RANS_L"):
        RansDecoder(with_(out, states=states), steps)


@pytest.mark.parametrize("value", [RANS_L, (1 << 32) - 1, 0xDEADBEEF])
def test_state_in_range_but_wrong(stream, value: int) -> None:
    out, steps, freqs, _ = stream
    states = out.states.copy()
    states[2, 0] = value
    with pytest.raises(RansDecodeError):
        decode_static(with_(out, states=states), steps, freqs)


def test_bad_dtypes_and_shapes(stream) -> None:
    out, steps, _, _ = stream
    bad = [
        with_(out, states=out.states.astype(np.int64)),
        with_(out, states=out.states[:, :16]),
        with_(out, word_counts=out.word_counts.astype(np.int32)),
        with_(out, word_counts=out.word_counts[:2]),
        with_(out, words=out.words.astype(np.uint32)),
        with_(out, words=out.words.reshape(1, -1)),
        with_(out, words=list(out.words)),
    ]
    for b in bad:
        with pytest.raises(RansDecodeError):
            RansDecoder(b, steps)
    with pytest.raises(RansDecodeError):
        RansDecoder(out, -1)


def test_wrong_step_count(stream) -> None:
    out, steps, freqs, _ = stream
    for n in (steps - 1, steps + 1):
        with pytest.raises(RansDecodeError):
            decode_static(out, n, freqs)


def test_advance_after_last_step_and_early_finish(stream) -> None:
    out, steps, freqs, _ = stream
    d = RansDecoder(out, 0)
    zeros = np.zeros((3, LANES), np.uint32)
    with pytest.raises(RansDecodeError):
        d.dec_advance(zeros, zeros + PROB_SCALE)
    with pytest.raises(RansDecodeError):
        RansDecoder(out, steps).finish()


def test_decode_error_is_value_error() -> None:
    assert issubclass(RansDecodeError, ValueError)


# ---------------------------------------------------------------- caller misuse


def test_encoder_rejects_bad_ops() -> None:
    ok_s = np.zeros((1, 2, LANES), np.uint32)
    ok_f = np.full((1, 2, LANES), 100, np.uint32)
    bad = [
        (ok_s, np.zeros_like(ok_f)),  # freq 0
        (ok_s + PROB_SCALE - 50, ok_f),  # start + freq > PROB_SCALE
        (ok_s, ok_f + PROB_SCALE),  # freq > PROB_SCALE
        (ok_s.astype(np.int64) - 1, ok_f),  # negative start
        (ok_s.astype(np.int64) + (1 << 32), ok_f),  # would wrap in uint32
        (ok_s[:, :, :16], ok_f[:, :, :16]),  # wrong lane count
        (ok_s, ok_f[:, :1]),  # shape mismatch
        (ok_s.astype(np.float64), ok_f),  # not integer
    ]
    for s, f in bad:
        with pytest.raises(ValueError):
            rans_encode(s, f)


def test_advance_rejects_slot_outside_symbol() -> None:
    out = rans_encode(np.zeros((1, 1, LANES), np.uint32), np.full((1, 1, LANES), 7, np.uint32))
    d = RansDecoder(out, 1)
    slots = d.dec_get()
    with pytest.raises(ValueError):
        d.dec_advance(slots + 1, np.ones_like(slots))
    with pytest.raises(ValueError):
        RansDecoder(out, 1).dec_advance(np.zeros((2, LANES)), np.ones((2, LANES)))
