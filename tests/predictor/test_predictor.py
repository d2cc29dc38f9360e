"""Pinned predictor checkpoints: build, the CLI, determinism of mu, calibration
statistics, and the reproducibility of the shipped default (pin verification:
test_predictor_pin.py).

The tiny random Llama's checkpoints (conftest.py) are built once (64 tokens of
calibration text) both with a weights file and with derived weights.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from predictor_helpers import SEGMENT, TOKENS

from speckv.cli.main import main as cli_main
from speckv.errors import CalibrationError, CheckpointError, PinMismatchError
from speckv.predictor.calibrate import MIXTURE, WIDE, build_checkpoint, segments
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.predict import Predictor
from speckv.predictor.store import (
    CALIB,
    CONFIG,
    MANIFEST,
    SHIPPED_RUNG,
    WEIGHTS,
    canonical_json,
    default_checkpoint_dir,
    write_manifest,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
MU_PROMPT = "Speculative coding needs the same bits on both sides."


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def mu_digest(mu: torch.Tensor) -> str:
    return hashlib.sha256(bits(mu).numpy().tobytes()).hexdigest()


# ------------------------------------------------------------------ build and load


@pytest.mark.parametrize("kind", ["weights", "derived"])
def test_build_and_load_agree_on_pin(tiny_ckpts, kind):
    path, pin = tiny_ckpts[kind]
    raw = (path / MANIFEST).read_bytes()
    assert pin == hashlib.sha256(raw).hexdigest()
    ck = load_checkpoint(path)
    assert ck.pin == pin
    assert load_checkpoint(path, pin=pin).pin == pin
    assert load_checkpoint(path, pin=pin.upper()).pin == pin
    assert canonical_json(ck.manifest) == raw
    files = set(ck.manifest["files"])
    assert {CALIB, CONFIG} <= files and (WEIGHTS in files) is (kind == "weights")
    assert {p.name for p in path.iterdir()} == files | {MANIFEST}  # every file is pinned
    assert ck.derived_weights is (kind == "derived")
    assert ck.manifest["calibration"]["tokens"] == TOKENS
    assert ck.manifest["calibration"]["segment_tokens"] == SEGMENT


def test_weights_and_derived_share_everything_but_the_file(tiny_ckpts):
    (w, pin_w), (d, pin_d) = tiny_ckpts["weights"], tiny_ckpts["derived"]
    assert pin_w != pin_d
    mw, md = load_checkpoint(w).manifest, load_checkpoint(d).manifest
    assert set(mw["files"]) - {WEIGHTS} == set(md["files"])
    for name in md["files"]:
        assert (w / name).read_bytes() == (d / name).read_bytes(), name
    assert mw["weights"]["sha256"] == md["weights"]["sha256"]
    assert mw["weights"]["file"] == WEIGHTS and md["weights"]["file"] is None


def test_rebuild_is_byte_identical(tiny_target, tiny_text, tiny_ckpts, tmp_path):
    path, pin = tiny_ckpts["weights"]
    assert build_checkpoint(tiny_target, tiny_text, tmp_path, tokens=TOKENS, segment=SEGMENT) == pin
    for f in path.iterdir():
        assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f.name


def test_predictors_from_file_and_derived_weights_agree(tiny_ckpts, tiny_target):
    pw = Predictor.from_checkpoint(load_checkpoint(tiny_ckpts["weights"][0]))
    pd = Predictor.from_checkpoint(load_checkpoint(tiny_ckpts["derived"][0]), tiny_target)
    assert pw.pin == tiny_ckpts["weights"][1] and pd.pin == tiny_ckpts["derived"][1]
    ids = tiny_target.tokenize("Every bit the coder spends is the mismatch.")
    mw, md = pw.mu(ids), pd.mu(ids)
    assert mw.shape == (2, 2, 2, len(ids), 16) and mw.dtype == torch.bfloat16
    assert torch.equal(bits(mw), bits(md))
    assert torch.equal(bits(mw), bits(pw.mu(ids)))
    # the FP8 copy is close to the target, but not the target
    kv = tiny_target.kv(ids)
    assert not torch.equal(bits(mw), bits(kv))
    r = (kv.double() - mw.double()).square().mean().sqrt().item()
    assert r < 0.2 * kv.double().square().mean().sqrt().item()


def test_derived_weights_need_the_right_target(tiny_ckpts, embedded_target):
    ck = load_checkpoint(tiny_ckpts["derived"][0])
    with pytest.raises(CheckpointError, match="pass the target"):
        Predictor.from_checkpoint(ck)  # not embedded: cannot load it by itself
    with pytest.raises(PinMismatchError):
        Predictor.from_checkpoint(ck, embedded_target)


def test_weights_digest_is_checked_at_load(ckpt_copy, tiny_target):
    """A consistently re-hashed manifest with other weights loads, but the
    predictor refuses weights whose digest is not the manifest's."""
    from safetensors.torch import load_file, save_file

    path, _ = ckpt_copy
    state = load_file(str(path / WEIGHTS))
    name = next(k for k in sorted(state) if k.endswith(".weight_scale"))
    state[name] = state[name] * 2
    save_file(state, str(path / WEIGHTS))
    manifest = json.loads((path / MANIFEST).read_bytes())
    manifest["files"][WEIGHTS] = hashlib.sha256((path / WEIGHTS).read_bytes()).hexdigest()
    new_pin = write_manifest(path, manifest)
    ck = load_checkpoint(path, pin=new_pin)
    with pytest.raises(PinMismatchError, match="weights digest"):
        Predictor.from_checkpoint(ck, tiny_target)


