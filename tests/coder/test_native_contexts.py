"""The native model's contexts against numpy's ``model.context`` (through
``ContextTable``, which tabulates it): every BF16 mu pattern at every sigma level in a
wide range, on the integer path the CPU coder runs, on the float reference path the
CUDA kernels run, and in the per-level rows ``NativeCoder`` looks contexts up in."""
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


@pytest.mark.parametrize("float_path", [False, True], ids=["integer", "float"])
def test_every_bf16_pattern_at_every_level(reference, float_path):
    mu = np.tile(np.arange(1 << 16, dtype=np.uint16), len(reference.levels))
    L = np.repeat(reference.levels, 1 << 16).astype(np.int32)
    out = np.empty(len(mu), np.uint32)
    native._native.contexts(False, mu, L, out, float_path)
    bad = np.flatnonzero(out != reference.packed)
    assert len(bad) == 0, f"{len(bad)} contexts differ, first mu {mu[bad[0]]:#06x} at level {L[bad[0]]}"


def test_context_rows_index_and_grow(reference):
    rows = native.ContextRows()
    lg = np.array([[5, -30], [5, 7]])
    idx, table = rows.index(lg)
    assert idx.shape == lg.shape and idx.dtype == np.int32 and len(table) == 3 << 16
    for level, r in ((5, idx[0, 0]), (-30, idx[0, 1]), (7, idx[1, 1])):
        want = reference.packed[int(np.flatnonzero(reference.levels == level)[0]) << 16:][:1 << 16]
        assert np.array_equal(table[r << 16:(r + 1) << 16], want), level
    assert idx[0, 0] == idx[1, 0]
    idx2, table2 = rows.index(np.array([-30, 9]))  # one new level: one new row, old rows kept
    assert len(table2) == 4 << 16 and idx2[0] == idx[0, 1] and np.array_equal(table2[:3 << 16], table)


def test_a_row_outside_the_table_is_refused(ckpt):
    need_native()
    nat = native.NativeCoder(1)
    model_tables = ckpt.tables
    x = np.zeros((1, 2, 3, 1, 64), np.uint16)
    bad_rows = np.full((1, 2, 3, 64), 1, np.int32)  # the table below has one row
    table = np.zeros(1 << 16, np.uint32)
    with pytest.raises(ValueError, match="outside ctx_table"):
        native._native.encode(False, x, x, bad_rows, 3, 1, 64, 8, [1], *nat.flat(model_tables).args(), 1, table)
    with pytest.raises(ValueError, match="65536 per row"):
        native._native.encode(False, x, x, bad_rows * 0, 3, 1, 64, 8, [1], *nat.flat(model_tables).args(), 1,
                              table[:100])
