"""The engine stand-ins of ``speckv.predictor.engines``: each is the same model (its KV close to the
sidecars' own) computed by other kernels, and leaves the shared target as it found it.

Differing fractions measured here (256 tokens of tinyshakespeare, this machine): eager 0.80, fp32
0.83, bf16 0.76, avx2 0.39; threads1 and batch2 0.000 (this CPU's kernels give those the same bits:
reported as measured, not assumed, so a machine where they differ still codes and verifies them).
On an AVX2-only CPU (no AVX-512) the avx2 engine is the default computation: 0.000 there.
"""

from __future__ import annotations

import numpy as np
import pytest

from speckv.kv import bf16_bits
from speckv.predictor import engines
from speckv.predictor import target as tgt
from speckv.predictor.calibrate import read_text

TOKENS = 256


@pytest.fixture(scope="module")
def prompt(embedded_target, corpus_file):
    """(ids, same-kernel KV) of the text's first TOKENS tokens."""
    ids = embedded_target.tokenize(read_text(corpus_file("tinyshakespeare.txt"), chars=TOKENS * 32), TOKENS)
    return ids, embedded_target.kv(ids)


def _relative_error(kv, same) -> float:
    a, b = kv.float(), same.float()
    return float((a - b).abs().mean() / b.abs().mean())


@pytest.mark.parametrize("engine,least_differing", [("eager", 0.6), ("fp32", 0.6), ("bf16", 0.6),
                                                    ("avx2", 0.2)])
def test_other_kernels_change_most_bits_of_the_same_kv(embedded_target, prompt, engine, least_differing):
    import torch

    ids, same = prompt
    kv = engines.engine_kv(embedded_target, ids, engine)
    assert kv.shape == same.shape and kv.dtype == same.dtype
    if engines.same_computation(engine):  # NOTE: an AVX2-only CPU already runs the AVX2 kernels
        assert engine == "avx2" and torch.backends.cpu.get_cpu_capability() == "AVX2"
        assert engines.differing_fraction(kv, same) == 0
        return
    assert engines.differing_fraction(kv, same) > least_differing
    assert _relative_error(kv, same) < 0.015  # rounding-level differences, not another model


def test_eager_keeps_layer_0_and_restores_sdpa(embedded_target, prompt):
    """Layer 0's K/V come before any attention, so eager attention leaves them as they are."""
    ids, same = prompt
    eager = bf16_bits(engines.engine_kv(embedded_target, ids, "eager"))
    assert np.array_equal(eager[0], bf16_bits(same)[0])
    assert embedded_target.model.config._attn_implementation == "sdpa"
    assert np.array_equal(bf16_bits(embedded_target.kv(ids)), bf16_bits(same))


@pytest.mark.parametrize("engine", ["threads1", "batch2"])
def test_thread_count_and_batch_shape_engines(embedded_target, prompt, engine):
    """The same model's KV; the shared target's thread count is restored afterwards."""
    ids, same = prompt
    kv = engines.engine_kv(embedded_target, ids, engine)
    assert kv.shape == same.shape and _relative_error(kv, same) < 0.015
    assert tgt.COMPUTE_THREADS == 2


def test_batch2_row_is_the_prompt_not_the_padded_one(embedded_target, prompt):
    """The padded second prompt is another text: its row's KV would differ from the prompt's."""
    ids, same = prompt
    kv = engines.engine_kv(embedded_target, ids, "batch2")
    assert _relative_error(kv, same) < 0.015
    assert _relative_error(embedded_target.kv(ids[::-1].copy()), same) > 0.5


@pytest.mark.parametrize("engine", engines.STREAM_ENGINES)
def test_stream_models_give_the_engines_kv_layer_by_layer(embedded_target, prompt, engine):
    """benchmarks/e2e.py's engines: a hooked forward of stream_model hands over each layer as it
    runs, and the whole is the KV that ``speckv bench --engine`` codes (engine_kv)."""
    ids, same = prompt
    got: dict[int, np.ndarray] = {}
    try:
        model = engines.stream_model(embedded_target, engine)
        kv = bf16_bits(tgt.extract_kv(model, ids, lambda i, b: got.setdefault(i, np.array(b))))
    finally:
        embedded_target.model.set_attn_implementation(engines.SAME)
    ref = engines.engine_kv(embedded_target, ids, engine)
    assert np.array_equal(kv, bf16_bits(same if ref is None else ref))
    assert sorted(got) == list(range(kv.shape[0])) and all(np.array_equal(got[i], kv[i]) for i in got)
    with pytest.raises(ValueError, match="engine must be one of"):
        engines.stream_model(embedded_target, "fp32")


def test_sdpa_is_the_callers_own_and_unknown_engines_are_refused(embedded_target, prompt):
    ids, _ = prompt
    assert engines.engine_kv(embedded_target, ids, engines.SAME) is None
    with pytest.raises(ValueError, match="engine must be one of"):
        engines.engine_kv(embedded_target, ids, "flash")


def test_a_failing_child_is_a_typed_error(embedded_target, prompt, monkeypatch, tmp_path):
    ids, _ = prompt
    monkeypatch.setattr(embedded_target, "spec", str(tmp_path / "no-such-model"))
    with pytest.raises(engines.EngineError, match="engine avx2: child exited"):
        engines.engine_kv(embedded_target, ids[:8], "avx2")


def test_fp8cache_kv_is_fp8_rounded_and_feeds_attention(embedded_target, prompt):
    """Each layer's K/V are e4m3 values at the engine's static scales (rounding again changes
    nothing), layer 0's are the BF16 engine's rounded, and later layers differ beyond that
    rounding: attention read the rounded K/V."""
    import torch

    ids, same = prompt
    fa = engines.fp8_cache_attention(same)
    kv = engines.engine_kv(embedded_target, ids, "fp8cache")
    for i in range(kv.shape[0]):
        for j in (0, 1):
            assert torch.equal(fa.round(kv[i, j], i, j), kv[i, j]), (i, j)
    assert torch.equal(kv[0], torch.stack([fa.round(same[0, j], 0, j) for j in (0, 1)]))
    rounded_same = torch.stack([torch.stack([fa.round(same[i, j], i, j) for j in (0, 1)]) for i in range(len(same))])
    assert (bf16_bits(kv[1:]) != bf16_bits(rounded_same[1:])).mean() > 0.45  # measured 0.56
    assert embedded_target.model.config._attn_implementation == "sdpa"
    assert np.array_equal(bf16_bits(embedded_target.kv(ids)), bf16_bits(same))  # nothing left set
