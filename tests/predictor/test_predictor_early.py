"""The early-exit rung early:k: layers < k are the target's KV bit for bit; every later
layer l is layer l's own RoPE(K)/V projections of its input norm of the hidden state after
layer k - 1 (checked here against the target's own modules, an independent path), so
layer k is exact too (that hidden state is its real input); the
checkpoint holds exactly the tensors it computes with; mu arrives layer by layer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from speckv.errors import CheckpointError
from speckv.predictor.calibrate import build_checkpoint
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.early import early_state
from speckv.predictor.ladder import EARLY_TAIL_COST, Rung, parse_rung
from speckv.predictor.predict import Predictor
from speckv.predictor.target import deterministic_torch

PROMPT = "Every bit the coder spends is the mismatch."


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_parse_and_cost():
    assert parse_rung("early:4", 30) == Rung("early", 4) and parse_rung("early:29", 30).name == "early:29"
    for bad in ("early", "early:0", "early:30", "early:04", "early:x"):  # k = L would be the target
        with pytest.raises(CheckpointError):
            parse_rung(bad, 30)
    assert parse_rung("early:6", 30).nominal_cost(30) == pytest.approx((6 + EARLY_TAIL_COST * 24) / 30)


def test_state_holds_exactly_what_the_rung_computes_with(tiny_target):
    state = early_state(tiny_target.state, Rung("early", 1))
    later = {n for n in state if ".layers.1." in n}
    assert later == {"model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.k_proj.weight",
                     "model.layers.1.self_attn.v_proj.weight"}
    assert {n for n in tiny_target.state if ".layers.0." in n} <= set(state)
    assert "lm_head.weight" not in state and "model.norm.weight" not in state
    assert all(torch.equal(state[n], tiny_target.state[n]) for n in state)  # the target's BF16, untouched


@pytest.fixture(scope="module")
def early1(tiny_target, tiny_text, tmp_path_factory):
    d = tmp_path_factory.mktemp("early1")
    pin = build_checkpoint(tiny_target, tiny_text, d, tokens=64, segment=32, rung="early:1")
    return Predictor.from_checkpoint(load_checkpoint(d, pin=pin))


def test_layers_below_k_are_the_target_and_the_tail_is_its_projections(early1, tiny_target):
    ids = tiny_target.tokenize(PROMPT)
    kv, mu = tiny_target.kv(ids), early1.mu(ids)
    assert mu.shape == kv.shape and mu.dtype == torch.bfloat16
    assert torch.equal(bits(mu[:1]), bits(kv[:1]))
    # layer 1 from the target's own modules: h after layer 0 (output_hidden_states[1] is not normed)
    model = tiny_target.model
    inp = torch.as_tensor(ids)[None]
    with deterministic_torch():
        out = model.model(input_ids=inp, output_hidden_states=True)
        h = out.hidden_states[1]
        layer = model.model.layers[1]
        x = layer.input_layernorm(h)
        shape = (1, len(ids), -1, layer.self_attn.head_dim)
        k = layer.self_attn.k_proj(x).view(shape).transpose(1, 2)
        v = layer.self_attn.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = model.model.rotary_emb(h, position_ids=torch.arange(len(ids))[None])
        k = apply_rotary_pos_emb(k, k, cos, sin)[1]
    assert torch.equal(bits(mu[1]), bits(torch.stack([k[0], v[0]])))
    # layer k's input IS the hidden state after layer k - 1: its K/V come out exact as well
    assert torch.equal(bits(mu[1]), bits(kv[1]))


def test_layer_by_layer_and_empty_prompt(early1, tiny_target):
    ids = tiny_target.tokenize(PROMPT)
    got = []
    mu = early1.mu(ids, lambda i, b: got.append((i, b.copy())))
    assert [i for i, _ in got] == [0, 1]
    for i, b in got:
        assert np.array_equal(b, bits(mu[i]).numpy().view(np.uint16))
    assert early1.mu(ids[:0]).shape == (2, 2, 2, 0, 16)


def test_embedded_early_layers_equal_the_target(embedded_target, tiny_text, tmp_path):
    k = 3
    pin = build_checkpoint(embedded_target, tiny_text, tmp_path, tokens=48, segment=48, derive_weights=True,
                           source="embedded", rung=f"early:{k}")
    ck = load_checkpoint(tmp_path, pin=pin)
    assert ck.manifest["rung"] == "early:3" and ck.manifest["kind"] == "early-exit"
    pred = Predictor.from_checkpoint(ck, embedded_target)
    ids = embedded_target.tokenize("Speculative coding needs the same bits on both sides.")
    kv, mu = embedded_target.kv(ids), pred.mu(ids)
    assert mu.shape == (30, 2, 3, len(ids), 64)
    assert torch.equal(bits(mu[:k + 1]), bits(kv[:k + 1]))  # layers <= k: exact
    assert all(not torch.equal(bits(mu[i]), bits(kv[i])) for i in range(k + 1, 30))
    assert torch.equal(bits(Predictor.from_checkpoint(ck, embedded_target).mu(ids)), bits(mu))
