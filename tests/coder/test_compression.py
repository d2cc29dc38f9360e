"""How well the shipped default predictor compresses: wire bits per scalar of the
embedded model's real KV for a fixed text, BF16 and FP8, held within 2% of the
figures measured when the checkpoint was built.

The other codec tests only check that a stream is lossless and smaller than raw;
falling back from the shipped rung (w8a8x:4, tuned residual model, ~5.24 bits
per BF16 scalar) to the plain FP8 rung
(~6.43) or the seed residual model would pass them. These fail it.

Figures: ``WIRE_BITS`` below, measured on this repository's build machine with

    cd /work/main && .venv/bin/python -m pytest -q -p no:cacheprovider \
        tests/coder/test_compression.py -s          # prints each measured figure

(the print comes before the assertion). They depend on the KV the target computes,
which may differ in the last bit of a few scalars between CPUs (``numeric_env`` in
the checkpoint's manifest); that moves a figure by far less than 0.01%, so the 2%
windows need no skip.
"""

from __future__ import annotations

import numpy as np
import pytest
from codec_helpers import PER_TOKEN, stream_bytes

from speckv.coder import container as ct
from speckv.coder.codec import Codec, CodecConfig, Fp8KV, bf16_bits
from speckv.coder.residual import MODEL_SEED, MODEL_TUNED
from speckv.predictor.calibrate import read_text
from speckv.predictor.fp8 import kv_to_fp8

TEXT = "tinyshakespeare.txt"  # ../shared/corpus/
TOKENS = 512  # the first 512 tokens of it: ~5.9 M scalars, a few seconds to code
REL = 0.02  # each figure must lie within 2% of the measured one
# NOTE: the tuned model's saving over the seed's moves more with the CPU's kernels than either figure
# (a ratio of their small difference): 0.598% (BF16) and 1.654% (FP8) where WIRE_BITS were measured,
# 0.564% and 1.584% on a 2-core AMD EPYC with AVX2 only (2026-12-06: -5.6% and -4.3% of it; its
# figures there: tuned 5.2203 / 1.9860, seed 5.2499 / 2.0179). A tuned model that lost a tenth of
# its saving, or all of it, fails
REL_SAVING = 0.08

# wire bits per scalar = 8 * sum(len(record)) / scalars, default CodecConfig
# (elems_per_lane 1024, layers_per_chunk 2), measured by the command in the docstring
WIRE_BITS = {
    ("bf16", "tuned"): 5.235059950086805,  # the shipped default (model auto = tuned)
    ("bf16", "seed"): 5.266531032986111,
    ("fp8", "tuned"): 1.9944525824652777,
    ("fp8", "seed"): 2.028000217013889,
}
# For scale, same 512 tokens, not asserted here: the plain FP8 rung (``speckv predictor
# build --rung fp8`` on wikitext2-valid.txt, 4096 tokens, ~80 s to build on 2 cores,
# which is why these tests compare against the seed model instead) codes BF16 at
# 6.4316 bits/scalar (tuned) and 6.4958 (seed).


@pytest.fixture(scope="module")
def prefill(embedded_session, corpus_file):
    text = read_text(corpus_file(TEXT), chars=TOKENS * 32)
    ids = embedded_session.target.tokenize(text, TOKENS)
    assert len(ids) == TOKENS
    return embedded_session.prefill(ids)


@pytest.fixture(scope="module")
def wire_bits(prefill, ckpt, embedded_session):
    """(dtype, model) -> measured wire bits per scalar, each stream decoded bit for bit."""
    assert ckpt.pin == embedded_session.pin  # the codec's checkpoint is the session's
    pre = prefill
    q, s = kv_to_fp8(pre.kv)
    inputs = {"bf16": pre.kv, "fp8": Fp8KV(q.numpy(), s.numpy())}
    n = pre.kv.numel()
    assert n == TOKENS * PER_TOKEN
    cache: dict[tuple[str, str], float] = {}

    def measure(dtype: str, model: str) -> float:
        if (dtype, model) not in cache:
            codec = Codec.from_checkpoint(ckpt, CodecConfig(model=model))
            kv = inputs[dtype]
            records = list(codec.encode(kv, pre.ids, pre.mu))
            h, _ = ct.unpack_header(records[0])
            assert h.model == {"seed": MODEL_SEED, "tuned": MODEL_TUNED, "auto": MODEL_TUNED}[model]
            out = codec.decode(records, pre.ids, pre.mu)
            if dtype == "bf16":
                assert np.array_equal(out, bf16_bits(kv))
            else:
                assert np.array_equal(out.codes, kv.codes)
                assert np.array_equal(out.scales.view(np.uint32), kv.scales.view(np.uint32))
            cache[dtype, model] = 8 * stream_bytes(records) / n
            print(f"\n{TOKENS} tokens of {TEXT}, {dtype}, model {model}: {cache[dtype, model]!r} bits/scalar")
        return cache[dtype, model]

    return measure


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_shipped_default_bits_per_scalar(wire_bits, dtype, record_property):
    """The default codec (model auto) of the shipped checkpoint, within 2% of the figure."""
    got = wire_bits(dtype, "auto")
    record_property(f"{dtype}_bits_per_scalar", round(got, 6))
    assert got == pytest.approx(WIRE_BITS[dtype, "tuned"], rel=REL)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_seed_model_bits_per_scalar(wire_bits, dtype):
    assert wire_bits(dtype, "seed") == pytest.approx(WIRE_BITS[dtype, "seed"], rel=REL)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_tuned_model_saving_over_seed(wire_bits, dtype):
    """What the tuned residual model saves over the seed model on the same KV and mu
    (0.60% BF16, 1.65% FP8 under w8a8x:4 with 14-bit K/V activations and the fine sigma steps;
    0.57% and 1.59% before those steps, 0.46% and 1.34% with 8-bit K/V activations), within
    REL_SAVING of itself: both absolute figures' 2% windows are wider than the saving, so they alone
    would not notice the tuned model degrading to the seed's figures."""
    want = 1 - WIRE_BITS[dtype, "tuned"] / WIRE_BITS[dtype, "seed"]
    got = 1 - wire_bits(dtype, "auto") / wire_bits(dtype, "seed")
    assert got == pytest.approx(want, rel=REL_SAVING)
