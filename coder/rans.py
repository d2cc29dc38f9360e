"""Interleaved rANS core (ryg_rans / dietgpu style), vectorised with numpy.

This module knows nothing about symbols or models: the caller supplies, per
op, the symbol's cumulative frequency ``start`` and its ``freq`` (summing to
``PROB_SCALE`` over the alphabet).  Ops are laid out as ``(blocks, steps,
LANES)``: op ``s`` of lane ``l`` in block ``b``.  A block is one warp of
``LANES`` independent rANS states that share one word stream.

Lifecycle::

    blocks = rans_encode(start, freq)        # (blocks, steps, LANES) -> RansBlocks
    d = RansDecoder(blocks, steps)
    for s in range(steps):                   # NOTE: forward; encoder ran backward
        slots = d.dec_get()                  # (blocks, LANES) in [0, PROB_SCALE)
        start_s, freq_s = model(slots)       # caller's slot -> symbol lookup
        d.dec_advance(start_s, freq_s)
    d.finish()                               # integrity check (raises on corruption)

Byte layout (a CUDA kernel reproduces it bit for bit):

* every lane starts encoding at state ``RANS_L``; the final encoder states are
  the decoder's initial states (``RansBlocks.states``);
* at each encoder step, the lanes of a block that renormalise write one 16-bit
  word each, contiguously in ascending lane order (warp ballot + popcount),
  appended after that block's words of the previous encoder step;
* ``RansBlocks.words`` concatenates the blocks in block order, each in encoder
  order (op ``steps - 1`` first).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from speckv.errors import RansDecodeError

PROB_BITS = 15  # frequencies are PROB_BITS-bit fixed point
PROB_SCALE = 1 << PROB_BITS  # frequencies of an alphabet sum to this
PROB_MASK = PROB_SCALE - 1  # state & PROB_MASK = decoder slot
LANES = 32  # lanes per block: one warp
WORD_BITS = 16  # renormalisation word size (uint16 words)
WORD_MASK = (1 << WORD_BITS) - 1
RANS_L = 1 << 16  # state lower bound; state in [RANS_L, 2**32) between ops
STATE_BITS = 32  # states are uint32

# Encoder renormalises when x >= x_max = ((RANS_L >> PROB_BITS) << WORD_BITS) * freq.
# NOTE: x_max = 2**17 * freq reaches 2**32 for freq == PROB_SCALE and overflows a
# uint32, so we test the equivalent (x >> X_MAX_SHIFT) >= freq (exact, because
# x_max is freq times a power of two).  That also keeps the padding no-op
# (start=0, freq=PROB_SCALE) from ever renormalising: x >> 17 < 2**15.
X_MAX_UNIT = (RANS_L >> PROB_BITS) << WORD_BITS  # 2**17
X_MAX_SHIFT = X_MAX_UNIT.bit_length() - 1  # 17
assert X_MAX_UNIT == 1 << X_MAX_SHIFT
# At most one word per op: x < 2**32, so after one shift x < 2**16 <= x_max
# (freq >= 1).  The decoder mirrors this: after advancing, x >= 2 * freq >= 2,
# so one word (x << 16 | w) is enough to get back above RANS_L.
assert STATE_BITS - WORD_BITS <= X_MAX_SHIFT
assert RANS_L == 1 << (STATE_BITS - WORD_BITS)

_U32 = np.uint32
_U16 = np.uint16


@dataclass(frozen=True)
class RansBlocks:
    """Encoder output: everything the decoder needs besides ``steps``."""

    states: np.ndarray  # (blocks, LANES) uint32, final encoder = decoder initial states
    word_counts: np.ndarray  # (blocks,) uint32
    words: np.ndarray  # (sum(word_counts),) uint16, block order, each in encoder order


def _check_ops(start: np.ndarray, freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate encoder input; return it as uint32 (no copy if already uint32)."""
    start = np.asarray(start)
    freq = np.asarray(freq)
    if start.shape != freq.shape or start.ndim != 3 or start.shape[2] != LANES:
        raise ValueError(
            f"start/freq must both have shape (blocks, steps, {LANES}); "
            f"got {start.shape} and {freq.shape}"
        )
    for name, a in (("start", start), ("freq", freq)):
        if not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{name} must be an integer array, got {a.dtype}")
    if freq.size == 0:
        return start.astype(_U32, copy=False), freq.astype(_U32, copy=False)
    # Range checks on the caller's dtype, before the cast could wrap.
    if freq.min() < 1 or freq.max() > PROB_SCALE:
        raise ValueError(f"every freq must be in [1, {PROB_SCALE}]")
    if start.min() < 0 or start.max() >= PROB_SCALE:
        raise ValueError(f"every start must be in [0, {PROB_SCALE})")
    start, freq = start.astype(_U32, copy=False), freq.astype(_U32, copy=False)
    if np.add(start, freq).max() > PROB_SCALE:  # < 2**16: no uint32 overflow
        raise ValueError(f"need start + freq <= {PROB_SCALE}")
    return start, freq