# ------------------------------------------------------------------ the CLI


def test_cli_predictor_info_prints_pin(tiny_ckpts, capsys):
    path, pin = tiny_ckpts["weights"]
    assert cli_main(["predictor", "info", str(path), "--json"]) == 0
    desc = json.loads(capsys.readouterr().out)
    assert desc["pin"] == pin
    assert desc["weights"]["file"] == WEIGHTS and desc["arch"]["layers"] == 2
    assert cli_main(["predictor", "info", str(path), "--pin", pin]) == 0
    assert pin in capsys.readouterr().out
    assert cli_main(["predictor", "info", str(path), "--pin", "0" * 64]) == 2
    captured = capsys.readouterr()
    assert "pin mismatch" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_cli_predictor_info_default(capsys):
    assert cli_main(["predictor", "info", str(default_checkpoint_dir()), "--json"]) == 0
    desc = json.loads(capsys.readouterr().out)
    raw = (default_checkpoint_dir() / MANIFEST).read_bytes()
    assert desc["pin"] == hashlib.sha256(raw).hexdigest()
    assert desc["target"]["source"] == "embedded"


def test_cli_predictor_build(tiny_model_dir, tiny_text, tmp_path, capsys):
    out = tmp_path / "built"
    rc = cli_main(["predictor", "build", "--target", str(tiny_model_dir), "--calib", str(tiny_text),
                   "--out", str(out), "--tokens", "40"])
    assert rc == 0
    pin = capsys.readouterr().out.strip()
    ck = load_checkpoint(out, pin=pin)
    assert ck.manifest["calibration"]["tokens"] == 40
    assert ck.manifest["target"]["source"] == "path"
    assert int(ck.calib.hist_bf16.sum()) == 2 * 2 * 2 * 40 * 16


# ------------------------------------------------------------------ calibration


def test_calibration_statistics(tiny_ckpts, tiny_target, tiny_text):
    """sigma^2 and the histograms, recomputed independently from both models."""
    from speckv.predictor.fp8 import kv_to_fp8

    path, _ = tiny_ckpts["weights"]
    ck = load_checkpoint(path)
    calib = ck.calib
    assert calib.sigma2.shape == (2, 2, 2, 16) and calib.sigma2.dtype == np.float64
    assert np.isfinite(calib.sigma2).all() and (calib.sigma2 > 0).all()
    n = 2 * 2 * 2 * TOKENS * 16
    assert calib.hist_bf16.shape == (65536,) and int(calib.hist_bf16.sum()) == n
    assert calib.hist_fp8.shape == (256,) and int(calib.hist_fp8.sum()) == n
    assert calib.mixture == MIXTURE and calib.wide == WIDE

    pred = Predictor.from_checkpoint(ck)
    ids = tiny_target.tokenize(tiny_text.read_text())[:TOKENS]
    sum_r2, count = np.zeros((2, 2, 2, 16)), 0
    hist16, hist8 = np.zeros(65536, np.int64), np.zeros(256, np.int64)
    for start in range(0, TOKENS, SEGMENT):
        seg = ids[start : start + SEGMENT]
        kv, mu = tiny_target.kv(seg), pred.mu(seg)
        r = kv.double().numpy() - mu.double().numpy()
        sum_r2 += (r**2).sum(axis=3)
        count += len(seg)
        hist16 += np.bincount(bits(kv).numpy().view(np.uint16).ravel(), minlength=65536)
        hist8 += np.bincount(kv_to_fp8(kv)[0].numpy().ravel(), minlength=256)
    np.testing.assert_allclose(calib.sigma2, sum_r2 / count, rtol=1e-12, atol=0)
    assert np.array_equal(calib.hist_bf16, hist16)
    assert np.array_equal(calib.hist_fp8, hist8)


