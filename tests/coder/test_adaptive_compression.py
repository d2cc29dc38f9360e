"""What forward-adaptive sigma (format version 4) buys on the embedded model's real KV:
wire bits per scalar when the KV comes from another engine configuration (eager
attention: ~80% of the scalars differ in their last bits from the sidecar's own sdpa
recomputation) and when it comes from the sidecar's own kernels, against the same
stream written as format version 3 (no shifts), BF16 and FP8; and, in version 4, on
every engine stand-in of ``speckv.predictor.engines``, judged by the worst of them.

The shipped w8a8i:4 checkpoint's exact layers 0-3 (w8a8:4's and hybrid:4's before it) have sigma
calibrated to a residual of ~0; in version 3 their rounding-level differences cost ~15 bits a scalar and their
chunks go stored. Version 4's shifts widen those groups' sigma.

Figures: ``WIRE_BITS`` below, measured on this repository's build machine with

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/coder/test_adaptive_compression.py -s

(each figure is printed before its assertion); the windows (REL, REL_BF16 below) cover two CPUs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from codec_helpers import stream_bytes

from speckv.coder import container as ct
from speckv.coder.codec import Codec, CodecConfig, Fp8KV, bf16_bits
from speckv.predictor import engines
from speckv.predictor.calibrate import read_text
from speckv.predictor.fp8 import kv_to_fp8

TEXT = "tinyshakespeare.txt"  # ../shared/corpus/
TOKENS = 512
# NOTE: windows around figures that move with the CPU's kernels (the engine's KV is computed here).
# Measured on two CPUs (the build machine, and a 2-core Intel Xeon with AMX on 2026-12-03, the
# command in the docstring): the FP32 engines' figures moved -0.52% to +0.37%, fp8cache's -0.72%,
# the BF16 engine's (oneDNN BF16 GEMMs: AMX there) -0.85% to -1.02%. A chooser regression moves more.
REL = 0.0075
REL_BF16 = 0.0125


def rel(engine: str) -> float:
    return REL_BF16 if engine == "bf16" else REL


def pinned(dtype: str, engine: str, version: int = 5) -> float:
    """WIRE_BITS of an engine, or the same-kernel figure where this CPU computes that engine with the
    sidecars' own kernels (the avx2 engine on an AVX2-only CPU: engines.same_computation)."""
    return WIRE_BITS[dtype, engines.SAME if engines.same_computation(engine) else engine, version]

# (dtype, engine, format version) -> wire bits per scalar, default CodecConfig; dtype fp8z: FP8 codes
# rounded toward zero (vLLM's CPU cache writer), which version 5's rounding byte models
WIRE_BITS = {
    ("bf16", "sdpa", 5): 5.235059950086805,
    ("bf16", "sdpa", 3): 5.2407470703125,
    ("bf16", "eager", 5): 5.5849799262152775,
    ("bf16", "eager", 3): 6.624348958333333,
    ("fp8", "sdpa", 5): 1.9944525824652777,
    ("fp8", "sdpa", 3): 1.99971923828125,
    ("fp8", "eager", 5): 2.0722249348958335,
    ("fp8", "eager", 3): 2.185186089409722,
    ("bf16", "fp32", 5): 5.640170627170139,
    ("bf16", "bf16", 5): 5.420267740885417,
    ("bf16", "threads1", 5): 5.235059950086805,  # this CPU's kernels: the same bits as sdpa
    ("bf16", "avx2", 5): 5.262759060329861,
    ("bf16", "batch2", 5): 5.235059950086805,  # the same bits as sdpa here
    ("fp8", "fp32", 5): 2.0764485677083333,
    ("fp8", "bf16", 5): 2.0294297960069443,
    ("fp8", "threads1", 5): 1.9944525824652777,
    ("fp8", "avx2", 5): 1.9976982964409722,
    ("fp8", "batch2", 5): 1.9944525824652777,
    ("fp8z", "sdpa", 5): 2.0702012803819443,
    ("fp8z", "eager", 5): 2.1169569227430554,
    ("fp8z", "fp32", 5): 2.1103230794270833,
    ("fp8z", "bf16", 5): 2.0853759765625,
    ("fp8z", "threads1", 5): 2.0702012803819443,
    ("fp8z", "avx2", 5): 2.069927300347222,
    ("fp8z", "batch2", 5): 2.0702012803819443,
    ("fp8z", "sdpa", 4): 2.594198947482639,
    ("fp8z", "eager", 4): 2.610040961371528,
    ("fp8", "fp8cache", 5): 2.5424302842881943,  # over the bar under plain mu: test_fp8_cache_engine
}


