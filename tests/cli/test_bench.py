"""``speckv bench`` end to end on a short text: its JSON report must agree with what
the codec gives on the same tokens, and its rows must be consistent with each other.

BF16 runs the installed ``speckv`` command in a subprocess (argument parsing,
loading, JSON on stdout: everything a user runs). FP8 runs the same command
in-process through ``main()`` on the session-wide embedded session, with its
prefill shared with the reference below and the FP8-copy timing stubbed out
(it only feeds ``fp8_copy_cost``, a timing, which no test checks): a second
subprocess would load both models again, ~1 min on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from require import missing

from speckv.cli import bench, wait_policy
from speckv.cli.main import main
from speckv.coder import native
from speckv.coder.codec import Codec, CodecConfig, Fp8KV, bf16_bits
from speckv.predictor.calibrate import read_text
from speckv.predictor.fp8 import kv_to_fp8
from speckv.predictor.session import Session

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENS = 256
SIDECAR_ABOVE_FLOOR_MAX = 1.40  # measured <= 1.28 (speckv bench --tokens 256, w8a8i:4); building the target: ~4.5
SLICE_CHARS = 6000  # the first 6000 characters of tinyshakespeare.txt (> 256 tokens)
PER_TOKEN = 30 * 2 * 3 * 64  # scalars per token of the embedded model's KV
SYMBOL_BITS = {"bf16": 16, "fp8": 8}
# speckv's wire bits/scalar on that slice, measured with
#   .venv/bin/speckv bench --text <slice> --tokens 256 --timing-runs 1 --json [--dtype fp8]
# (1949566 and 752335 coded bytes under w8a8x:4 with 14-bit K/V activations; 2024201 and 810471 with
# 8-bit ones); held within 2%
BENCH_BITS = {"bf16": 5.288536241319444, "fp8": 2.0408393012152777}
PEERS = {"bf16": ["zstd-3", "zstd-19", "byte-split+zstd-3", "lz4", "order0-bound"],
         "fp8": ["zstd-3", "zstd-19", "lz4", "order0-bound"]}


@pytest.fixture(scope="module")
def slice_file(corpus_file, tmp_path_factory) -> Path:
    text = corpus_file("tinyshakespeare.txt").read_text(encoding="utf-8")[:SLICE_CHARS]
    path = tmp_path_factory.mktemp("bench") / "slice.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(embedded_session, slice_file):
    """(prefill, {dtype: figures}) computed here with the codec and the session."""
    ids = embedded_session.target.tokenize(read_text(slice_file), TOKENS)
    assert len(ids) == TOKENS
    pre = embedded_session.prefill(ids)
    codec = Codec.from_predictor(embedded_session.predictor, CodecConfig(coder="numpy"))  # the reference
    q, s = kv_to_fp8(pre.kv)
    figures = {}
    for dtype, kv in (("bf16", pre.kv), ("fp8", Fp8KV(q.numpy(), s.numpy()))):
        records = list(codec.encode(kv, ids, pre.mu))
        out = codec.decode(records, ids, pre.mu)
        assert np.array_equal(out, bf16_bits(kv)) if dtype == "bf16" else np.array_equal(out.codes, kv.codes)
        coded = sum(len(r) for r in records)
        ent = embedded_session.entropy(pre, dtype)
        figures[dtype] = {"coded_bytes": coded, "bits_per_scalar": 8 * coded / pre.kv.numel(),
                          "ideal": ent["bits_per_scalar"], "order0": ent["order0_bits_per_scalar"]}
    return pre, figures


@pytest.fixture(scope="module")
def bf16_bench(slice_file):
    """The BF16 command, started before the reference loads the models here (so the
    two overlap), and a function waiting for its report."""
    exe = Path(sys.executable).with_name("speckv")  # the installed entry point
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "speckv.cli.main"]
    cmd += ["bench", "--text", str(slice_file), "--tokens", str(TOKENS), "--timing-runs", "1",
            "--dtype", "bf16", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)

    def report() -> dict:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert "Traceback" not in err
        return json.loads(out)

    yield report
    if proc.poll() is None:  # the test failed before waiting for it
        proc.kill()
        proc.communicate()


def run_bench_in_process(slice_file: Path, dtype: str, session, pre, monkeypatch, capsys, *extra: str) -> dict:
    def fake_open(cls, target="default", predictor=None, pin=None):
        assert str(target) == "default" and predictor is None and pin is None
        return session

    def shared_prefill(self, ids):
        assert self is session and np.array_equal(ids, pre.ids)
        return pre

    monkeypatch.setattr(Session, "open", classmethod(fake_open))
    monkeypatch.setattr(Session, "prefill", shared_prefill)
    monkeypatch.setattr(bench, "fp8_copy_forward", lambda target: lambda ids: None)
    rc = main(["bench", "--text", str(slice_file), "--tokens", str(TOKENS), "--timing-runs", "1",
               "--dtype", dtype, "--json", "--no-memory", *extra])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rep = json.loads(captured.out)
    assert rep["memory"] is None  # --no-memory: no probe process
    return rep


def check_report(rep: dict, dtype: str, ref: dict, session, slice_file: Path, own_process: bool = False) -> None:
    n = TOKENS * PER_TOKEN
    assert (rep["dtype"], rep["text"], rep["tokens"], rep["scalars"]) == (dtype, str(slice_file), TOKENS, n)
    assert rep["raw_bytes"] == n * SYMBOL_BITS[dtype] // 8
    assert (rep["pin"], rep["rung"], rep["model"]) == (session.pin, "w8a8x:4", "tuned")
    # the coder's round trip, verified bit for bit by the command itself
    assert rep["lossless"] is True
    # the speckv row: its own figures agree, and agree with the codec run here
    bits = rep["bits_per_scalar"]
    assert bits == 8 * rep["coded_bytes"] / n
    assert bits == pytest.approx(ref["bits_per_scalar"], rel=0.02)
    assert bits == pytest.approx(BENCH_BITS[dtype], rel=0.02)
    assert rep["ratio"] == pytest.approx(rep["raw_bytes"] / rep["coded_bytes"], rel=1e-12)
    assert rep["ratio"] == pytest.approx(SYMBOL_BITS[dtype] / bits, rel=1e-12)
    assert rep["encode_mb_s"] > 0 and rep["decode_mb_s"] > 0
    # the predictor ran under the sidecar's OpenMP wait policy (a command of its own sets it before
    # torch loads; in-process, this one's stands), the target under this environment's (the engine's)
    spin = os.environ.get(wait_policy.SPIN_VAR, wait_policy.SIDECAR_SPINCOUNT if own_process else None)
    assert rep["predictor_policy"] == ("default" if spin is None else f"GOMP_SPINCOUNT={spin}")
    assert rep["target_policy"] == wait_policy.policy(dict(os.environ)) != ""
    assert rep["predictor_cost"] == pytest.approx(rep["predictor_s"] / rep["target_s"], rel=1e-12)
    # the coder that ran: the native extension, on the codec's default threads
    if not native.available():
        missing("NATIVE", f"the native coder is not built ({native.IMPORT_ERROR})")
    assert (rep["coder"], rep["threads"]) == ("native", CodecConfig().threads)
    # the vector stages ran where they can, the widest build this CPU runs
    assert rep["simd"] == ("avx512" if native.wide_path() else "avx2" if native.vector_path() else "none")
    assert rep["encode_s"] == pytest.approx(rep["raw_bytes"] / 1e6 / rep["encode_mb_s"], rel=1e-9)
    assert 0 < rep["digest_s"]
    zstd = next(p for p in rep["peers"] if p["name"] == "zstd-3")
    assert rep["vs_zstd3"]["encode"] == pytest.approx(rep["encode_mb_s"] / zstd["encode_mb_s"], rel=1e-9)
    assert rep["vs_zstd3"]["decode"] == pytest.approx(rep["decode_mb_s"] / zstd["decode_mb_s"], rel=1e-9)
    # the ideal row: the session's ideal code length of the same KV (another process
    # may sum in another order: not bit for bit)
    assert rep["ideal_bits_per_scalar"] == pytest.approx(ref["ideal"], rel=1e-6)
    assert 0 < rep["ideal_bits_per_scalar"] < ref["order0"]
    # the peers: every compressor ran (the test extra installs zstandard and lz4)
    rows = {p["name"]: p for p in rep["peers"]}
    assert list(rows) == PEERS[dtype]
    for name, row in rows.items():
        assert "error" not in row, row
        if name == "order0-bound":
            assert row["bits_per_scalar"] == pytest.approx(ref["order0"], rel=1e-6)
            assert row["ratio"] == pytest.approx(SYMBOL_BITS[dtype] / row["bits_per_scalar"], rel=1e-12)
            assert row["encode_mb_s"] is None and row["decode_mb_s"] is None
        else:
            assert row["encode_mb_s"] > 0 and row["decode_mb_s"] > 0
        # a generic compressor gains something on KV, and far less than speckv
        assert 1.0 < row["ratio"] < rep["ratio"], row


def test_bench_bf16_subprocess(bf16_bench, slice_file, reference, embedded_session):
    pre, ref = reference
    rep = bf16_bench()
    check_report(rep, "bf16", ref["bf16"], embedded_session, slice_file, own_process=True)
    # 16-bit symbols: the ratio is 16 / bits
    assert rep["ratio"] == pytest.approx(16 / rep["bits_per_scalar"], rel=1e-12)
    check_memory(rep["memory"])


def check_memory(m: dict) -> None:
    """Each sidecar's probe wrote this process's bytes, and its peak stays near what a sidecar needs:
    the runtime floor, the rung's own weights (w8a8x:4: ~0.8x the target's) and one transfer's work.
    Building the whole target (BF16 + FP32 linears) would add ~3x the weights."""
    assert 0 < m["target_bf16_mib"] == pytest.approx(256.6, abs=0.1)  # SmolLM2-135M: 134.5 M BF16 parameters
    for role in ("decoder", "encoder"):
        assert m[f"{role}_lossless"] is True
        assert 0 < m["runtime_floor_mib"] < m[f"{role}_loaded_peak_mib"] <= m[f"{role}_peak_mib"] < m["bench_peak_mib"]
        assert m[f"{role}_peak_x_weights"] == pytest.approx(m[f"{role}_peak_mib"] / m["target_bf16_mib"], rel=1e-9)
        assert m[f"{role}_above_floor_x_weights"] < SIDECAR_ABOVE_FLOOR_MAX


def test_bench_fp8(slice_file, reference, embedded_session, monkeypatch, capsys):
    pre, ref = reference
    rep = run_bench_in_process(slice_file, "fp8", embedded_session, pre, monkeypatch, capsys)
    check_report(rep, "fp8", ref["fp8"], embedded_session, slice_file)
    # the command's coded bytes (native coder) are the numpy reference's on the same KV and mu
    assert rep["coded_bytes"] == ref["fp8"]["coded_bytes"]
    assert rep["fp8_rounding"] == "nearest"


def test_bench_fp8_toward_zero(slice_file, reference, embedded_session, monkeypatch, capsys):
    """--fp8-toward-zero: the KV's codes rounded as vLLM's CPU cache writer rounds them; format 5's
    rounding byte codes them within 5% of the nearest-rounded codes' bytes, bit for bit."""
    pre, ref = reference
    rep = run_bench_in_process(slice_file, "fp8", embedded_session, pre, monkeypatch, capsys, "--fp8-toward-zero")
    assert (rep["fp8_rounding"], rep["lossless"]) == ("toward zero", True)
    assert ref["fp8"]["coded_bytes"] < rep["coded_bytes"] < 1.05 * ref["fp8"]["coded_bytes"]
