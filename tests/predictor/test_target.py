"""Target models: the embedded SmolLM2-135M and a local Hugging Face directory.

The tiny random Llama checks the emulated-BF16 prefill against the plain
float32 Hugging Face model (a model-correctness check, so allclose at BF16
tolerance); everything about determinism compares bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from speckv.errors import ModelLoadError
from speckv.predictor.store import default_checkpoint_dir, state_digest
from speckv.predictor.target import deterministic_torch, load_target

PROMPT = "The lighthouse keeper counted the ships passing in the fog."


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


# ------------------------------------------------------------------ embedded


def test_embedded_layout(embedded_target):
    ids = embedded_target.tokenize(PROMPT)
    assert ids.dtype == np.int64 and 5 < len(ids) < 30
    kv = embedded_target.kv(ids)
    assert kv.shape == (30, 2, 3, len(ids), 64)
    assert kv.dtype == torch.bfloat16 and kv.is_contiguous()
    assert torch.isfinite(kv).all()
    assert kv.abs().amax().item() > 0  # not an empty or zero cache
    # K and V differ, layers differ
    assert not torch.equal(as_bits(kv[:, 0]), as_bits(kv[:, 1]))
    assert not torch.equal(as_bits(kv[0]), as_bits(kv[1]))


def test_embedded_deterministic(embedded_target):
    ids = embedded_target.tokenize(PROMPT)
    a = embedded_target.kv(ids)
    b = embedded_target.kv(ids.copy())
    assert torch.equal(as_bits(a), as_bits(b))
    other = embedded_target.kv(embedded_target.tokenize(PROMPT.replace("fog", "rain")))
    assert not torch.equal(as_bits(a[:, :, :, -2:]), as_bits(other[:, :, :, -2:]))


def test_deterministic_settings_leave_empty_unfilled_and_restore():
    """Inside a pass, deterministic mode does not NaN-fill fresh buffers (a cost, no bit depends on
    it); outside, the caller's settings are back."""
    def settings() -> tuple[bool, bool]:
        return torch._C._get_deterministic_fill_uninitialized_memory(), torch.are_deterministic_algorithms_enabled()

    before = settings()
    with deterministic_torch():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch._C._get_deterministic_fill_uninitialized_memory()
    assert settings() == before


WARM_PROBE = """
import json, torch
seen = []
for name in ("cos", "sin", "exp"):
    real = getattr(torch, name)
    setattr(torch, name, lambda x, _f=real, _n=name: seen.append((_n, x.numel(), torch.get_num_threads())) or _f(x))
from speckv.predictor.target import WARM_ELEMENTS, deterministic_torch
with deterministic_torch():
    first = list(seen)
with deterministic_torch():
    pass
print(json.dumps({"first": first, "after": seen[len(first):], "n": WARM_ELEMENTS}))
"""


def test_a_process_warms_its_transcendentals_once_before_its_first_pass():
    """NOTE at target._FORWARD_LOCK: a process's first cos came out less exact in one thread's half; the
    first deterministic_torch of a process calls each transcendental once, on the pass's thread count,
    on a tensor large enough to be split over the threads, and the later ones do not (a fresh process)."""
    import subprocess
    import sys

    out = json.loads(subprocess.run([sys.executable, "-c", WARM_PROBE], capture_output=True, text=True,
                                    check=True, timeout=120).stdout)
    from speckv.predictor.target import COMPUTE_THREADS

    assert out["first"] == [[f, out["n"], COMPUTE_THREADS] for f in ("cos", "sin", "exp")] and out["after"] == []
    assert out["n"] >= 1 << 16


def test_embedded_empty_prompt(embedded_target):
    ids = embedded_target.tokenize("")
    assert ids.shape == (0,)
    kv = embedded_target.kv(ids)
    assert kv.shape == (30, 2, 3, 0, 64) and kv.dtype == torch.bfloat16


def test_embedded_tokenize_truncates(embedded_target):
    ids = embedded_target.tokenize(PROMPT)
    assert np.array_equal(embedded_target.tokenize(PROMPT, max_tokens=4), ids[:4])


def test_embedded_matches_shipped_predictor(embedded_target):
    """The shipped default predictor was calibrated for exactly these weights."""
    manifest = json.loads((default_checkpoint_dir() / "manifest.json").read_bytes())
    assert embedded_target.weights_sha256 == manifest["target"]["weights_sha256"]
    assert embedded_target.name == manifest["target"]["name"] == "SmolLM2-135M-Instruct"
    cfg = embedded_target.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads) == (30, 3)


# ------------------------------------------------------------------ Hugging Face directory


def test_hf_dir_layout_and_determinism(tiny_target):
    ids = tiny_target.tokenize("The quick brown fox jumps over the lazy dog.")
    kv = tiny_target.kv(ids)
    assert kv.shape == (2, 2, 2, len(ids), 16) and kv.dtype == torch.bfloat16
    assert torch.equal(as_bits(kv), as_bits(tiny_target.kv(ids)))
    assert tiny_target.kv(ids[:0]).shape == (2, 2, 2, 0, 16)


def test_hf_dir_state_is_the_saved_bf16_weights(tiny_model_dir, tiny_target):
    from safetensors.torch import load_file

    saved = load_file(str(tiny_model_dir / "model.safetensors"))
    for name, t in saved.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(as_bits(tiny_target.state[name]), as_bits(t)), name
    assert tiny_target.weights_sha256 == state_digest(tiny_target.state)
    assert load_target(tiny_model_dir).weights_sha256 == tiny_target.weights_sha256
    assert tiny_target.name == tiny_model_dir.name


def test_hf_dir_kv_matches_float32_reference(tiny_model_dir, tiny_target):
    """speckv's emulated-BF16 prefill against the plain HF model run in float32."""
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                     local_files_only=True)
    ref_model.eval()
    ids = tiny_target.tokenize("Bridges hum in the wind; every span has a note of its own.")
    kv = tiny_target.kv(ids)
    with torch.no_grad():
        out = ref_model(torch.as_tensor(ids).unsqueeze(0), use_cache=True)
    cache = out.cache
    refs = [(cache.layers[i].keys[0], cache.layers[i].values[0]) for i in range(2)]

    k0 = refs[0][0]
    assert k0.shape == kv[0, 0].shape
    scale = k0.abs().amax().item()
    assert scale > 0.1  # a real signal, not tolerance-sized noise
    torch.testing.assert_close(kv[0, 0].float(), k0, rtol=3e-2, atol=1e-2)
    for layer in range(2):
        for j in range(2):
            torch.testing.assert_close(kv[layer, j].float(), refs[layer][j], rtol=3e-2, atol=1e-2)
    # the tolerance is far tighter than the difference between distinct tensors
    assert (kv[0, 0].float() - refs[1][0]).abs().amax().item() > 0.1
    assert (kv[0, 0, :, 1:].float() - k0[:, :-1]).abs().amax().item() > 0.1


def test_missing_dir_is_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_target(tmp_path / "does-not-exist")
    with pytest.raises(ModelLoadError):
        load_target(tmp_path)  # exists, but empty


def test_dir_without_weights_is_model_load_error(tmp_path, tiny_model_dir):
    (tmp_path / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    with pytest.raises(ModelLoadError):
        load_target(tmp_path)
