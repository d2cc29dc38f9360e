"""The exact head in plain torch (``llama.py``) equals the transformers model ``target.py`` runs,
bit for bit: h after layer k - 1 and every layer's K/V, for one-token, short and 2048-token
prompts, with and without FP8-rounded attention, on the tiny Llama (GQA, head_dim 16) and the
embedded SmolLM2; its RoPE tables and rotation equal transformers' own; a sidecar's w8a8 rung
never imports transformers, and a Llama's config.json reads as AutoConfig reads it."""
from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest
import torch

from speckv.errors import CheckpointError
from speckv.kv import Fp8Attention
from speckv.predictor import llama
from speckv.predictor.fp32_linear import replace_linears
from speckv.predictor.ladder import layer_index
from speckv.predictor.target import cache_layer, deterministic_torch, hooked_forward, output_cache, reading_fp8


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def transformers_head(config, state: dict[str, torch.Tensor], k: int):
    """The target's first k decoder layers as transformers runs them (what target.py runs): a
    truncated causal LM whose ``last_hidden_state`` is h after layer k - 1 (no final norm)."""
    from transformers import AutoModelForCausalLM

    head = copy.deepcopy(config)
    head.num_hidden_layers = k
    head._attn_implementation = "sdpa"
    with torch.device("meta"):  # no weights allocated: the state's own tensors are assigned below
        model = AutoModelForCausalLM.from_config(head, dtype=torch.bfloat16)
    first = {n: t for n, t in state.items() if n == llama.EMBED or (layer_index(n) or 0) < k}
    missing, unexpected = model.load_state_dict(first, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight", "model.norm.weight"}, (missing, unexpected)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=head)  # its buffers were made on meta
    model.model.norm = torch.nn.Identity()  # last_hidden_state is then h after layer k - 1
    model.lm_head = None
    replace_linears(model, lambda _name, w: w.float())  # exactly as the target runs them
    assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    return model


def reference(target, k: int, ids: np.ndarray, fp8: tuple[Fp8Attention, int] | None):
    """h and K/V of ``transformers_head`` (as target.py runs the target)."""
    model = transformers_head(target.config, dict(target.state), k)
    with deterministic_torch(), reading_fp8(*(fp8 or (None, 0))):
        out = hooked_forward(model, ids, None)
    return out.last_hidden_state[0], [cache_layer(output_cache(out), i) for i in range(k)]


def ours(target, k: int, ids: np.ndarray, fp8: tuple[Fp8Attention, int] | None):
    head = llama.exact_head(target.config, dict(target.state), k, "test")
    emitted: list[tuple[int, torch.Tensor]] = []
    with deterministic_torch():
        h, layers = head.run(torch.as_tensor(ids), lambda i, kv: emitted.append((i, kv.clone())), fp8)
    assert [i for i, _ in emitted] == list(range(k))
    assert all(torch.equal(bits(a), bits(b)) for (_, a), b in zip(emitted, layers, strict=True))
    return h, layers


def assert_same(target, k: int, ids: np.ndarray, fp8=None) -> None:
    h_ref, kv_ref = reference(target, k, ids, fp8)
    h, kv = ours(target, k, ids, fp8)
    assert h.dtype == torch.bfloat16 and h.shape == h_ref.shape
    assert torch.equal(bits(h), bits(h_ref))
    for a, b in zip(kv, kv_ref, strict=True):
        assert a.shape == b.shape and torch.equal(bits(a), bits(b))


def fp8_of(target, scale: float) -> Fp8Attention:
    n = target.config.num_hidden_layers
    return Fp8Attention((scale,) * n, (scale,) * n)


@pytest.mark.parametrize("tokens", [1, 2, 37, 300])
@pytest.mark.parametrize("k", [1, 2])
def test_tiny_head_is_the_target_bit_for_bit(tiny_target, tokens, k):
    ids = np.random.default_rng(tokens).integers(0, tiny_target.config.vocab_size, tokens)
    assert_same(tiny_target, k, ids)


@pytest.mark.parametrize("tokens, rows, blocks", [(300, 128, [128, 172]), (256, 128, [128, 128]),
                                                  (255, 128, [255]), (300, 512, [300])])
def test_tiny_head_runs_its_mlp_in_row_blocks(tiny_target, monkeypatch, tokens, rows, blocks):
    """Blocks of ``HEAD_MLP_ROWS`` rows, the last one taking the rest (never a short block), the same bits."""
    monkeypatch.setattr(llama, "HEAD_MLP_ROWS", rows)
    seen: list[int] = []
    real = llama.linear
    monkeypatch.setattr(llama, "linear", lambda x, w: seen.append(x.shape[0]) or real(x, w))
    ids = np.random.default_rng(tokens).integers(0, tiny_target.config.vocab_size, tokens)
    assert_same(tiny_target, 1, ids)
    probe = sum(3 * (len(llama.row_blocks(T, rows)) + 1) for T in llama.HEAD_PROBE_ROWS)  # at construction
    assert seen[probe:] == [tokens] * 4 + [n for n in blocks for _ in range(3)]  # q, k, v, o; gate, up, down


def test_a_head_whose_blocks_change_bits_runs_whole_prompts(tiny_target, monkeypatch):
    """``blocks_keep_bits``: where a block's product differs from the whole prompt's (a wide MLP's
    BLAS reduction; here a linear whose result depends on its row count), the head runs whole."""
    monkeypatch.setattr(llama, "HEAD_MLP_ROWS", 128)
    assert llama.exact_head(tiny_target.config, dict(tiny_target.state), 1, "test").mlp_rows == 128
    real = llama.linear
    monkeypatch.setattr(llama, "linear", lambda x, w: real(x, w) + (x.shape[0] % 2))
    head = llama.exact_head(tiny_target.config, dict(tiny_target.state), 1, "test")
    assert head.mlp_rows is None
    seen: list[int] = []
    monkeypatch.setattr(llama, "linear", lambda x, w: seen.append(x.shape[0]) or real(x, w))
    with deterministic_torch():
        head.run(torch.as_tensor(np.arange(300) % tiny_target.config.vocab_size))
    assert seen == [300] * 7  # q, k, v, o, then gate, up and down over the whole prompt


def test_row_blocks():
    assert llama.row_blocks(0, 512) == [(0, 0)] and llama.row_blocks(1, 512) == [(0, 1)]
    assert llama.row_blocks(1023, 512) == [(0, 1023)] and llama.row_blocks(1024, 512) == [(0, 512), (512, 1024)]
    assert llama.row_blocks(2049, 512) == [(0, 512), (512, 1024), (1024, 1536), (1536, 2049)]
    assert llama.row_blocks(0, 0) == [(0, 0)]  # a whole empty prompt (rows = T = 0)


@pytest.mark.parametrize("toward_zero", [False, True])
def test_tiny_head_reads_fp8_as_the_engine(tiny_target, toward_zero):
    ids = np.random.default_rng(5).integers(0, tiny_target.config.vocab_size, 64)
    fa = fp8_of(tiny_target, 0.004)
    fa = Fp8Attention(fa.k_scales, fa.v_scales, toward_zero)
    assert_same(tiny_target, 2, ids, (fa, 1))
    assert_same(tiny_target, 2, ids, (fa, 2))
    h_plain, _ = ours(tiny_target, 2, ids, None)
    h_fp8, _ = ours(tiny_target, 2, ids, (fa, 2))
    assert not torch.equal(bits(h_plain), bits(h_fp8))  # the rounding reached the attention


@pytest.mark.parametrize("tokens", [1, 97, 1100, 2048])  # MLP row blocks: none, none, 512 + 588, 4 x 512
def test_embedded_head_is_the_target_bit_for_bit(embedded_target, corpus_file, tokens):
    assert llama.exact_head(embedded_target.config, dict(embedded_target.state), 4, "test").mlp_rows == 512
    text = corpus_file("tinyshakespeare.txt").read_text()[:40000]
    ids = embedded_target.tokenize(text, tokens)
    assert len(ids) == tokens
    assert_same(embedded_target, 4, ids)


def test_embedded_head_with_fp8_attention(embedded_target):
    ids = embedded_target.tokenize("The quick brown fox jumps over the lazy dog. " * 12)
    assert_same(embedded_target, 4, ids, (fp8_of(embedded_target, 0.05), 4))


def test_rope_is_transformers_rope(embedded_target):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = embedded_target.config
    x = torch.randn(1, 3, 2048, llama.head_dim(cfg)).to(torch.bfloat16)
    cos_ref, sin_ref = LlamaRotaryEmbedding(cfg)(x, torch.arange(2048)[None])
    cos, sin = llama.rope_tables(cfg, 2048)
    assert torch.equal(bits(cos), bits(cos_ref)) and torch.equal(bits(sin), bits(sin_ref))
    assert torch.equal(bits(llama.rope(x, cos, sin)), bits(apply_rotary_pos_emb(x, x, cos, sin)[0]))


def test_scaled_rope_is_transformers_rope(tiny_target):
    """A Llama 3 RoPE (a static scaled table) runs through transformers' rotary embedding: the head is
    still the transformers model's bits."""
    import copy

    cfg = copy.deepcopy(tiny_target.config)
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    assert llama.rope_theta(cfg) is None
    ids = np.random.default_rng(9).integers(0, cfg.vocab_size, 200)
    target = type(tiny_target)(tiny_target.name, tiny_target.model, tiny_target.tokenizer,
                               tiny_target.weights_sha256, tiny_target.state)
    target.model = copy.copy(tiny_target.model)
    target.model.config = cfg
    h_ref, kv_ref = reference(target, 2, ids, None)
    h, kv = ours(target, 2, ids, None)
    h_plain, _ = ours(tiny_target, 2, ids, None)
    assert torch.equal(bits(h), bits(h_ref)) and not torch.equal(bits(h), bits(h_plain))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(kv, kv_ref, strict=True))