def test_calibration_text_too_short(tiny_target, tiny_text, tmp_path):
    with pytest.raises(CalibrationError):
        build_checkpoint(tiny_target, tiny_text, tmp_path / "x", tokens=100_000, segment=SEGMENT)


def test_segments():
    ids = np.arange(100)
    segs = segments(ids, 70, 32)
    assert [len(s) for s in segs] == [32, 32, 6]
    assert np.array_equal(np.concatenate(segs), ids[:70])
    with pytest.raises(CalibrationError):
        segments(ids, 101, 32)


# ------------------------------------------------------------------ the default predictor


def test_default_predictor_mu_is_deterministic_across_processes(embedded_session):
    sess = embedded_session
    ids = sess.target.tokenize(MU_PROMPT)
    a = sess.predictor.mu(ids)
    b = sess.predictor.mu(ids)
    assert a.shape == (30, 2, 3, len(ids), 64) and a.dtype == torch.bfloat16
    assert torch.equal(bits(a), bits(b))
    code = textwrap.dedent(f"""
        import hashlib, torch
        from speckv.predictor.session import Session
        sess = Session.open()  # embedded target, shipped predictor (weights derived from the target)
        mu = sess.predictor.mu(sess.target.tokenize({MU_PROMPT!r}))
        print(sess.pin)
        print(hashlib.sha256(mu.contiguous().view(torch.int16).numpy().tobytes()).hexdigest())
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pin, digest = proc.stdout.strip().splitlines()[-2:]
    assert pin == sess.pin
    assert digest == mu_digest(a)


@pytest.mark.slow
def test_shipped_default_predictor_is_reproducible(embedded_target, shipped_numeric_env, corpus_file, tmp_path):
    """Rebuilding the shipped checkpoint from its recipe gives the same bytes."""
    text = corpus_file("wikitext2-valid.txt")
    pin = build_checkpoint(embedded_target, text, tmp_path, derive_weights=True, source="embedded",
                           rung=SHIPPED_RUNG)
    shipped = default_checkpoint_dir()
    assert pin == hashlib.sha256((shipped / MANIFEST).read_bytes()).hexdigest()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in shipped.iterdir())
    for f in shipped.iterdir():
        assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f.name


def test_predictor_device_selection(embedded_session):
    """``to(device)``: auto stays on the CPU without CUDA, cuda without a device is a clear
    error, and mu is bit-identical after a round through ``to``."""
    import torch

    from speckv.errors import CheckpointError

    pred = embedded_session.predictor
    ids = embedded_session.target.tokenize("Where does the predictor run?")
    before = pred.mu(ids)
    assert pred.to("cpu").device == "cpu"
    if not torch.cuda.is_available():
        assert pred.to("auto").device == "cpu"
        with pytest.raises(CheckpointError, match="no CUDA device"):
            pred.to("cuda")
    with pytest.raises(ValueError, match="cpu, cuda"):
        pred.to("tpu")
    assert torch.equal(pred.to("cpu").mu(ids).view(torch.int16), before.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
def test_predictor_on_cuda_is_deterministic(embedded_session):
    import torch

    pred = embedded_session.predictor
    ids = embedded_session.target.tokenize("Twice on the GPU, the same bits.")
    try:
        a, b = pred.to("cuda").mu(ids), pred.mu(ids)
    finally:
        pred.to("cpu")
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
