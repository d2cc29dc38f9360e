"""Tests of the quantised tables (``speckv.coder.tables``): valid distributions,
rebuilt byte for byte from the manifest's mixture, tampered ones refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.coder.rans import PROB_SCALE
from speckv.coder.tables import (
    N_GAUSS,
    NOOP_TABLE,
    CodingTables,
    build_tables,
    quantize_freqs,
)
from speckv.predictor.store import default_checkpoint_dir


@pytest.fixture(scope="module")
def tables(ckpt) -> CodingTables:
    return ckpt.tables


# ---------------------------------------------------------------- tables


@settings(max_examples=100, deadline=None, database=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(1e-12, 1.0), st.floats(1e-300, 1e-12)),
                min_size=1, max_size=2000).filter(lambda p: sum(p) > 0))
def test_quantize_freqs(p):
    f = quantize_freqs(np.array(p))
    assert len(f) == len(p)
    f64 = f.astype(np.int64)
    assert f64.sum() == PROB_SCALE and f64.min() >= 1
    # every frequency but the most probable one is the rounded, clamped scaled probability
    pa = np.array(p) / sum(p) * PROB_SCALE
    want = np.maximum(1, np.round(pa))
    top = int(np.argmax(want))
    rest = np.arange(len(p)) != top
    assert np.array_equal(f64[rest], want[rest])


def test_quantize_freqs_limits():
    assert quantize_freqs(np.array([1.0])).tolist() == [PROB_SCALE]
    f = quantize_freqs(np.ones(PROB_SCALE // 2))
    assert f.astype(np.int64).sum() == PROB_SCALE and np.all(f == 2)
    f = quantize_freqs(np.r_[1.0, np.zeros(PROB_SCALE // 2 - 1)])
    assert f.astype(np.int64).sum() == PROB_SCALE and f.min() == 1
    with pytest.raises(ValueError):
        quantize_freqs(np.ones(PROB_SCALE // 2 + 1))


@pytest.fixture(scope="module")
def table_arrays():
    with np.load(default_checkpoint_dir() / "tables.npz", allow_pickle=False) as z:
        return {k: z[k].copy() for k in z.files}


def test_shipped_tables_are_consistent(tables, table_arrays):
    g = tables.gauss
    assert len(g.offset) == N_GAUSS + 1 and len(tables.radius) == N_GAUSS + 1
    assert tables.radius[NOOP_TABLE] == 0
    assert g.freq[g.offset[NOOP_TABLE]] == PROB_SCALE
    again = CodingTables.from_arrays(table_arrays)
    assert np.array_equal(again.gauss.freq, g.freq) and np.array_equal(again.radius, tables.radius)
    # every row: sums to PROB_SCALE, each >= 1, 2R+2 symbols, lookup inverts the cdf
    lens = np.diff(np.append(g.offset, len(g.freq)))
    assert np.array_equal(lens[:N_GAUSS], 2 * tables.radius[:N_GAUSS] + 2)
    slots = np.arange(PROB_SCALE)
    for t in range(N_GAUSS + 1):
        f = g.freq[g.offset[t]: g.offset[t] + lens[t]].astype(np.int64)
        assert f.sum() == PROB_SCALE and f.min() >= 1
        j = g.lookup[t * PROB_SCALE: (t + 1) * PROB_SCALE].astype(np.int64)
        cum = g.cum[g.offset[t] + j].astype(np.int64)
        assert np.all((cum <= slots) & (slots < cum + f[j]))


def test_shipped_tables_rebuild_from_the_manifest(ckpt, table_arrays):
    """tables.npz is exactly what build_tables makes of the pinned mixture."""
    mix = ckpt.manifest["mixture"]
    built = build_tables(tuple(mix["weights"]), mix["wide"])
    assert np.array_equal(built["gauss_len"], table_arrays["gauss_len"])
    assert np.array_equal(built["gauss_freq"].astype(np.int64), table_arrays["gauss_freq"].astype(np.int64))


def _tamper(arrays, how: str, rng) -> dict[str, np.ndarray]:
    a = {k: v.copy() for k, v in arrays.items()}
    freq = a["gauss_freq"].astype(np.int64)
    lens = a["gauss_len"].copy()
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    row = int(rng.integers(0, len(lens)))
    i = int(starts[row] + rng.integers(0, lens[row]))
    if how == "plus_one":
        freq[i] += 1
    elif how == "minus_one":
        freq[i] -= 1  # the row sums to PROB_SCALE - 1 (or holds a zero)
    elif how == "zero_freq":
        donor = int(starts[row] + np.argmax(freq[starts[row]: starts[row] + lens[row]]))
        j = int(starts[row]) if donor != starts[row] else int(starts[row]) + 1
        freq[donor] += freq[j]
        freq[j] = 0  # sum still PROB_SCALE, but a symbol can no longer be coded
    elif how == "move_symbol":
        lens[row] += 1
        lens[(row + 1) % len(lens)] -= 1
    elif how == "drop_row":
        lens = lens[:-1]
        freq = freq[: int(lens.sum())]
    elif how == "extra_row":
        lens = np.append(lens, 4)
        freq = np.append(freq, [PROB_SCALE - 3, 1, 1, 1])
    elif how == "truncate":
        freq = freq[:-1]
    elif how == "tiny_row":
        lens = lens.copy()
        lens[row] = 2  # rows have at least one symbol each side of mu plus ESC
        lens[(row + 1) % len(lens)] += int(a["gauss_len"][row]) - 2
    a["gauss_freq"] = freq.astype(a["gauss_freq"].dtype)
    a["gauss_len"] = lens
    return a


@pytest.mark.parametrize("how", ["plus_one", "minus_one", "zero_freq", "move_symbol", "drop_row",
                                 "extra_row", "truncate", "tiny_row"])
def test_from_arrays_rejects_tampered_tables(table_arrays, how):
    rng = np.random.default_rng(len(how))
    for _ in range(5):
        with pytest.raises(ValueError):
            CodingTables.from_arrays(_tamper(table_arrays, how, rng))
