"""Quantised probability tables: the only place floats touch the coder.

Lifecycle: at checkpoint build, ``build_tables(calib)`` evaluates the
mixture in float64 once and quantises every distribution to integer
frequencies summing to ``PROB_SCALE`` (each >= 1); they are stored in the
checkpoint (``tables.npz``, covered by the pin). At load, ``CodingTables``
derives cumulative frequencies and slot -> symbol lookups from those
integers only, so every backend (numpy, CUDA) codes with identical tables.

Table ``t`` (sigma_b = 2^((t + LAMBDA_MIN) / SIGMA_ONE) bins): symbols
``d = -R..R`` (bin distance to mu's bin) then ESC; ``p(d) = w0 N(d; sigma_b) +
w1 N(d; wide sigma_b)`` over ``[d-1/2, d+1/2]``, ``p(ESC) = w2 + the Gaussian
tails beyond R``. Escaped symbols travel raw (16 or 8 bits): on real KV they
are ~1e-7 of all scalars, so the empirical third component is not modelled.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .rans import PROB_BITS, PROB_SCALE, RansBlocks, RansDecoder

SIGMA_FRAC_BITS = 3  # log2(sigma) is stored in 1/8-octave steps
SIGMA_ONE = 1 << SIGMA_FRAC_BITS
GRID_BELOW_SIGMA = 4  # bins are at most sigma / 2^4 wide
LAMBDA_MIN = -5 * SIGMA_ONE  # sigma_b below 1/32 bin: clamped up to it
LAMBDA_MAX = (GRID_BELOW_SIGMA + 1) * SIGMA_ONE - 1  # largest sigma_b the grid allows
OFFSET_BITS = 3  # mu's position inside its bin, in 1/8 steps ...
OFFSETS = 1 << OFFSET_BITS
LAMBDA_OFFSET = 1 * SIGMA_ONE  # ... matters while sigma_b < 2 bins; above, mu sits mid-bin
N_GAUSS = (LAMBDA_OFFSET - LAMBDA_MIN) * OFFSETS + (LAMBDA_MAX - LAMBDA_OFFSET + 1)
TAIL_SIGMAS = 4.0  # the window reaches 4 sigma of the wide Gaussian
NOOP_TABLE = N_GAUSS  # the row after the Gaussian ones: padding no-op
# Forward-adaptive sigma (format version 4): a coded chunk's aux carries one signed shift of
# L per (layer, kv, head), in 1/8 octaves (one i8 each); the model codes with L + shift.
SHIFT_MAX = 127  # |shift| <= SHIFT_MAX (the i8 -128 is rejected: the set is symmetric)


def quantize_freqs(p: np.ndarray) -> np.ndarray:
    """Integer frequencies summing to PROB_SCALE, each >= 1, close to ``p * PROB_SCALE``.

    NOTE: the remainder goes to (or comes from) the most probable symbol, which
    keeps every other frequency as rounded and never drops one below 1.
    """
    p = np.asarray(p, np.float64)
    if len(p) > PROB_SCALE // 2:
        raise ValueError(f"{len(p)} symbols do not fit {PROB_BITS}-bit frequencies")
    f = np.maximum(1, np.round(p / p.sum() * PROB_SCALE)).astype(np.int64)
    top = int(np.argmax(f))
    f[top] += PROB_SCALE - int(f.sum())
    assert f[top] >= 1 and f.sum() == PROB_SCALE
    return f.astype(np.uint16)


def _phi(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def gauss_table(lam: int, f: float, mixture: tuple[float, float, float], wide: float) -> np.ndarray:
    """Frequencies of d = -R..R then ESC, for sigma_b = 2^(lam / SIGMA_ONE) bins and mu
    at position f in [0, 1) of its bin: bin d spans [d - f, d + 1 - f] around mu."""
    sb = 2.0 ** (lam / SIGMA_ONE)
    radius = gauss_radius(lam, wide)
    p = np.zeros(2 * radius + 2)
    for sd, wt in ((sb, mixture[0]), (sb * wide, mixture[1])):
        cdf = np.array([_phi((v - f) / sd) for v in range(-radius, radius + 2)])
        p[:-1] += wt * np.diff(cdf)
        p[-1] += wt * (cdf[0] + (1.0 - cdf[-1]))  # tails beyond the window escape
    p[-1] += mixture[2]
    return quantize_freqs(p)


def table_row(lam: np.ndarray, off: np.ndarray) -> np.ndarray:
    """Row of the table family for log2 sigma_b = lam / SIGMA_ONE and mu's offset (integers)."""
    lam = np.clip(lam, LAMBDA_MIN, LAMBDA_MAX)
    split = (LAMBDA_OFFSET - LAMBDA_MIN) * OFFSETS
    return np.where(lam < LAMBDA_OFFSET, (lam - LAMBDA_MIN) * OFFSETS + off, split + lam - LAMBDA_OFFSET)