@pytest.fixture(scope="module")
def engine_kv(embedded_session, corpus_file):
    """(ids, mu, {engine: BF16 KV}) of the text's first TOKENS tokens, every engine stand-in."""
    text = read_text(corpus_file(TEXT), chars=TOKENS * 32)
    ids = embedded_session.target.tokenize(text, TOKENS)
    pre = embedded_session.prefill(ids)
    kvs = {e: engines.engine_kv(embedded_session.target, ids, e) for e in engines.ENGINES if e != engines.SAME}
    return ids, pre.mu, {engines.SAME: pre.kv, **kvs}


@pytest.fixture(scope="module")
def wire_bits(engine_kv, ckpt, embedded_session):
    assert ckpt.pin == embedded_session.pin
    ids, mu, kvs = engine_kv
    codec = Codec.from_checkpoint(ckpt, CodecConfig())
    cache: dict[tuple[str, str, int], float] = {}

    def measure(dtype: str, engine: str, version: int) -> float:
        key = (dtype, engine, version)
        if key not in cache:
            kv = kvs[engine]
            if dtype == "fp8" and engine == "fp8cache":  # its codes at the engine's static scales
                want = engines.fp8_cache_codes(kv, engines.fp8_cache_attention(kvs[engines.SAME]))
                x, scales = want.codes, want.scales
            elif dtype in ("fp8", "fp8z"):
                q, s = kv_to_fp8(kv, toward_zero=dtype == "fp8z")
                x, scales, want = q.numpy(), s.numpy(), Fp8KV(q.numpy(), s.numpy())
            else:
                x, scales, want = bf16_bits(kv), None, bf16_bits(kv)
            h = dataclasses.replace(codec.stream_header(dtype == "bf16", x.shape, ids), version=version)
            records = [ct.pack_header(h)] + [ct.pack_chunk(c) for c in
                                             codec.encode_chunks(h, range(h.n_chunks), x, mu, scales)]
            if version == ct.FORMAT_VERSION:
                assert records == list(codec.encode(want, ids, mu))  # what a writer writes
            out = codec.decode(records, ids, mu)
            if dtype != "bf16":
                assert np.array_equal(out.codes, want.codes) and np.array_equal(out.scales, want.scales)
            else:
                assert np.array_equal(out, want)
            cache[key] = 8 * stream_bytes(records) / x.size
            print(f"\n{TOKENS} tokens of {TEXT}, {dtype}, {engine}, format {version}: {cache[key]!r} bits/scalar")
        return cache[key]

    return measure


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("engine", ["sdpa", "eager"])
def test_bits_per_scalar(wire_bits, dtype, engine):
    for version in (5, 3):
        assert wire_bits(dtype, engine, version) == pytest.approx(WIRE_BITS[dtype, engine, version], rel=REL)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_same_kernel_kv_is_never_worse(wire_bits, dtype):
    """Same kernels: version 5 codes below version 3. Its FP8 chunks round to nearest, and its
    groups take a fine sigma step only where the step saves: 0.0057 and 0.0053 bits less here."""
    assert wire_bits(dtype, "sdpa", 5) <= wire_bits(dtype, "sdpa", 3) - 0.003


