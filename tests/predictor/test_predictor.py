"""Pinned predictor checkpoints: build, pin verification, determinism of mu,
calibration statistics, and the reproducibility of the shipped default.

Checkpoints for the tiny random Llama are built once per module (64 tokens of
calibration text) both with a weights file and with derived weights.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
TOKENS, SEGMENT = 64, 32
MU_PROMPT = "Speculative coding needs the same bits on both sides."


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def mu_digest(mu: torch.Tensor) -> str:
    return hashlib.sha256(bits(mu).numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_ckpts(tiny_target, tiny_text, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    w_dir, d_dir = root / "weights", root / "derived"
    pin_w = build_checkpoint(tiny_target, tiny_text, w_dir, tokens=TOKENS, segment=SEGMENT)
    pin_d = build_checkpoint(tiny_target, tiny_text, d_dir, tokens=TOKENS, segment=SEGMENT,
                             derive_weights=True)
    return {"weights": (w_dir, pin_w), "derived": (d_dir, pin_d)}


@pytest.fixture
def ckpt_copy(tiny_ckpts, tmp_path):
    """A private copy of the weights-file checkpoint, for tampering."""
    src, pin = tiny_ckpts["weights"]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst, pin


def flip_byte(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


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


# ------------------------------------------------------------------ pin verification


def fresh_copy(tiny_ckpts, tmp_path: Path, tag: str) -> tuple[Path, str]:
    src, pin = tiny_ckpts["weights"]
    dst = tmp_path / tag
    shutil.copytree(src, dst)
    return dst, pin


def test_flipped_byte_in_any_file_is_pin_mismatch(tiny_ckpts, tmp_path):
    """One flipped byte (first, middle, last) in every file the manifest lists."""
    names = sorted(load_checkpoint(tiny_ckpts["weights"][0]).manifest["files"])
    assert {CALIB, CONFIG, WEIGHTS} <= set(names)
    for name in names:
        for where in ("first", "middle", "last"):
            path, pin = fresh_copy(tiny_ckpts, tmp_path, f"{name}-{where}")
            size = (path / name).stat().st_size
            flip_byte(path / name, {"first": 0, "middle": size // 2, "last": size - 1}[where])
            with pytest.raises(PinMismatchError) as ei:
                load_checkpoint(path)
            assert type(ei.value) is PinMismatchError and name in str(ei.value), (name, where)
            with pytest.raises(PinMismatchError):
                load_checkpoint(path, pin=pin)


@settings(max_examples=40, deadline=None, database=None)
@given(pos=st.integers(0, 10**6))
def test_flipped_byte_in_manifest_is_pin_mismatch(tiny_ckpts, tmp_path_factory, pos):
    src, pin = tiny_ckpts["weights"]
    path = tmp_path_factory.mktemp("m") / "ckpt"
    shutil.copytree(src, path)
    flip_byte(path / MANIFEST, pos)
    with pytest.raises(PinMismatchError) as ei:
        load_checkpoint(path, pin=pin)
    assert type(ei.value) is PinMismatchError


def test_flipped_manifest_without_expected_pin(ckpt_copy):
    path, pin = ckpt_copy
    raw = (path / MANIFEST).read_bytes()
    # breaking the JSON: a typed checkpoint error (the class observed is PinMismatchError)
    flip_byte(path / MANIFEST, 0)  # '{' -> 'z'
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(path)
    assert issubclass(type(ei.value), CheckpointError)
    assert type(ei.value) is PinMismatchError
    # a digest of a listed file: the file no longer matches
    (path / MANIFEST).write_bytes(raw)
    digest = load_checkpoint(path).manifest["files"][CALIB]
    flip_byte(path / MANIFEST, raw.index(digest.encode()) + 5)
    with pytest.raises(PinMismatchError):
        load_checkpoint(path)
    # a free-text field: still valid and canonical, so only the pin tells
    (path / MANIFEST).write_bytes(raw.replace(b'"fp8-copy"', b'"fp8-copx"'))
    assert load_checkpoint(path).pin != pin
    with pytest.raises(PinMismatchError):
        load_checkpoint(path, pin=pin)


def test_wrong_expected_pin(tiny_ckpts):
    path, pin = tiny_ckpts["weights"]
    other = tiny_ckpts["derived"][1]
    for wrong in (other, "0" * 64, pin[:-1] + ("0" if pin[-1] != "0" else "1"), "", "not-a-pin"):
        with pytest.raises(PinMismatchError):
            load_checkpoint(path, pin=wrong)


def test_missing_file_is_checkpoint_error(tiny_ckpts, tmp_path):
    names = sorted(load_checkpoint(tiny_ckpts["weights"][0]).manifest["files"]) + [MANIFEST]
    for name in names:
        path, _ = fresh_copy(tiny_ckpts, tmp_path, name)
        (path / name).unlink()
        with pytest.raises(CheckpointError) as ei:
            load_checkpoint(path)
        assert type(ei.value) is CheckpointError, name


def test_missing_dir_is_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "nope")


def test_non_canonical_or_unknown_manifest(ckpt_copy):
    path, _ = ckpt_copy
    manifest = json.loads((path / MANIFEST).read_bytes())
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2))
    with pytest.raises(PinMismatchError, match="canonical"):
        load_checkpoint(path)
    write_manifest(path, {**manifest, "format_version": 99})
    with pytest.raises(CheckpointError, match="unsupported format") as ei:
        load_checkpoint(path)
    assert type(ei.value) is CheckpointError


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


@pytest.mark.parametrize("drop", ["calib.npz", "tables.npz", "config.json"])
def test_manifest_must_list_every_checkpoint_file(tmp_path, drop):
    """Re-signing a manifest that no longer covers a file must not pass verification."""
    from speckv.predictor.checkpoint import load_checkpoint
    from speckv.predictor.store import default_checkpoint_dir

    d = tmp_path / "ck"
    shutil.copytree(default_checkpoint_dir(), d)
    manifest = json.loads((d / MANIFEST).read_bytes())
    del manifest["files"][drop]
    (d / MANIFEST).write_bytes(canonical_json(manifest))
    with pytest.raises(PinMismatchError, match="must list"):
        load_checkpoint(d)


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
