"""benchmarks/predictor_batch.py, briefly, on a tiny w8a8:1 checkpoint: the report's bookkeeping
and its bit-for-bit comparison (not its speed), and exit status 1 when a batch's bits differ."""
from __future__ import annotations

import json

import numpy as np
import pytest

from speckv.predictor.calibrate import build_checkpoint


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("predictor_batch")


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_target, tiny_text, tmp_path_factory):
    d = tmp_path_factory.mktemp("pb")
    build_checkpoint(tiny_target, tiny_text, d, tokens=64, segment=32, rung="w8a8:1", derive_weights=True)
    return d


def run(bench, capsys, *args) -> tuple[int, dict]:
    rc = bench.main(["--prompts", "3", "--tokens", "12", "--repeats", "1", "--json", *args])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_short_run_reports_identical_bits(bench, tiny_ckpt, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(bench, "prompts", lambda n, t, s: [np.arange(k + 5, dtype=np.int64) % 60 for k in range(n)])
    rc, r = run(bench, capsys, "--predictor", str(tiny_ckpt), "--target", str(tiny_model_dir))
    assert rc == 0 and r["identical"] is True and r["batchable"] is True and r["rung"] == "w8a8:1"
    assert r["prompts"] == 3 and r["tokens"] == [5, 6, 7]
    assert r["speedup"] == pytest.approx(r["one_by_one_s"] / r["batched_s"], rel=1e-9)


def test_differing_bits_fail_the_run(bench, tiny_ckpt, tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(bench, "prompts", lambda n, t, s: [np.arange(k + 5, dtype=np.int64) % 60 for k in range(n)])
    real = bench.batched

    def skewed(pred, ps):
        seconds, got = real(pred, ps)
        got[-1][0] = got[-1][0] ^ 1  # one bit of one layer of one prompt
        return seconds, got

    monkeypatch.setattr(bench, "batched", skewed)
    rc, r = run(bench, capsys, "--predictor", str(tiny_ckpt), "--target", str(tiny_model_dir))
    assert rc == 1 and r["identical"] is False