def rans_encode(start: np.ndarray, freq: np.ndarray, validate: bool = True) -> RansBlocks:
    """Encode ops ``(start, freq)``, each of shape (blocks, steps, LANES).

    ``validate=False`` skips the range checks for ops taken from verified tables
    (shapes are still checked)."""
    if validate:
        start, freq = _check_ops(start, freq)
    elif start.ndim != 3 or start.shape != freq.shape or start.shape[2] != LANES:
        raise ValueError(f"start/freq must both have shape (blocks, steps, {LANES})")
    else:
        start, freq = start.astype(_U32, copy=False), freq.astype(_U32, copy=False)
    n_blocks, steps, _ = start.shape
    x = np.full((n_blocks, LANES), RANS_L, dtype=_U32)  # (blocks, LANES) states
    q = np.empty_like(x)  # scratch: x // freq, also x >> X_MAX_SHIFT
    r = np.empty_like(x)  # scratch: x % freq, also the renorm shift
    # Per encoder step j (= op steps-1-j): candidate word and emit mask per lane.
    words = np.empty((n_blocks, steps, LANES), dtype=_U16)
    emit = np.empty((n_blocks, steps, LANES), dtype=bool)
    # NOTE: rANS is LIFO: encode the last op first so the decoder runs forward.
    for j, s in enumerate(range(steps - 1, -1, -1)):
        f = freq[:, s, :]  # (blocks, LANES)
        e = emit[:, j, :]
        # Renormalise: x >= x_max  <=>  (x >> X_MAX_SHIFT) >= freq (see NOTE above).
        np.right_shift(x, X_MAX_SHIFT, out=q)
        np.greater_equal(q, f, out=e)
        np.copyto(words[:, j, :], x, casting="unsafe")  # low WORD_BITS bits of x
        # x >>= WORD_BITS where e, as a per-lane shift (faster than where=).
        np.multiply(e, _U32(WORD_BITS), out=r)
        np.right_shift(x, r, out=x)
        # Encode: x = ((x // freq) << PROB_BITS) + (x % freq) + start.
        np.divmod(x, f, out=(q, r))
        np.left_shift(q, PROB_BITS, out=x)
        x += r
        x += start[:, s, :]
    # Row-major mask order = block, then encoder step, then lane: exactly the
    # ballot-compacted word order of every block, blocks concatenated.
    # (np.compress == words[emit], several times faster on random masks.)
    return RansBlocks(
        states=x,
        word_counts=emit.sum(axis=(1, 2), dtype=_U32),
        words=np.compress(emit.ravel(), words.ravel()),
    )


