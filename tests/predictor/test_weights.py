"""speckv.predictor.weights: the target's tensors read one at a time are the ones
``load_target`` loads (names, bytes, digest), and a derived predictor built from them
is the one built from the whole target, bit for bit."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from speckv.errors import ModelLoadError
from speckv.predictor import weights as wt
from speckv.predictor.calibrate import build_checkpoint
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.predict import Predictor
from speckv.predictor.store import state_digest

PROMPT = "Every bit the coder spends is the mismatch."


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _same_as_target(w: wt.TargetWeights, target) -> None:
    assert sorted(w) == sorted(target.state) and len(w) == len(target.state)
    for name in target.state:
        got = w[name]
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), target.state[name].view(torch.int16))
    assert w.weights_sha256 == target.weights_sha256
    stored = {n: t for n, t in target.state.items() if n in w._files}
    assert w.bf16_bytes == sum(t.numel() * 2 for t in stored.values())


def test_tiny_target_weights_equal_load_target(tiny_model_dir, tiny_target):
    w = wt.target_weights(tiny_model_dir)
    assert w is not None and w.config.num_hidden_layers == tiny_target.config.num_hidden_layers
    _same_as_target(w, tiny_target)
    with pytest.raises(KeyError):
        w["model.layers.9.mlp.up_proj.weight"]


def test_embedded_weights_tie_lm_head_as_state_dict_does(embedded_target):
    w = wt.target_weights()
    assert w is not None and w.name == embedded_target.name
    assert "lm_head.weight" in w and "lm_head.weight" not in w._files  # tied: the file stores it once
    assert torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])
    _same_as_target(w, embedded_target)


def test_sharded_and_float32_files(tiny_model_dir, tiny_target, tmp_path):
    """An index over two shards in float32: read by the index, cast to BF16 as load_hf casts."""
    state = load_file(str(tiny_model_dir / wt.SINGLE))
    names = sorted(state)
    half = len(names) // 2
    for shard, part in (("a.safetensors", names[:half]), ("b.safetensors", names[half:])):
        save_file({n: state[n].float() for n in part}, str(tmp_path / shard))
    (tmp_path / wt.INDEX).write_text(json.dumps({"weight_map": {n: "a.safetensors" if i < half else "b.safetensors"
                                                                for i, n in enumerate(names)}}))
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    w = wt.target_weights(tmp_path)
    assert w is not None
    _same_as_target(w, tiny_target)  # BF16 -> float32 -> BF16 is exact
    (tmp_path / wt.INDEX).write_text("{}")
    with pytest.raises(ModelLoadError, match="cannot read"):
        wt.target_weights(tmp_path)


def test_without_safetensors_the_whole_target_loads(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    assert wt.target_weights(tmp_path) is None
    loaded = []
    monkeypatch.setattr(wt, "load_target", lambda spec: loaded.append(spec) or "whole")
    assert wt.derivation_source(tmp_path) == "whole" and loaded == [tmp_path]
    with pytest.raises(ModelLoadError, match="no config.json"):
        wt.target_weights(tmp_path / "nothing")


def test_state_digest_reads_tensors_in_place():
    """The digest hashes each tensor's bytes where they lie: the same digest as the bytes copied."""
    import hashlib

    state = {"b": torch.arange(6, dtype=torch.bfloat16).view(2, 3), "a": torch.ones(4, dtype=torch.int8)}
    h = hashlib.sha256()
    for name in ("a", "b"):
        t = state[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    assert state_digest(state) == h.hexdigest()


@pytest.mark.parametrize("rung", ["w8a8:1", "hybrid:1", "fp8"])
def test_a_derived_predictor_from_lazy_weights_is_the_same(rung, tiny_model_dir, tiny_target, tiny_text, tmp_path):
    pin = build_checkpoint(tiny_target, tiny_text, tmp_path, tokens=64, segment=32, rung=rung, derive_weights=True)
    ck = load_checkpoint(tmp_path, pin=pin)
    ids = tiny_target.tokenize(PROMPT)
    lazy = Predictor.from_checkpoint(ck, wt.target_weights(tiny_model_dir))
    assert torch.equal(bits(lazy.mu(ids)), bits(Predictor.from_checkpoint(ck, tiny_target).mu(ids)))


def test_w8a8_head_and_model_share_one_embedding(tiny_target, tiny_text, tmp_path):
    """One copy of the weights a rung needs: the exact head's embeddings are the model's."""
    pin = build_checkpoint(tiny_target, tiny_text, tmp_path, tokens=64, segment=32, rung="w8a8:1", derive_weights=True)
    model = Predictor.from_checkpoint(load_checkpoint(tmp_path, pin=pin), tiny_target).model
    assert model.head.embed.data_ptr() == model.embed.data_ptr()
    # and the head keeps its linears in BF16, once (llama.py upcasts per product)
    assert all(b.dtype == torch.bfloat16 for b in model.head.buffers())


def test_stream_emits_mu_and_keeps_nothing(tiny_target, tiny_text, tmp_path):
    pin = build_checkpoint(tiny_target, tiny_text, tmp_path, tokens=64, segment=32, rung="w8a8:1", derive_weights=True)
    pred = Predictor.from_checkpoint(load_checkpoint(tmp_path, pin=pin), tiny_target)
    ids = tiny_target.tokenize(PROMPT)
    got: dict[int, np.ndarray] = {}
    assert pred.stream(ids, lambda i, b: got.__setitem__(i, b.copy())) is None
    mu = bits(pred.mu(ids)).numpy().view(np.uint16)
    assert sorted(got) == list(range(mu.shape[0]))
    assert np.array_equal(np.stack([got[i] for i in sorted(got)]), mu)


def test_files_naming_other_tensors_fall_back_to_the_whole_target(tiny_model_dir, tiny_target, tiny_text, tmp_path):
    """A file with a tensor the model does not load (an old buffer): the lazy digest differs from the
    state_dict's, so the whole target derives the weights, and the predictor is the same."""
    import shutil

    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir, d)
    state = load_file(str(d / wt.SINGLE))
    save_file({**state, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}, str(d / wt.SINGLE))
    lazy = wt.target_weights(d)
    assert lazy is not None and lazy.weights_sha256 != tiny_target.weights_sha256
    ck_dir = tmp_path / "ck"
    pin = build_checkpoint(tiny_target, tiny_text, ck_dir, tokens=64, segment=32, rung="w8a8:1", derive_weights=True)
    ck = load_checkpoint(ck_dir, pin=pin)
    ids = tiny_target.tokenize(PROMPT)
    got = Predictor.from_checkpoint(ck, lazy).mu(ids)
    assert torch.equal(bits(got), bits(Predictor.from_checkpoint(ck, tiny_target).mu(ids)))
