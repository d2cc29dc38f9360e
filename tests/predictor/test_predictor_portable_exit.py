"""portable:k, the portable rung's early exit: layers < k are portable's own; every later layer's
K/V are what portable's layer would hold if the layers between it and k added nothing to the
hidden state; the same bits on every path; pinned and loaded like every rung."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from predictor_helpers import every_path_digest

from speckv.errors import CheckpointError
from speckv.kv import bf16_bits
from speckv.predictor.calibrate import build_checkpoint
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.ladder import EXIT_TAIL_COST, Rung, parse_rung
from speckv.predictor.portable import build_portable_model, portable_kv, portable_state
from speckv.predictor.predict import Predictor

EXIT = 23  # the earliest exit of the embedded model the ladder takes (ladder.EXIT_MAX_SKIPPED)


def test_parse_name_and_cost():
    r = parse_rung("portable:23", 30)
    assert r == Rung("portable", 23) and r.name == "portable:23"
    assert r.nominal_cost(30) == pytest.approx((23 + EXIT_TAIL_COST * 7) / 30)
    for bad in ("portable:0", "portable:30", "portable:023", "portable:x"):
        with pytest.raises(CheckpointError, match="K must be|unknown"):
            parse_rung(bad, 30)


def test_exits_that_skip_more_than_a_fifth_of_the_layers_are_refused():
    """portable:22 and earlier code worse than the fp8 rung on every engine (benchmarks/RESULTS.md):
    refused with the reason and the earliest exit taken; on 2 layers portable:1 skips none."""
    for k in (1, 16, 20, 22):
        with pytest.raises(CheckpointError, match="codes worse than the fp8 rung .* use portable:23 or later"):
            parse_rung(f"portable:{k}", 30)
    assert parse_rung("portable:29", 30).bf16_layers == 29 and parse_rung("portable:1", 2).bf16_layers == 1


@pytest.fixture(scope="module")
def states(embedded_target):
    cfg = embedded_target.config
    return portable_state(embedded_target.state, cfg), portable_state(embedded_target.state, cfg, EXIT)


def test_exited_layers_keep_only_their_norm_and_kv_rows(states, embedded_target):
    cfg = embedded_target.config
    full, exit_ = states
    q_rows = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    for i in (EXIT, cfg.num_hidden_layers - 1):
        p = f"model.layers.{i}."
        assert {n for n in exit_ if n.startswith(p)} == {p + "input_layernorm.weight", p + "kv.w8", p + "kv.ws"}
        assert torch.equal(exit_[p + "kv.w8"], full[p + "qkv.w8"][q_rows:])  # the same int8 codes and scales
        assert torch.equal(exit_[p + "kv.ws"], full[p + "qkv.ws"][q_rows:])
    assert all(torch.equal(exit_[n], full[n]) for n in exit_ if not n.startswith(
        tuple(f"model.layers.{i}." for i in range(EXIT, cfg.num_hidden_layers))))


def test_exit_is_portable_with_silent_layers(states, embedded_target):
    """The independent control: portable's own model, with the output and down projections of
    layers k.. zeroed (int8 zeros add exactly nothing to h), gives portable:k's mu bit for bit;
    the real portable rung agrees on layers <= k and not after."""
    cfg = embedded_target.config
    full, exit_ = states
    silent = dict(full)
    for i in range(EXIT, cfg.num_hidden_layers - 1):
        for name in ("o", "down"):
            silent[f"model.layers.{i}.{name}.w8"] = torch.zeros_like(full[f"model.layers.{i}.{name}.w8"])
    ids = embedded_target.tokenize("The exit takes the hidden state of one layer to every later one. " * 3)
    got = bf16_bits(portable_kv(build_portable_model(cfg, exit_, EXIT), ids))
    assert np.array_equal(got, bf16_bits(portable_kv(build_portable_model(cfg, silent), ids)))
    whole = bf16_bits(portable_kv(build_portable_model(cfg, full), ids))
    assert np.array_equal(got[: EXIT + 1], whole[: EXIT + 1])
    assert all(not np.array_equal(got[i], whole[i]) for i in range(EXIT + 1, cfg.num_hidden_layers))


def test_every_path_gives_the_same_bits(states, embedded_target, monkeypatch):
    model = build_portable_model(embedded_target.config, states[1], EXIT)
    rng = np.random.default_rng(3)
    for ids in (rng.integers(0, embedded_target.config.vocab_size, n) for n in (1, 7, 130)):
        digests = every_path_digest(model, ids, monkeypatch)
        assert len(set(digests.values())) == 1, digests


def test_state_must_fit_the_exit(states, embedded_target):
    with pytest.raises(CheckpointError, match="do not fit"):
        build_portable_model(embedded_target.config, states[0], EXIT)


def test_checkpoint_pins_and_loads(tiny_target, tiny_text, tmp_path):
    """On the 2-layer tiny model portable:1 exits at the last layer, which computes only its K/V
    anyway: the same mu as portable, from another pinned checkpoint."""
    d = tmp_path / "exit"
    pin = build_checkpoint(tiny_target, tiny_text, d, tokens=64, segment=32, rung="portable:1")
    ck = load_checkpoint(d, pin)
    assert ck.manifest["rung"] == "portable:1" and ck.manifest["kind"] == "integer-portable"
    assert "canary" in ck.manifest and "K/V projections" in ck.manifest["weights"]["quant"]
    assert ck.manifest["weights"]["exit_layer"] == 1 and "bf16_layers" not in ck.manifest["weights"]
    pred = Predictor.from_checkpoint(ck)
    assert pred.canary_ok() is True
    ids = tiny_target.tokenize("A short prompt for the exit.")
    whole = build_portable_model(tiny_target.config, portable_state(tiny_target.state, tiny_target.config))
    assert np.array_equal(bf16_bits(pred.mu(ids)), bf16_bits(portable_kv(whole, ids)))