def table_params() -> list[tuple[int, float]]:
    """(lam, f) of every row, in row order."""
    rows = [(lam, (o + 0.5) / OFFSETS) for lam in range(LAMBDA_MIN, LAMBDA_OFFSET) for o in range(OFFSETS)]
    return rows + [(lam, 0.5) for lam in range(LAMBDA_OFFSET, LAMBDA_MAX + 1)]


def gauss_radius(lam: int, wide: float) -> int:
    return int(math.ceil(TAIL_SIGMAS * wide * 2.0 ** (lam / SIGMA_ONE))) + 1


def build_tables(mixture: tuple[float, float, float], wide: float) -> dict[str, np.ndarray]:
    """Every quantised table, as the integer arrays stored in ``tables.npz``."""
    gauss = [gauss_table(lam, f, mixture, wide) for lam, f in table_params()]
    return {"gauss_freq": np.concatenate(gauss), "gauss_len": np.array([len(g) for g in gauss], np.int64)}


def cumulative(freq: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums along the last axis (uint32)."""
    f = freq.astype(np.uint32)
    c = np.cumsum(f, axis=-1, dtype=np.uint32) - f
    return c


def slot_lookup(freq: np.ndarray) -> np.ndarray:
    """slot -> symbol index for one table (PROB_SCALE entries)."""
    n = len(freq)
    dtype = np.uint8 if n <= 256 else np.uint16
    return np.repeat(np.arange(n, dtype=dtype), freq.astype(np.int64))


@dataclass
class Table:
    """One flat family of tables: freq/cum by (offset + symbol), lookup by (index * SCALE + slot)."""

    freq: np.ndarray  # (total symbols,) uint32
    cum: np.ndarray  # (total symbols,) uint32
    offset: np.ndarray  # (tables,) int32, first symbol of each table

    @classmethod
    def from_rows(cls, rows: list[np.ndarray]) -> "Table":
        lens = np.array([len(r) for r in rows], np.int64)
        offset = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
        freq = np.concatenate(rows).astype(np.uint32)
        cum = np.concatenate([cumulative(r) for r in rows])
        return cls(freq=freq, cum=cum, offset=offset)

    @functools.cached_property
    def lookup(self) -> np.ndarray:
        """(tables * PROB_SCALE,) uint16: each slot's symbol index within its table. NOTE: 2 bytes
        a slot (26 MB per model here), and only the numpy decoder reads it: built on its first use."""
        ends = np.append(self.offset[1:].astype(np.int64), len(self.freq))
        return np.concatenate([slot_lookup(self.freq[a:b]).astype(np.uint16)
                               for a, b in zip(self.offset.astype(np.int64), ends, strict=True)])


@dataclass
class CodingTables:
    """The integer tables the coder uses, derived from ``tables.npz`` arrays.

    Row ``NOOP_TABLE`` (after the Gaussian rows) has a single symbol of
    frequency PROB_SCALE: the padding op, which leaves a rANS state unchanged.
    """

    gauss: Table
    radius: np.ndarray  # (N_GAUSS + 1,) int32: window radius R of each table

    @classmethod
    def from_arrays(cls, a: dict[str, np.ndarray]) -> "CodingTables":
        lens = a["gauss_len"].astype(np.int64)
        if len(lens) != N_GAUSS or int(lens.sum()) != len(a["gauss_freq"]) or (lens < 4).any():
            raise ValueError("tables.npz: Gaussian table sizes do not match this coder version")
        rows = np.split(a["gauss_freq"], np.cumsum(lens)[:-1])
        for r in rows:
            if int(r.astype(np.int64).sum()) != PROB_SCALE or int(r.min()) < 1:
                raise ValueError("tables.npz: a table does not sum to PROB_SCALE with freq >= 1")
        rows.append(np.array([PROB_SCALE], np.uint32))  # NOOP_TABLE
        return cls(gauss=Table.from_rows(rows), radius=np.append((lens - 2) // 2, 0).astype(np.int32))

    @classmethod
    def load(cls, path: Path) -> "CodingTables":
        with np.load(path, allow_pickle=False) as z:
            return cls.from_arrays({k: z[k] for k in z.files})


def decode_symbols(coding: CodingTables, blocks: RansBlocks, tables: np.ndarray, el: int) -> np.ndarray:
    """Symbol indices (blocks, el, LANES) of one group of blocks, each element's table
    ``tables[block, step, lane]`` a row of ``coding.gauss`` (the numpy decode loop)."""
    g = coding.gauss
    # NOTE: step-major copy, so each step reads a contiguous (blocks, LANES) slab
    steps = np.ascontiguousarray(tables.transpose(1, 0, 2))
    js = np.empty(steps.shape, np.int32)
    dec = RansDecoder(blocks, el)
    for s in range(el):
        t = steps[s]
        j = g.lookup[t * np.int32(PROB_SCALE) + dec.dec_get().view(np.int32)]
        idx = g.offset[t] + j
        dec.dec_advance(g.cum[idx], g.freq[idx])
        js[s] = j
    dec.finish()
    return js.transpose(1, 0, 2)