class RansDecoder:
    """Decode all blocks in lockstep, one op (step) per ``dec_advance``."""

    def __init__(self, blocks: RansBlocks, steps: int) -> None:
        states, counts, words = _check_blocks(blocks)
        if not isinstance(steps, (int, np.integer)) or steps < 0:
            raise RansDecodeError(f"steps must be a non-negative int, got {steps!r}")
        self.steps = int(steps)
        self.step = 0  # ops decoded so far
        self._x = states.copy()  # (blocks, LANES) uint32 states
        self._words = words  # (total_words,) uint16
        ends = np.cumsum(counts, dtype=np.int64)  # (blocks,)
        self._lo = ends - counts.astype(np.int64)  # (blocks,) first word of each block
        # NOTE: the decoder reads each block's words backward, from its end.
        self._end = ends  # (blocks,) one past the last unread word of each block
        self._tmp = np.empty_like(self._x)  # scratch (blocks, LANES)
        self._need = np.empty(self._x.shape, dtype=bool)  # lanes reading a word

    def dec_get(self) -> np.ndarray:
        """Current slots ``state & PROB_MASK``, shape (blocks, LANES) uint32."""
        return self._x & _U32(PROB_MASK)

    def dec_advance(self, start: np.ndarray, freq: np.ndarray) -> None:
        """Consume the op whose symbol (start, freq), (blocks, LANES), owns each slot.

        The caller's (start, freq) are trusted to obey the op constraints; a
        slot outside [start, start + freq) raises ValueError (a model bug, not a
        corrupt stream).  After any error the decoder is unusable.
        """
        if self.step >= self.steps:
            raise RansDecodeError(f"all {self.steps} steps already decoded")
        x, tmp = self._x, self._tmp
        start = np.asarray(start, dtype=_U32)
        freq = np.asarray(freq, dtype=_U32)
        if start.shape != x.shape or freq.shape != x.shape:
            raise ValueError(f"start/freq must have shape {x.shape}")
        # x = freq * (x >> PROB_BITS) + slot - start
        np.right_shift(x, PROB_BITS, out=tmp)
        np.multiply(tmp, freq, out=tmp)
        np.bitwise_and(x, PROB_MASK, out=x)
        x -= start  # slot - start, wraps (uint32) if the caller's model is wrong
        if not (x < freq).all():
            raise ValueError("dec_advance: (start, freq) does not contain the slot")
        x += tmp
        np.less(x, RANS_L, out=self._need)
        if self._need.any():
            self._renorm()
        self.step += 1

    def _renorm(self) -> None:
        """Lanes with x < RANS_L read one word: x = (x << WORD_BITS) | word."""
        x, tmp, need = self._x, self._tmp, self._need
        # Ballot + popcount as an inclusive prefix count over the lanes (integer
        # cumsum: no BLAS, whose thread pool made a matmul here erratic).
        incl = np.cumsum(need.view(np.uint8), axis=1, dtype=np.int64)  # (blocks, LANES)
        # NOTE: a block's `count` needing lanes read its last `count` unread words;
        # the lane of rank k reads word end - count + k.
        self._end -= incl[:, LANES - 1]
        if (self._end < self._lo).any():
            bad = int(np.flatnonzero(self._end < self._lo)[0])
            raise RansDecodeError(
                f"block {bad}: read past the start of its words at step {self.step}"
            )
        pos = incl - need  # exclusive rank
        pos += self._end[:, None]  # (blocks, LANES); only `need` lanes are valid
        w = np.take(self._words, pos, mode="clip")  # (blocks, LANES) uint16
        # x = need ? (x << WORD_BITS) | w : x, branch-free (faster than where=).
        np.multiply(need, _U32(WORD_BITS), out=tmp)
        np.left_shift(x, tmp, out=x)
        np.multiply(w, need, out=tmp)
        x |= tmp

    def finish(self) -> None:
        """Check every op decoded, all words consumed, every state back at RANS_L."""
        if self.step != self.steps:
            raise RansDecodeError(f"decoded {self.step} of {self.steps} steps")
        left = self._end - self._lo
        if left.any():
            bad = int(np.flatnonzero(left)[0])
            raise RansDecodeError(f"block {bad}: {int(left[bad])} words left unread")
        if (self._x != RANS_L).any():
            bad = int(np.flatnonzero((self._x != RANS_L).any(axis=1))[0])
            raise RansDecodeError(f"block {bad}: final state is not RANS_L (corrupt)")


def _check_blocks(blocks: RansBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate untrusted stream data; return (states, word_counts, words)."""
    states, counts, words = blocks.states, blocks.word_counts, blocks.words
    for name, a, dtype in (
        ("states", states, _U32),
        ("word_counts", counts, _U32),
        ("words", words, _U16),
    ):
        if not isinstance(a, np.ndarray) or a.dtype != dtype:
            raise RansDecodeError(f"{name} must be a {np.dtype(dtype)} ndarray")
    if states.ndim != 2 or states.shape[1] != LANES:
        raise RansDecodeError(f"states must have shape (blocks, {LANES}), got {states.shape}")
    if counts.shape != (states.shape[0],):
        raise RansDecodeError(
            f"word_counts must have shape ({states.shape[0]},), got {counts.shape}"
        )
    if words.ndim != 1 or int(counts.sum(dtype=np.int64)) != words.shape[0]:
        raise RansDecodeError(
            f"sum(word_counts) = {int(counts.sum(dtype=np.int64))} != "
            f"len(words) = {words.size}"
        )
    if states.size and states.min() < RANS_L:  # upper bound 2**32 holds by dtype
        raise RansDecodeError(f"a state is below RANS_L = {RANS_L}")
    return states, counts, words


def concat_blocks(parts: Sequence[RansBlocks]) -> RansBlocks:
    if len(parts) == 1:
        return parts[0]
    return RansBlocks(states=np.concatenate([p.states for p in parts]),
                      word_counts=np.concatenate([p.word_counts for p in parts]),
                      words=np.concatenate([p.words for p in parts]))


def split_blocks(b: RansBlocks, spans: Sequence[int]) -> list[RansBlocks]:
    """Split a batch's RansBlocks back into per-chunk parts (``spans`` blocks each)."""
    out, b0, w0 = [], 0, 0
    for n in spans:
        wc = b.word_counts[b0:b0 + n]
        w1 = w0 + int(wc.sum(dtype=np.int64))
        out.append(RansBlocks(states=b.states[b0:b0 + n], word_counts=wc, words=b.words[w0:w1]))
        b0, w0 = b0 + n, w1
    return out