def test_other_models_rope_and_missing_weights_are_refused(tiny_target):
    import copy

    cfg = copy.deepcopy(tiny_target.config)
    cfg.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(CheckpointError, match="dynamic"):
        llama.exact_head(cfg, dict(tiny_target.state), 1, "w8a8:1")
    cfg = copy.deepcopy(tiny_target.config)
    cfg.hidden_act = "gelu"
    with pytest.raises(CheckpointError, match="gelu"):
        llama.exact_head(cfg, dict(tiny_target.state), 1, "w8a8:1")
    state = dict(tiny_target.state)
    del state["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match="up_proj"):
        llama.exact_head(tiny_target.config, state, 1, "w8a8:1")


SIDECAR_LOAD = """
import sys
from speckv.server.config import ServerConfig
from speckv.server.runtime import Runtime
import numpy as np
runtime = Runtime.load(ServerConfig(role="decoder"))
assert runtime.predictor.checkpoint.rung.kind == "w8a8", runtime.predictor.checkpoint.rung
runtime.predictor.mu(np.arange(1, 40))
print(sorted(m for m in sys.modules if m.split(".")[0] == "transformers"))
"""


def test_a_sidecar_on_the_shipped_rung_never_imports_transformers():
    """Loading the shipped checkpoint (derived weights, read lazily) and a pass leave transformers
    unimported: its config classes and Llama modelling code cost ~100 MiB resident
    (benchmarks/RESULTS.md, "AVX2 and a lean sidecar")."""
    out = subprocess.run([sys.executable, "-c", SIDECAR_LOAD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("which", ["tiny", "embedded"])
def test_plain_config_reads_what_autoconfig_reads(which, tiny_model_dir):
    from transformers import AutoConfig

    from speckv.predictor.target import target_dir

    path = tiny_model_dir if which == "tiny" else target_dir("default")
    light, full = llama.load_config(path), AutoConfig.from_pretrained(path, local_files_only=True)
    assert not isinstance(light, type(full))
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                 "tie_word_embeddings", "attention_bias", "mlp_bias"):
        assert getattr(light, name) == getattr(full, name), name
    assert llama.rope_theta(light) == llama.rope_theta(full)
    assert isinstance(llama.load_config(path, light=False), type(full))


def test_other_models_and_scaled_rope_fall_back_to_autoconfig(tmp_path, tiny_model_dir):
    import json

    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert llama.read_config(tmp_path / "config.json") is None
    base = json.loads((tiny_model_dir / "config.json").read_text())
    for extra in ({"rope_scaling": {"type": "linear", "factor": 2.0}},
                  {"rope_parameters": {"type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                  {"rope_parameters": {"rope_type": "default"}}, {"sliding_window": 64}):
        (tmp_path / "config.json").write_text(json.dumps({**base, "rope_parameters": None, **extra}))
        assert llama.read_config(tmp_path / "config.json") is None, extra
    (tmp_path / "config.json").write_text(json.dumps({**base, "rope_parameters": None, "rope_theta": 500.0}))
    assert llama.rope_theta(llama.read_config(tmp_path / "config.json")) == 500.0
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_act": "gelu", "hidden_size": 8}')
    assert llama.read_config(tmp_path / "config.json") is None
    assert llama.read_config(tmp_path / "missing.json") is None