def test_other_engine_kv_gains(wire_bits):
    """Eager KV: version 5 (sigma shifts since version 4) saves ~1 bit a BF16 scalar (0.1 an FP8
    element) over version 3 (measured 1.039 and 0.113), and stays within 0.37 bits (BF16) of
    same-kernel KV (0.350; 0.357 before the fine sigma steps, 0.337 before the K/V projections read
    14-bit activations, which gain more on same-kernel KV); the issue's bar: BF16 <= 6.2, FP8 <= 2.5."""
    assert wire_bits("bf16", "eager", 5) <= wire_bits("bf16", "eager", 3) - 0.95
    assert wire_bits("fp8", "eager", 5) <= wire_bits("fp8", "eager", 3) - 0.09
    assert wire_bits("bf16", "eager", 5) <= wire_bits("bf16", "sdpa", 5) + 0.37
    assert wire_bits("bf16", "eager", 5) <= 6.2 and wire_bits("fp8", "eager", 5) <= 2.5


BF16_CACHE = [e for e in engines.ENGINES if e != "fp8cache"]  # engines whose attention reads a BF16 cache


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("engine", [e for e in BF16_CACHE if e not in ("sdpa", "eager")])
def test_bits_per_scalar_on_other_engines(wire_bits, engine_kv, dtype, engine):
    """NOTE: on a miss the message says how far the engine's KV was from the same-kernel KV this time
    (tests/predictor/test_engines.py pins each engine's fraction): a once-seen miss of the avx2 child
    (5.689 against 5.449, 2026-12-03, not reproduced in 16 runs since, quiet or loaded) would then say
    whether the child computed other KV or the coder coded the same KV otherwise."""
    kvs = engine_kv[2]
    got = wire_bits(dtype, engine, 5)
    assert got == pytest.approx(pinned(dtype, engine), rel=rel(engine)), (
        f"{engine}: {engines.differing_fraction(kvs[engine], kvs[engines.SAME]):.4f} of its KV scalars "
        "differ from the same-kernel KV's")


def test_worst_engine_meets_the_bar(wire_bits):
    """The issue's bar, judged by the worst engine stand-in with a BF16 cache: BF16 <= 6.2, FP8 <= 2.5
    bits; the worst (fp32 compute here) within 0.43 / 0.09 bits of same-kernel KV (measured 0.405 /
    0.082). An FP8 cache that attention reads misses it: test_fp8_cache_engine."""
    worst = {dt: max(wire_bits(dt, e, 5) for e in BF16_CACHE) for dt in ("bf16", "fp8")}
    assert worst["bf16"] <= min(6.2, wire_bits("bf16", "sdpa", 5) + 0.43)
    assert worst["fp8"] <= min(2.5, wire_bits("fp8", "sdpa", 5) + 0.09)


@pytest.mark.parametrize("engine", BF16_CACHE)
def test_fp8_rounded_toward_zero(wire_bits, engine):
    """FP8 codes rounded toward zero (vLLM's CPU cache writer): version 5's rounding byte codes them
    within 0.1 bits of codes rounded to nearest, where version 4 lost ~0.5 (measured on sdpa: 2.070
    vs 1.994, version 4 2.594); the FP8 bar (<= 2.5) holds on every engine."""
    bits = wire_bits("fp8z", engine, 5)
    assert bits == pytest.approx(pinned("fp8z", engine), rel=rel(engine))
    assert bits <= min(2.5, wire_bits("fp8", engine, 5) + 0.1)
    if engine in ("sdpa", "eager"):
        assert wire_bits("fp8z", engine, 4) == pytest.approx(WIRE_BITS["fp8z", engine, 4], rel=REL)
        assert bits <= wire_bits("fp8z", engine, 4) - 0.45  # measured 0.52 (sdpa), 0.49 (eager)


def test_fp8_cache_engine(wire_bits):
    """An engine whose attention reads its FP8 cache (vLLM with an FP8 KV cache) computes every later
    layer from FP8-rounded K/V. Under plain mu its FP8 KV codes ~0.55 bits an element worse than a
    BF16-cache engine's, over the issue's 2.5 bar; the figure is pinned here. Told the engine's
    rounding (SubmitHeader.fp8_attention), the predictors follow it and win most of that back:
    tests/predictor/test_fp8_attention.py, tests/server/test_transfer_fp8_attention.py."""
    bits = wire_bits("fp8", "fp8cache", 5)
    assert bits == pytest.approx(WIRE_BITS["fp8", "fp8cache", 5], rel=REL)
