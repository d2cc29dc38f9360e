"""Shared fixtures: the real embedded model (loaded once per session), a tiny
randomly initialised Llama written to disk as a Hugging Face directory, and the
shared text corpus.

The embedded model (SmolLM2-135M) takes ~10 s to load with its predictor; every
test that needs it uses ``embedded_session`` / ``embedded_target`` so it is
loaded once. The tiny model is built by the test session itself (seeded), so
no model hub and no download are involved.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import pytest
from require import NUMERIC_ENV_SKIP, missing

REPO_ROOT = Path(__file__).resolve().parents[1]
# CI puts shared/ beside the clone: <parent>/main and <parent>/shared.
CORPUS_DIR = REPO_ROOT.parent / "shared" / "corpus"
# the fuzzing harness (benchmarks/fuzzing, driven by benchmarks/fuzz.py) is imported by its tests
if str(REPO_ROOT / "benchmarks") not in sys.path:
    sys.path.append(str(REPO_ROOT / "benchmarks"))

TINY_VOCAB = 300
TINY_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A tiny model for tests: two layers, four heads, two key-value heads.",
    "Lossless compression of the key-value cache needs a predictor on both sides.",
    "Every bit the coder spends is the mismatch between the model and the data.",
    "Bridges hum in the wind because every span has a note of its own.",
    "0123456789 !? ,.;: ()[]{} +-*/= <> @#$%^&_ ~ ' \" ` | \\",
]
# ~2 KB of text for calibrating the tiny model; byte-level BPE covers every byte.
TINY_TEXT = " ".join(TINY_SENTENCES * 8) + "\n"


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """The root logger as it was before each test. ``speckv.cli.main.main`` run in-process
    (and ``logs.configure``) replaces the root handlers with one on the ``sys.stderr`` of that
    moment, a test's capture that pytest closes when the test ends; left in place, every later
    warning (a sidecar's, from its loop thread) fails there with "--- Logging error ---"."""
    root, own = logging.getLogger(), logging.getLogger("speckv")
    handlers, levels, showwarning = list(root.handlers), (root.level, own.level), warnings.showwarning
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(levels[0])
    own.setLevel(levels[1])
    if warnings.showwarning is not showwarning:  # logs.configure turned logging.captureWarnings on
        logging.captureWarnings(False)
        warnings.showwarning = showwarning


@pytest.fixture(scope="session")
def emu_work(tmp_path_factory) -> Path:
    """One folder for the CUDA emulator's builds (tests/cuda_emu.py keys each by source and -D flags),
    so the test files that emulate the same kernels build them once."""
    return tmp_path_factory.mktemp("cuda_emu")


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    if not CORPUS_DIR.is_dir():
        missing("CORPUS", f"shared corpus not found at {CORPUS_DIR} (CI checks shared/ out beside the clone)")
    return CORPUS_DIR


@pytest.fixture(scope="session")
def corpus_file(corpus_dir):
    """``corpus_file(name)``: a corpus file's path; skips the test when it is missing."""

    def get(name: str) -> Path:
        path = corpus_dir / name
        if not path.is_file():
            missing("CORPUS", f"corpus file {path} is missing")
        return path

    return get


@pytest.fixture(scope="session")
def embedded_target():
    """The embedded SmolLM2-135M target (``load_target()``), loaded once."""
    from speckv.predictor.target import load_target

    return load_target()


@pytest.fixture(scope="session")
def embedded_session(embedded_target):
    """What ``Session.open()`` builds (the embedded target and the shipped default
    predictor), sharing the already loaded target so target-only tests do not
    depend on the predictor checkpoint. ``Session.open()`` itself runs in
    test_predictor's cross-process determinism test."""
    from speckv.predictor.checkpoint import load_checkpoint
    from speckv.predictor.predict import Predictor
    from speckv.predictor.session import Session
    from speckv.predictor.store import default_checkpoint_dir

    ckpt = load_checkpoint(default_checkpoint_dir())
    return Session(embedded_target, Predictor.from_checkpoint(ckpt, embedded_target))


@pytest.fixture(scope="session")
def shipped_numeric_env(embedded_target) -> None:
    """Skips the test unless this machine computes the canary KV that the shipped
    checkpoint's manifest records (``numeric_env``): tests that compare calibration
    bytes or mu digests with committed ones hold only where the checkpoint was built.
    What must hold everywhere (same process, two processes, two rebuilds on one
    machine) is tested without this fixture."""
    from speckv.predictor.store import MANIFEST, default_checkpoint_dir
    from speckv.predictor.target import numeric_env

    want = json.loads((default_checkpoint_dir() / MANIFEST).read_bytes()).get("numeric_env") or {}
    here = numeric_env(embedded_target)
    # NOTE: the whole record, torch build and kernel path included: they are manifest bytes too
    if want != here:
        pytest.skip(f"{NUMERIC_ENV_SKIP}: canary KV {here['canary_kv_sha256'][:12]} here "
                    f"(torch {here['torch']}, {here['cpu_capability']}), "
                    f"{str(want.get('canary_kv_sha256'))[:12]} where it was built "
                    f"(torch {want.get('torch')}, {want.get('cpu_capability')})")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say how many tests skipped because this CPU rounds differently from the builder's."""
    skipped = terminalreporter.stats.get("skipped", [])
    n = sum(1 for r in skipped if NUMERIC_ENV_SKIP in str(getattr(r, "longrepr", "")))
    terminalreporter.write_line(f"speckv: {n} test(s) skipped because the {NUMERIC_ENV_SKIP}")


def _build_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TINY_SENTENCES, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama (random weights, seed 0) saved in BF16 with a byte-level BPE tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = _build_tiny_tokenizer()
    assert len(tok) <= TINY_VOCAB
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512, eos_token_id=0,
                         bos_token_id=0, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir):
    from speckv.predictor.target import load_target

    return load_target(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text(TINY_TEXT, encoding="utf-8")
    return path
