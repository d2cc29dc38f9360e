"""Corruption parity of the native CPU coder and the numpy reference: every corrupt
stream (bytes flipped with the crc recomputed, structurally repacked chunks with cut or
grown bit sections, dropped / added / moved rANS words and changed or swapped states,
truncated records, a zeroed block) meets the same fate on both backends: the same
exception type (and, for value checks, the same message), or identical decoded arrays,
also before the raw-digest check, at any thread count, and on every native path (there to
the message, rANS errors included).

A missing extension skips these tests on a developer's machine and fails them in
CI (SPECKV_REQUIRE_NATIVE, tests/require.py).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from codec_helpers import (
    ALL_CODES,
    SCALES,
    bf16_tensor,
    chunk_areas,
    fp8_mu,
    ids_for,
    recrc,
    tile,
    unguarded_records,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from native_helpers import MODELS, assert_same_kv, both_ways, realistic_pair

from speckv.coder import container as ct
from speckv.coder import native
from speckv.coder.codec import Codec, Fp8KV
from speckv.coder.model import BF16, E4M3
from speckv.coder.plan import chunk_scales, chunk_shifts
from speckv.errors import RansDecodeError, SpeckvError

# NaN / Inf / overflowing inputs are the point here: numpy's warnings are noise
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------------------ corruption


def _outcome(codec: Codec, records: list[bytes], ids: np.ndarray, mu):
    """("ok", kv) or (exception type, message) of a whole-stream decode."""
    try:
        return "ok", codec.decode(records, ids, mu)
    except SpeckvError as e:
        return type(e), str(e)


def _raw_outcome(codec: Codec, records: list[bytes], ids: np.ndarray, mu):
    """The backend's decode of the chunks BEFORE the raw-digest check: ("ok", arrays)
    or (exception type, message). A corrupt stream that decodes without a symbol error
    must give the same (wrong) values on both backends, not merely fail its checksum."""
    try:
        h, _ = ct.unpack_header(records[0])
        chunks = [ct.unpack_chunk(r, h)[0] for r in records[1:]]
        if [c.index for c in chunks] != list(range(h.n_chunks)):
            return "indices", [c.index for c in chunks]  # decode_chunks' own check, before any backend
        fmt = BF16 if h.dtype == ct.DTYPE_BF16 else E4M3
        scales = chunk_scales(h, chunks) if fmt is E4M3 else None
        shifts = chunk_shifts(h, chunks)
        plan = codec._plan(None, ids, mu, fmt, scales, model_id=h.model)
        plan = plan if shifts is None else plan.shifted(shifts)
        coded = [c for c in chunks if not ct.is_stored_chunk(h, c)]  # stored chunks meet no backend
        return "ok", [np.asarray(b).astype(np.int64).ravel() for b in codec._decode_batch(plan, h, coded)]
    except SpeckvError as e:
        return type(e), str(e)


def _same_fate(a, b) -> None:
    kind_a, val_a = a
    kind_b, val_b = b
    assert kind_a == kind_b, f"numpy: {kind_a} {val_a if kind_a != 'ok' else ''}; native: {kind_b} " \
                             f"{val_b if kind_b != 'ok' else ''}"
    if kind_a == "ok":
        if isinstance(val_a, list):
            assert len(val_a) == len(val_b)
            for p, q in zip(val_a, val_b, strict=True):
                assert np.array_equal(p, q)
        else:
            assert_same_kv(val_a, val_b)
    elif kind_a is not RansDecodeError:
        # value checks: the native message is numpy's, prefixed with the chunk
        # (rANS errors name blocks differently: numpy counts across the batch)
        assert val_b == val_a or val_b.endswith(": " + val_a), (val_a, val_b)


@pytest.fixture(scope="module")
def corrupt_base(codecs):
    """Valid streams to corrupt, BF16 (3 chunks) and FP8 (2 chunks) under each residual
    model, with escapes, zero bins and normal elements; the FP8 ones in format version 2
    (every chunk coded: version 3's size guard stores both), and a version 3 BF16 stream
    whose middle chunk is stored (``bf16-mixed``)."""
    x, mu = realistic_pair(1, 4)
    codes = tile(ALL_CODES, 1, seed=2)
    kv8, mu8 = Fp8KV(codes, SCALES["mixed"]), fp8_mu(codes, SCALES["mixed"], "near")
    out = {}
    for mdl in MODELS:
        for name, kv, m, lpc in (("bf16", x, mu, 10), ("fp8", kv8, mu8, 15)):
            recs = both_ways(codecs, kv, ids_for(1), m, 16, lpc, mdl)
            if name == "fp8":
                recs = unguarded_records(codecs("numpy", 16, lpc, 2, mdl), kv, ids_for(1), m)
            h, _ = ct.unpack_header(recs[0])
            assert not any(ct.is_stored_chunk(h, ct.unpack_chunk(r, h)[0]) for r in recs[1:])
            out[f"{name}-{mdl}"] = (recs, bf16_tensor(m), mdl, lpc)
    cn = codecs("numpy", 16, 10, 2, "tuned")
    h = cn.stream_header(True, x.shape, ids_for(1))
    mixed = [ct.pack_header(h)] + [ct.pack_chunk(c) for c in cn.encode_chunks(h, range(3), x, mu, stored={1})]
    assert [ct.is_stored_chunk(h, ct.unpack_chunk(r, h)[0]) for r in mixed[1:]] == [False, True, False]
    out["bf16-mixed"] = (mixed, bf16_tensor(mu), "tuned", 10)
    return _Quiet(out)


class _Quiet(dict):
    """A dict that hypothesis reports in a few characters (not megabytes of records)."""

    def __repr__(self) -> str:
        return f"<streams {sorted(self)}>"


def _mutate_chunk(c: ct.Chunk, kind: str, a: int, b: int) -> ct.Chunk:
    """A structurally valid chunk (its record packs and parses) with one part changed."""
    rng = np.random.default_rng(a * 7919 + b)
    if kind == "bits_cut":
        return replace(c, bits=c.bits[: max(len(c.bits) - 1 - a % 64, 0)])
    if kind == "bits_grow":
        return replace(c, bits=c.bits + bytes([b & 0xFF]) * (1 + a % 9))
    if kind == "bits_byte":
        if not c.bits:
            return c
        bits = bytearray(c.bits)
        bits[a % len(bits)] ^= 1 + b % 255
        return replace(c, bits=bytes(bits))
    if kind == "word_drop":  # one word less (its block's count too)
        nz = np.flatnonzero(c.word_counts)
        if not len(nz):
            return c
        blk = int(nz[a % len(nz)])
        start = int(c.word_counts[:blk].sum())
        pos = start + b % int(c.word_counts[blk])
        counts = c.word_counts.copy()
        counts[blk] -= 1
        return replace(c, word_counts=counts, words=np.delete(c.words, pos))
    if c.n_blocks == 0 and kind in ("word_add", "state", "state_swap"):  # a stored chunk
        return c
    if kind == "word_add":
        blk = a % c.n_blocks
        pos = int(c.word_counts[: blk + 1].sum()) - b % (int(c.word_counts[blk]) + 1)
        counts = c.word_counts.copy()
        counts[blk] += 1
        return replace(c, word_counts=counts, words=np.insert(c.words, pos, np.uint16(rng.integers(0, 1 << 16))))
    if kind == "word_move":  # a word's worth of count from one block to the next
        if c.n_blocks < 2:
            return c
        blk = a % (c.n_blocks - 1)
        counts = c.word_counts.astype(np.int64)
        if counts[blk] == 0:
            return c
        counts[blk] -= 1
        counts[blk + 1] += 1
        return replace(c, word_counts=counts.astype(np.uint32))
    if kind == "state":  # any value, below RANS_L included
        states = c.states.copy()
        states.reshape(-1)[a % states.size] = np.uint32(rng.integers(0, 1 << 32, dtype=np.uint64))
        return replace(c, states=states)
    if kind == "state_swap":
        states = c.states.copy().reshape(-1)
        i, j = a % states.size, b % states.size
        states[i], states[j] = states[j], states[i]
        return replace(c, states=states.reshape(c.states.shape))
    raise ValueError(kind)


CORRUPT = ["bf16-tuned", "fp8-seed", "bf16-seed", "fp8-tuned", "bf16-mixed"]  # corrupt_base's streams
MUTATIONS = ["bits_cut", "bits_grow", "bits_byte", "word_drop", "word_add", "word_move", "state", "state_swap"]


def _check_corrupt(codecs, base, which: str, records: list[bytes]) -> None:
    _, mu, mdl, lpc = base[which]
    ids = ids_for(1)
    cn, cv = codecs("numpy", 16, lpc, 2, mdl), codecs("native", 16, lpc, 2, mdl)
    _same_fate(_outcome(cn, records, ids, mu), _outcome(cv, records, ids, mu))
    raw = _raw_outcome(cn, records, ids, mu)
    _same_fate(raw, _raw_outcome(cv, records, ids, mu))
    if currently_in_test_context():  # --hypothesis-show-statistics: what the corruptions hit
        event(f"before the checksum: {raw[0] if isinstance(raw[0], str) else raw[0].__name__}")
    cv1 = codecs("native", 16, lpc, 1, mdl)  # the thread count never changes the verdict
    _same_fate(_raw_outcome(cn, records, ids, mu), _raw_outcome(cv1, records, ids, mu))
    _same_on_every_path(cv, records, ids, mu)


def _same_on_every_path(cv: Codec, records: list[bytes], ids: np.ndarray, mu) -> None:
    """The native paths' fates before the checksum, rANS errors included, are one another's to the
    message: the scalar stages ("lookup") and, where "auto" runs the AVX-512 builds (its rANS decode
    steps among them), the AVX2 ones ("vector")."""
    backend = cv.backend
    want = _raw_outcome(cv, records, ids, mu)
    try:
        for path in ["lookup"] + (["vector"] if native.wide_path() else []):
            backend.path = path
            got = _raw_outcome(cv, records, ids, mu)
            assert got[0] == want[0], (path, got[0], want[0])
            if want[0] == "ok":
                assert all(np.array_equal(p, q) for p, q in zip(got[1], want[1], strict=True)), path
            else:
                assert got[1] == want[1], (path, got[1], want[1])
    finally:
        backend.path = "auto"


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(CORRUPT), data=st.data())
def test_random_byte_flips_with_valid_crc(codecs, corrupt_base, which, data):
    """1-3 bytes of chunk records changed anywhere (framing, states, counts, words, bits),
    crc recomputed: both backends raise the same error type or decode identically."""
    recs = list(corrupt_base[which][0])
    for _ in range(data.draw(st.integers(1, 3), label="flips")):
        i = data.draw(st.integers(1, len(recs) - 1), label="chunk")
        areas = chunk_areas(recs[0], corrupt_base[which][0][i])
        # mostly the coded data: the bits (value checks, wrong values that decode), the words and states
        weighted = ["bits"] * 4 + ["words"] * 2 + ["states"] * 2 + ["word_counts", "fixed", "bits_len", "aux"]
        area = data.draw(st.sampled_from([k for k in weighted if areas[k][1] > areas[k][0]]), label="area")
        lo, hi = areas[area]
        pos = data.draw(st.integers(lo, hi - 1), label="pos")
        mask = data.draw(st.integers(1, 255), label="mask")
        rec = bytearray(recs[i])
        if pos < len(rec) - 4:
            rec[pos] ^= mask
        recs[i] = recrc(rec)
    _check_corrupt(codecs, corrupt_base, which, recs)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(CORRUPT), kind=st.sampled_from(MUTATIONS), data=st.data())
def test_structural_corruption(codecs, corrupt_base, which, kind, data):
    """Cut / grown bit sections, dropped / added / moved rANS words, changed and swapped
    states, repacked into parseable records."""
    recs = list(corrupt_base[which][0])
    h, _ = ct.unpack_header(recs[0])
    i = data.draw(st.integers(1, len(recs) - 1), label="chunk")
    c, _ = ct.unpack_chunk(recs[i], h)
    a = data.draw(st.integers(0, 1 << 20), label="a")
    b = data.draw(st.integers(0, 1 << 20), label="b")
    recs[i] = ct.pack_chunk(_mutate_chunk(c, kind, a, b))
    _check_corrupt(codecs, corrupt_base, which, recs)


@pytest.mark.parametrize("which", CORRUPT)
def test_truncated_records(codecs, corrupt_base, which):
    """Records cut short (container errors, the same on both) and the stream cut short."""
    recs = corrupt_base[which][0]
    for i in range(len(recs)):
        for cut in (0, 1, 12, 80, len(recs[i]) // 2, len(recs[i]) - 1):
            bad = list(recs)
            bad[i] = recs[i][:cut]
            _check_corrupt(codecs, corrupt_base, which, bad)
            bad[i] = recrc(recs[i][:cut]) if cut >= 4 else bad[i]
            _check_corrupt(codecs, corrupt_base, which, bad)
    _check_corrupt(codecs, corrupt_base, which, recs[:-1])


def test_every_word_of_a_block_zeroed(codecs, corrupt_base):
    """A whole block's words zeroed: a rANS error on both."""
    recs = corrupt_base["bf16-tuned"][0]
    h, _ = ct.unpack_header(recs[0])
    c, _ = ct.unpack_chunk(recs[1], h)
    words = c.words.copy()
    words[: int(c.word_counts[0])] = 0
    bad = list(recs)
    bad[1] = ct.pack_chunk(replace(c, words=words))
    _check_corrupt(codecs, corrupt_base, "bf16-tuned", bad)
    cv = codecs("native", 16, 10, 2, "tuned")
    with pytest.raises(RansDecodeError):
        cv.decode(bad, ids_for(1), corrupt_base["bf16-tuned"][1])
