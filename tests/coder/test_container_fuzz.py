"""Fuzzing of the container parser and of Codec.decode, driven by hypothesis.

The generators are benchmarks/fuzzing's (benchmarks/fuzz.py runs them for 10,000
inputs per target; here hypothesis draws their random choices, a few hundred per
target): mutated (bit flips, byte sets, insertions, deletions, splices, field
overwrites, with and without recomputed CRCs), truncated and random inputs to
``unpack_header``, ``unpack_chunk`` (against a valid header), ``unpack_stream``,
and mutated record lists of real small BF16/FP8 speckv and stored streams to
``Codec.decode``. Every call is bounded in time (``guarded``: SIGALRM plus the
elapsed time). What must hold: the parser raises ``FormatError`` (or a subclass)
and nothing else, and whatever it accepts re-packs to the same bytes; the codec
raises a ``SpeckvError`` and nothing else, a decode that succeeds returns exactly
the original bits, and an unmutated stream decodes.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from fuzzing import coder_targets as targets
from fuzzing.coder_env import CoderEnv
from fuzzing.findings import Finding, guarded
from fuzzing.runner import run_target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speckv.coder import container as ct
from speckv.errors import SpeckvError

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RNG = st.randoms(use_true_random=False)

# NaN / Inf arithmetic on corrupt FP8 scales and mu is part of what is fuzzed
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def env(make_codec):
    """Valid streams (synthetic container streams; real BF16/FP8 speckv and stored
    streams of a 1-token random KV) under a small-block codec (16 elements per lane,
    10 layers per chunk: a decode takes milliseconds)."""
    return CoderEnv(make_codec(16, 10, threads=1), seed=0)


@pytest.mark.parametrize("name", list(targets.CODER_TARGETS))
@FUZZ
@given(rng=RNG)
def test_target(env, name, rng):
    """container.header / .chunk / .stream: unpack_header, unpack_chunk, unpack_stream;
    codec.speckv / .stored: Codec.decode of mutated speckv / stored streams."""
    targets.CODER_TARGETS[name](env, rng)


@FUZZ
@given(st.lists(st.binary(max_size=400), max_size=5), st.sampled_from(["speckv-bf16", "stored-fp8"]),
       st.booleans())
def test_decode_random_records(env, records, name, with_header):
    """Random records (optionally behind a valid header record) never decode."""
    base = env.bases[name]
    recs = ([base.records[0]] if with_header else []) + records
    outcome, _ = guarded(lambda: env.codec.decode(recs, base.ids, base.mu), (SpeckvError,), targets.CODEC_LIMIT_S)
    assert outcome != "ok"


# ---------------------------------------------------------------- the fuzzer itself

def test_generators_reach_every_layer_of_checks(env):
    """A fixed batch of inputs gets past the crc, the container rules and the header
    checks to the codec's own verification, and also decodes when left unmutated: the
    fuzzer is not stuck at the first check."""
    seen: dict[str, set[str]] = {}
    for name in ("container.stream", "codec.speckv", "codec.stored"):
        fn = targets.CODER_TARGETS[name]
        seen[name] = {fn(env, random.Random(f"reach:{name}:{i}")) for i in range(400)}
    assert {"ok", "FormatError", "TruncatedError", "ChecksumError"} <= seen["container.stream"]
    assert {"ok", "FormatError", "TruncatedError", "IntegrityError", "PromptMismatchError",
            "MuMismatchError"} <= seen["codec.speckv"]
    assert {"ok", "FormatError", "IntegrityError", "PromptMismatchError"} <= seen["codec.stored"]


def test_guarded_reports_foreign_exceptions_and_slow_calls():
    with pytest.raises(Finding) as ei:
        guarded(lambda: {}["missing"], (ct.FormatError,), 1.0)
    assert ei.value.kind == "crash" and "KeyError" in ei.value.detail
    t0 = time.perf_counter()
    with pytest.raises(Finding) as ei:
        guarded(lambda: time.sleep(5), (), 0.2)  # interrupted, not waited out
    assert ei.value.kind == "hang" and time.perf_counter() - t0 < 2
    assert guarded(lambda: ct.unpack_header(b"SPK"), (ct.FormatError,), 1.0) == ("TruncatedError", None)


def test_codec_oracle_catches_wrong_bits_and_rejected_valid_streams(env, monkeypatch):
    base = env.bases["stored-bf16"]
    monkeypatch.setattr(env.codec, "decode", lambda recs, ids, mu=None: np.zeros_like(base.bits))
    with pytest.raises(Finding) as ei:
        for i in range(50):  # the unmutated stream comes up within these (5 %)
            targets.t_codec_stored(env, random.Random(f"oracle:{i}"))
    assert ei.value.kind == "corrupt"

    def reject(recs, ids, mu=None):
        raise ct.FormatError("no")
    monkeypatch.setattr(env.codec, "decode", reject)
    with pytest.raises(Finding, match="unmutated stream failed"):
        for i in range(200):
            targets.t_codec_stored(env, random.Random(f"oracle:{i}"))


def test_container_oracle_catches_non_canonical_acceptance(env, monkeypatch):
    h, recs = env.streams[0]
    monkeypatch.setattr(ct, "unpack_header", lambda buf: (h, ct.HEADER_LEN))  # accepts anything
    with pytest.raises(Finding, match="non-canonical header"):
        for i in range(50):
            targets.t_container_header(env, random.Random(f"canon:{i}"))


def test_runner_counts_every_finding_with_its_replay(env, monkeypatch):
    """run_target reports findings (none is tolerated), each with the input that replays it."""
    monkeypatch.setattr(env.codec, "decode", lambda recs, ids, mu=None: {}["crash"])
    tally = run_target("codec.stored", env, 20, seed=3, start=100, progress=False)
    assert tally.inputs == 20 and tally.findings["crash"] == 20 and tally.crashes == 20
    assert tally.examples["crash"][0].startswith("--replay codec.stored:100 ")
    assert "KeyError" in tally.examples["crash"][0]
