"""The predictor ladder (speckv/predictor/ladder.py): rungs fp8, hybrid:k and none in the pinned
checkpoint, their mu (determinism, hybrid layers equal to the target's KV, the stored
means), manifest/pin round trips and typed errors for bad rungs.

Tiny-model checkpoints are built once per module (64 calibration tokens); one small
hybrid checkpoint of the embedded model checks the bit-exact BF16 layers on the real
target.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

from speckv.cli.main import main as cli_main
from speckv.coder.codec import Codec, bf16_bits
from speckv.errors import CheckpointError, PinMismatchError
from speckv.predictor.calibrate import SIGMA2_FLOOR, build_checkpoint, segments
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.ladder import MEANS, Rung, parse_rung
from speckv.predictor.predict import Predictor
from speckv.predictor.store import (
    MANIFEST,
    SHIPPED_RUNG,
    WEIGHTS,
    canonical_json,
    default_checkpoint_dir,
    write_manifest,
)

TOKENS, SEGMENT = 64, 32
PROMPT = "Every bit the coder spends is the mismatch."
RUNGS = ("fp8", "hybrid:1", "hybrid:2", "none")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.fixture(scope="module")
def ladder_ckpts(tiny_target, tiny_text, tmp_path_factory):
    """rung -> (dir, pin) for the tiny 2-layer model, weights written to the checkpoint."""
    root = tmp_path_factory.mktemp("ladder")
    out = {}
    for rung in RUNGS:
        d = root / rung.replace(":", "-")
        out[rung] = (d, build_checkpoint(tiny_target, tiny_text, d, tokens=TOKENS, segment=SEGMENT, rung=rung))
    return out


@pytest.fixture(scope="module")
def ladder_predictors(ladder_ckpts):
    return {rung: Predictor.from_checkpoint(load_checkpoint(d)) for rung, (d, _) in ladder_ckpts.items()}


# ------------------------------------------------------------------ rung names


def test_parse_rung_and_nominal_cost():
    assert parse_rung("fp8", 30) == Rung("fp8") and parse_rung("none", 30) == Rung("none")
    assert parse_rung("hybrid:4", 30) == Rung("hybrid", 4) and parse_rung("hybrid:30", 30).name == "hybrid:30"
    for bad in ("", "FP8", "bf16", "hybrid", "hybrid:", "hybrid:0", "hybrid:31", "hybrid:04", "hybrid:-1",
                "hybrid:2x", " fp8", None, 8, ["fp8"]):
        with pytest.raises(CheckpointError):
            parse_rung(bad, 30)
    assert parse_rung("fp8", 30).nominal_cost(30) == 0.5
    assert parse_rung("hybrid:6", 30).nominal_cost(30) == pytest.approx((6 + 12) / 30)
    assert parse_rung("hybrid:30", 30).nominal_cost(30) == 1.0 and parse_rung("none", 30).nominal_cost(30) == 0


@pytest.mark.parametrize("text", ["early:4", "early:12", "early"])
def test_early_exit_rungs_are_refused_with_the_reason(text):
    """early:K left the ladder (issue 17): a checkpoint or a build naming it gets why and what instead."""
    with pytest.raises(CheckpointError, match=r"early-exit rungs were removed.*worse than fp8.*hybrid:K or w8a8x:K"):
        parse_rung(text, 30)


# ------------------------------------------------------------------ manifest and pin


@pytest.mark.parametrize("rung", RUNGS)
def test_manifest_pin_round_trip(ladder_ckpts, rung):
    path, pin = ladder_ckpts[rung]
    raw = (path / MANIFEST).read_bytes()
    assert pin == hashlib.sha256(raw).hexdigest()
    ck = load_checkpoint(path, pin=pin)
    assert canonical_json(ck.manifest) == raw
    assert ck.rung.name == rung and ck.describe()["rung"] == rung
    assert ("rung" in ck.manifest) is (rung != "fp8")  # fp8 keeps the original manifest layout
    assert {p.name for p in path.iterdir()} == set(ck.manifest["files"]) | {MANIFEST}
    assert (MEANS in ck.manifest["files"]) is (rung == "none")
    assert (WEIGHTS in ck.manifest["files"]) is (rung != "none")
    assert ck.derived_weights is False
    if rung.startswith("hybrid"):
        assert ck.manifest["weights"]["bf16_layers"] == int(rung.split(":")[1])
    assert len({p for _, p in ladder_ckpts.values()}) == len(RUNGS)  # the rung changes the pin


def test_shipped_default_is_rung_w8a8x_4_with_the_tuned_model():
    ck = load_checkpoint(default_checkpoint_dir())
    assert ck.rung.name == SHIPPED_RUNG == "w8a8x:4" and ck.manifest["rung"] == "w8a8x:4" and ck.rung.own_silu
    assert ck.manifest["files"]["smooth.npz"] and ck.derived_weights
    assert ck.tuned_tables is not None and ck.manifest["models"]["tuned"]["id"] == 2


def test_rebuild_is_byte_identical(tiny_target, tiny_text, ladder_ckpts, tmp_path):
    for rung in ("hybrid:1", "none"):
        path, pin = ladder_ckpts[rung]
        out = tmp_path / rung.replace(":", "-")
        assert build_checkpoint(tiny_target, tiny_text, out, tokens=TOKENS, segment=SEGMENT, rung=rung) == pin
        for f in path.iterdir():
            assert (out / f.name).read_bytes() == f.read_bytes(), (rung, f.name)


def test_rebuilding_another_rung_in_place_leaves_no_stale_file(tiny_target, tiny_text, tmp_path):
    build_checkpoint(tiny_target, tiny_text, tmp_path, tokens=TOKENS, segment=SEGMENT, rung="none")
    assert (tmp_path / MEANS).is_file()
    build_checkpoint(tiny_target, tiny_text, tmp_path, tokens=TOKENS, segment=SEGMENT, rung="hybrid:1")
    assert not (tmp_path / MEANS).exists()
    assert load_checkpoint(tmp_path).rung.name == "hybrid:1"


def test_means_file_is_pinned(ladder_ckpts, tmp_path):
    src, pin = ladder_ckpts["none"]
    d = tmp_path / "ck"
    shutil.copytree(src, d)
    data = bytearray((d / MEANS).read_bytes())
    data[-1] ^= 1
    (d / MEANS).write_bytes(bytes(data))
    with pytest.raises(PinMismatchError, match=MEANS):
        load_checkpoint(d, pin=pin)


# ------------------------------------------------------------------ bad rungs


@pytest.mark.parametrize("bad", ["fp16", "hybrid:3", "hybrid:0", "Hybrid:1", 2, None])
def test_bad_rung_in_manifest_is_checkpoint_error(ladder_ckpts, tmp_path, bad):
    src, _ = ladder_ckpts["hybrid:1"]
    d = tmp_path / "ck"
    shutil.copytree(src, d)
    manifest = json.loads((d / MANIFEST).read_bytes())
    manifest["rung"] = bad
    write_manifest(d, manifest)  # consistently re-pinned: only the rung is wrong
    with pytest.raises(CheckpointError, match="rung"):
        load_checkpoint(d)


def test_rung_and_weights_entry_must_agree(ladder_ckpts, tmp_path):
    for src_rung, new_rung in (("none", "fp8"), ("hybrid:1", "none")):
        src, _ = ladder_ckpts[src_rung]
        d = tmp_path / src_rung.replace(":", "-")
        shutil.copytree(src, d)
        manifest = json.loads((d / MANIFEST).read_bytes())
        manifest["rung"] = new_rung
        write_manifest(d, manifest)
        with pytest.raises(CheckpointError, match="disagree"):
            load_checkpoint(d)


def test_bad_rung_at_build(tiny_target, tiny_model_dir, tiny_text, tmp_path, capsys):
    with pytest.raises(CheckpointError, match="rung"):
        build_checkpoint(tiny_target, tiny_text, tmp_path / "x", tokens=TOKENS, segment=SEGMENT, rung="hybrid:3")
    assert not (tmp_path / "x").exists()
    assert cli_main(["predictor", "build", "--target", str(tiny_model_dir), "--calib",
                     str(tiny_text), "--out", str(tmp_path / "y"), "--rung", "int4"]) == 2
    assert "unknown predictor rung" in capsys.readouterr().err


def test_cli_build_with_rung(tiny_model_dir, tiny_text, tmp_path, capsys):
    out = tmp_path / "built"
    assert cli_main(["predictor", "build", "--target", str(tiny_model_dir), "--calib", str(tiny_text),
                     "--out", str(out), "--tokens", "40", "--rung", "none"]) == 0
    pin = capsys.readouterr().out.strip()
    assert cli_main(["predictor", "info", str(out), "--pin", pin, "--json"]) == 0
    desc = json.loads(capsys.readouterr().out)
    assert desc["rung"] == "none" and desc["kind"] == "channel-mean" and desc["weights"] is None


# ------------------------------------------------------------------ mu


@pytest.mark.parametrize("rung", RUNGS)
def test_mu_is_deterministic_across_instances(ladder_ckpts, ladder_predictors, tiny_target, rung):
    ids = tiny_target.tokenize(PROMPT)
    a = ladder_predictors[rung].mu(ids)
    b = Predictor.from_checkpoint(load_checkpoint(ladder_ckpts[rung][0])).mu(ids)
    assert a.shape == (2, 2, 2, len(ids), 16) and a.dtype == torch.bfloat16
    assert torch.equal(bits(a), bits(b))
    assert torch.equal(bits(a), bits(ladder_predictors[rung].mu(ids)))
    assert ladder_predictors[rung].mu(ids[:0]).shape == (2, 2, 2, 0, 16)


def test_hybrid_layers_equal_the_target(ladder_predictors, tiny_target):
    ids = tiny_target.tokenize(PROMPT)
    kv = tiny_target.kv(ids)
    h1, h2, fp8 = (ladder_predictors[r].mu(ids) for r in ("hybrid:1", "hybrid:2", "fp8"))
    assert torch.equal(bits(h1[:1]), bits(kv[:1]))
    assert not torch.equal(bits(h1[1:]), bits(kv[1:]))  # layer 1 is the FP8 copy's
    assert torch.equal(bits(h2), bits(kv))  # hybrid:L is the target
    assert not torch.equal(bits(fp8[:1]), bits(kv[:1]))


def test_hybrid_derived_weights_agree_with_file(ladder_predictors, tiny_target, tiny_text, tmp_path):
    pin = build_checkpoint(tiny_target, tiny_text, tmp_path, tokens=TOKENS, segment=SEGMENT, rung="hybrid:1",
                           derive_weights=True)
    ck = load_checkpoint(tmp_path, pin=pin)
    assert ck.derived_weights and WEIGHTS not in ck.manifest["files"]
    ids = tiny_target.tokenize(PROMPT)
    pd = Predictor.from_checkpoint(ck, tiny_target)
    assert torch.equal(bits(pd.mu(ids)), bits(ladder_predictors["hybrid:1"].mu(ids)))


def test_target_rung_calibrates_to_zero_residual(ladder_ckpts):
    calib = load_checkpoint(ladder_ckpts["hybrid:2"][0]).calib
    assert (calib.sigma2 == SIGMA2_FLOOR).all()


def test_none_gives_the_stored_means(ladder_ckpts, ladder_predictors, tiny_target, tiny_text):
    path, _ = ladder_ckpts["none"]
    ck = load_checkpoint(path)
    with np.load(path / MEANS) as z:
        means = z["mean_bf16"]
    assert means.shape == (2, 2, 2, 16) and means.dtype == np.uint16
    pred = ladder_predictors["none"]
    assert not ck.derived_weights and pred.device == "cpu" and pred.to("cpu") is pred
    assert pred.model.config.vocab_size == tiny_target.config.vocab_size
    ids = tiny_target.tokenize(PROMPT)
    mu = bf16_bits(pred.mu(ids))
    assert np.array_equal(mu, np.broadcast_to(means[:, :, :, None, :], mu.shape))
    # the means are the BF16-rounded calibration means of the target's KV, sigma^2 the residual variance
    ids = tiny_target.tokenize(tiny_text.read_text())[:TOKENS]
    kv = torch.cat([tiny_target.kv(s) for s in segments(ids, TOKENS, SEGMENT)], dim=3).double()
    mean = kv.mean(dim=3)
    assert np.array_equal(means, bf16_bits(mean.to(torch.bfloat16)))
    m16 = torch.from_numpy(means.view(np.int16)).view(torch.bfloat16).double()
    np.testing.assert_allclose(ck.calib.sigma2, (kv - m16[:, :, :, None, :]).square().mean(dim=3).numpy(),
                               rtol=1e-9)


@pytest.mark.parametrize("rung", ["hybrid:1", "none"])
def test_codec_round_trip_per_rung(ladder_predictors, tiny_target, rung):
    pred = ladder_predictors[rung]
    ids = tiny_target.tokenize(PROMPT)
    kv = tiny_target.kv(ids)
    codec = Codec.from_predictor(pred)
    records = list(codec.encode(kv, ids, pred.mu(ids)))
    assert np.array_equal(codec.decode(records, ids, pred.mu(ids)), bf16_bits(kv))


# ------------------------------------------------------------------ the embedded model


def test_embedded_hybrid_layers_equal_the_target(embedded_target, tiny_text, tmp_path):
    """hybrid:k on SmolLM2-135M: layers < k of mu are the target's KV bit for bit, and the
    derived weights' digest (which covers the BF16 layers) is checked at load."""
    k = 3
    pin = build_checkpoint(embedded_target, tiny_text, tmp_path, tokens=48, segment=48, derive_weights=True,
                           source="embedded", rung=f"hybrid:{k}")
    ck = load_checkpoint(tmp_path, pin=pin)
    a = Predictor.from_checkpoint(ck, embedded_target)
    b = Predictor.from_checkpoint(ck, embedded_target)
    ids = embedded_target.tokenize("Speculative coding needs the same bits on both sides.")
    kv, mu = embedded_target.kv(ids), a.mu(ids)
    assert mu.shape == (30, 2, 3, len(ids), 64) and mu.dtype == torch.bfloat16
    assert torch.equal(bits(mu[:k]), bits(kv[:k]))
    assert not torch.equal(bits(mu[k:]), bits(kv[k:]))
    assert torch.equal(bits(b.mu(ids)), bits(mu))
