"""The portable rung: mu from integers only, the same bits on every path (oneDNN's int8 products
or int64 torch.mm, the native exp stage or torch's, 1 or 2 threads, one process or another),
long prompts included; close to the target's KV; pinned and loaded like every rung."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from predictor_helpers import every_path_digest

from speckv.errors import CheckpointError
from speckv.predictor.calibrate import build_checkpoint
from speckv.predictor.check import check, mu_digest
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.ladder import Rung, parse_rung
from speckv.predictor.portable import build_portable_model, portable_kv, portable_state
from speckv.predictor.predict import Predictor

PROMPT = "Integers add up the same way on every machine, in any order."


def test_parse_and_cost():
    assert parse_rung("portable", 30) == Rung("portable") and Rung("portable").nominal_cost(30) == 1.0
    with pytest.raises(CheckpointError):
        parse_rung("portable:30", 30)  # portable:k (test_predictor_portable_exit.py) exits before the last layer


@pytest.fixture(scope="module")
def portable_dir(tiny_target, tiny_text, tmp_path_factory):
    d = tmp_path_factory.mktemp("portable")
    build_checkpoint(tiny_target, tiny_text, d, tokens=64, segment=32, rung="portable")
    return d


@pytest.fixture(scope="module")
def portable(portable_dir):
    return Predictor.from_checkpoint(load_checkpoint(portable_dir))


def test_every_path_gives_the_same_bits(portable, tiny_target, monkeypatch):
    rng = np.random.default_rng(0)
    prompts = [tiny_target.tokenize(PROMPT), rng.integers(0, tiny_target.config.vocab_size, 300)]
    prompts += [rng.integers(0, tiny_target.config.vocab_size, n) for n in (1, 2, 7, 17)]  # torch's k == 1 trap
    for ids in prompts:
        digests = every_path_digest(portable.model, ids, monkeypatch)
        assert len(set(digests.values())) == 1, digests


def test_long_prompt_same_bits(tiny_target, monkeypatch):
    cfg = copy.deepcopy(tiny_target.config)
    cfg.max_position_embeddings = 4096
    model = build_portable_model(cfg, portable_state(tiny_target.state, cfg))
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, 2100)
    digests = every_path_digest(model, ids, monkeypatch)
    assert len(set(digests.values())) == 1, digests
    with pytest.raises(ValueError, match="rope table"):
        portable_kv(model, np.zeros(4097, np.int64))


def test_mu_tracks_the_target_and_arrives_layer_by_layer(portable, tiny_target):
    ids = tiny_target.tokenize(PROMPT * 4)
    kv = tiny_target.kv(ids)
    seen = []
    mu = portable.mu(ids, on_layer=lambda i, bits: seen.append((i, bits.shape)))
    assert mu.shape == kv.shape and mu.dtype == torch.bfloat16
    assert [i for i, _ in seen] == list(range(kv.shape[0]))
    rel = ((mu.double() - kv.double()).norm() / kv.double().norm()).item()
    assert rel < 0.02, rel  # BF16 KV itself is only good to 2^-9; int8 weights, 14-bit activations
    assert portable.mu(ids[:0]).shape[3] == 0


def test_checkpoint_pins_weights_and_tables(portable_dir, tiny_target):
    ck = load_checkpoint(portable_dir)
    assert ck.rung.name == "portable" and ck.manifest["kind"] == "integer-portable"
    state = portable_state(tiny_target.state, tiny_target.config)
    assert state["model.layers.0.qkv.w8"].dtype == torch.int8 and "portable.exp" in state
    assert not any(n.startswith("model.layers.1.") and n.endswith(("o.w8", "gate_up.w8", "down.w8")) for n in state)


def test_check_agrees_across_processes_and_environments(portable_dir, tiny_model_dir, tiny_text):
    rep = check(portable_dir, tiny_text, 200, str(tiny_model_dir), timeout=600, jobs=2)
    names = [e["name"] for e in rep["environments"]]
    assert rep["agree"], rep
    assert "int64 reference (prefix)" in names and "ATEN_CPU_CAPABILITY=default" in names
    assert {"no native stages", "native stages, not fused", "fused kernels' scalar loops"} <= set(names)
    assert {e["tokens"] for e in rep["environments"]} == {128, 200}


def test_check_finds_the_float_rungs_environment_dependence(tiny_target, tiny_model_dir, tiny_text, tmp_path,
                                                             capsys):
    """The negative control: the fp8 rung (float GEMMs, SDPA) differs under another aten kernel path,
    so the environments differ enough to prove something; the CLI exits 1 and says where."""
    from speckv.cli.main import main

    d = tmp_path / "fp8"
    build_checkpoint(tiny_target, tiny_text, d, tokens=64, segment=32, rung="fp8")
    code = main(["predictor", "check", str(d), "--text", str(tiny_text), "--tokens", "200",
                 "--target", str(tiny_model_dir), "--jobs", "2", "--json"])
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rep["rung"] == "fp8" and not [e for e in rep["environments"] if "error" in e]
    digests = {e["name"]: e.get("mu_sha256") for e in rep["environments"]}
    unavailable = {e["name"]: e["unavailable"] for e in rep["environments"] if "unavailable" in e}
    aten = "ATEN_CPU_CAPABILITY=default"
    if aten in unavailable:
        # NOTE: a CPU with AMX, where torch cannot run SDPA under a capped ATEN path
        # (check.UNAVAILABLE): no environment left rounds the float rung differently there
        assert set(unavailable) == {aten, "ATEN_CPU_CAPABILITY=avx2"}
        assert code == (0 if rep["agree"] else 1)
    else:
        assert code == 1 and rep["agree"] is False
        assert digests["torch, 2 threads"] != digests[aten]
    assert "int64 reference (prefix)" not in digests  # float rungs have no integer reference


@pytest.mark.parametrize("env,line,kind", [
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "RuntimeError: pack_vnni2 is only supported when avx512 is supported",
     "unavailable"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, "RuntimeError: pack_vnni2 is only supported when avx512 is supported", "error"),
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "RuntimeError: some other failure", "error"),
])
def test_only_torchs_known_limits_leave_an_environment_out(monkeypatch, tmp_path, env, line, kind):
    """A failing environment is an error (the check disagrees) unless it is one of torch's own
    limits on this CPU (check.UNAVAILABLE), which is reported and left out."""
    import subprocess

    from speckv.predictor import check as chk

    failed = subprocess.CompletedProcess([], 1, stdout="", stderr=f"Traceback\n  ...\n{line}\n")
    monkeypatch.setattr(chk.subprocess, "run", lambda *a, **k: failed)
    got = chk.run_child(tmp_path, tmp_path, 8, "default", chk.Environment("e", env), 10.0)
    assert set(got) == {"name", kind}
    ok = {"name": "a", "tokens": 8, "mu_sha256": "x"}
    monkeypatch.setattr(chk, "run_child", lambda *a, **k: ok if a[4].name.startswith("torch") else got)
    envs = [chk.Environment("torch, 2 threads"), chk.Environment("e", env)]
    monkeypatch.setattr(chk, "environments", lambda *a: envs)
    monkeypatch.setattr("speckv.predictor.checkpoint.load_checkpoint", lambda p: type("C", (), {"rung": _Rung})())
    assert chk.check(tmp_path, tmp_path, 8)["agree"] is (kind == "unavailable")


def test_environments_run_side_by_side_and_report_in_order(monkeypatch, tmp_path):
    """jobs=2: two children at once (each waits for the other at a barrier, which one at a time
    never passes), the report in the environments' order whichever child ends first."""
    import threading
    import time

    from speckv.predictor import check as chk

    def children(barrier):
        def child(*a, **k):
            barrier.wait()
            time.sleep(0.05 * (3 - int(a[4].name[1:])))  # NOTE: later environments end first
            return {"name": a[4].name, "tokens": 8, "mu_sha256": "x"}
        return child

    monkeypatch.setattr(chk, "environments", lambda *a: [chk.Environment(f"e{i}") for i in range(4)])
    monkeypatch.setattr("speckv.predictor.checkpoint.load_checkpoint", lambda p: type("C", (), {"rung": _Rung})())
    monkeypatch.setattr(chk, "run_child", children(threading.Barrier(2, timeout=10)))
    rep = chk.check(tmp_path, tmp_path, 8, jobs=2)
    assert [e["name"] for e in rep["environments"]] == ["e0", "e1", "e2", "e3"] and rep["agree"]
    monkeypatch.setattr(chk, "run_child", children(threading.Barrier(2, timeout=0.5)))
    with pytest.raises(threading.BrokenBarrierError):  # one at a time: the first child waits alone
        chk.check(tmp_path, tmp_path, 8, jobs=1)


class _Rung:
    kind, name = "fp8", "fp8"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_gives_the_cpu_bits(portable, tiny_target):
    ids = np.random.default_rng(2).integers(0, tiny_target.config.vocab_size, 300)
    cpu = mu_digest(portable_kv(portable.model, ids))
    portable.to("cuda")
    try:
        assert mu_digest(portable_kv(portable.model, ids)) == cpu
        assert mu_digest(portable_kv(portable.model, ids[:5])) == mu_digest(portable_kv(portable.model.cpu(), ids[:5]))
    finally:
        portable.to("cpu")
