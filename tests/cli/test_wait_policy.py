"""The sidecar's OpenMP wait policy (``speckv.cli.wait_policy``): set before torch loads, an
operator's own setting kept, and the target's prefill timed in a child under the engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from speckv.cli import wait_policy

PROBE = """
import json, os, sys
from speckv.cli import wait_policy as w
before = "torch" in sys.modules
value = w.use_sidecar_policy()
print(json.dumps({"torch_before": before, "value": value, "env": os.environ.get(w.SPIN_VAR),
                  "engine": w.policy(w.engine_env())}))
"""


def probe(env_extra: dict[str, str], code: str = PROBE) -> dict:
    unset = (wait_policy.SPIN_VAR, wait_policy.MKL_FAST_MM_VAR)
    env = {k: v for k, v in os.environ.items() if k not in unset} | env_extra
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_sidecar_bounds_the_spin_and_its_engine_env_keeps_the_default():
    r = probe({})
    assert r == {"torch_before": False, "value": "GOMP_SPINCOUNT=10000", "env": "10000", "engine": "default"}


def test_an_operators_setting_wins():
    r = probe({wait_policy.SPIN_VAR: "250"})
    assert (r["value"], r["env"], r["engine"]) == ("GOMP_SPINCOUNT=250", "250", "GOMP_SPINCOUNT=250")


def test_after_torch_nothing_changes():
    """libgomp read its setting when torch loaded: changing the variable then would only misreport it."""
    r = probe({}, "import torch\n" + PROBE)
    assert (r["value"], r["env"], r["engine"]) == ("default", None, "default")


MKL_PROBE = """
import ctypes, json, os, sys
from speckv.cli import wait_policy as w
if sys.argv[1] == "sidecar":
    w.use_sidecar_policy()
import torch
x = torch.ones(256, 256)
x @ x  # an FP32 GEMM through MKL (torch's BLAS on x86)
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
print(json.dumps({"env": os.environ.get(w.MKL_FAST_MM_VAR), "fast_mm_off": lib.mkl_serv_get_fast_mm_status()}))
"""


@pytest.mark.parametrize("role, extra, want", [
    ("sidecar", {}, {"env": "1", "fast_mm_off": 1}),
    ("engine", {}, {"env": None, "fast_mm_off": 0}),  # a plain process keeps MKL's default
    ("sidecar", {"MKL_DISABLE_FAST_MM": "yes"}, {"env": "yes", "fast_mm_off": 1}),  # kept; MKL reads presence
])
def test_a_sidecar_turns_mkls_buffer_cache_off(role, extra, want):
    """MKL (linked into torch's CPU library) reports its own memory manager off, as it read the
    variable when torch loaded it."""
    env = {k: v for k, v in os.environ.items() if k not in (wait_policy.SPIN_VAR, wait_policy.MKL_FAST_MM_VAR)}
    out = subprocess.run([sys.executable, "-c", MKL_PROBE, role], env=env | extra, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want


def test_serve_sets_it_before_the_server_loads_torch():
    """``speckv serve`` sets the policy first: the server (stubbed here, after its imports) finds it set."""
    code = """
import json, os, sys
import speckv.server.app as app
async def stub(config):
    import torch  # noqa: F401 -- libgomp loads now, under the policy
    print(json.dumps({"env": os.environ.get("GOMP_SPINCOUNT"), "mkl": os.environ.get("MKL_DISABLE_FAST_MM"),
                      "role": config.role}))
app.serve = stub
from speckv.cli.main import main
sys.exit(main(["serve", "decoder", "--listen", "127.0.0.1:0"]))
"""
    assert probe({}, code) == {"env": "10000", "mkl": "1", "role": "decoder"}


@pytest.fixture(scope="module")
def ids(embedded_session):
    return embedded_session.target.tokenize("To be, or not to be, that is the question.", 16)


def test_target_timer_times_the_same_prefill(embedded_session, ids):
    sha = wait_policy.kv_digest(embedded_session.target.kv(ids))
    with wait_policy.TargetTimer("default", ids, sha) as timer:
        assert timer.policy == wait_policy.policy(dict(os.environ))
        assert 0 < timer.time() and 0 < timer.time()


def test_target_timer_refuses_another_kv(ids):
    """Its first prefill disagrees, so it runs a second; that one disagrees too: TimerDisagrees."""
    with pytest.raises(wait_policy.TimerDisagrees, match="the timer's target prefill gave KV") as e:
        wait_policy.TargetTimer("default", ids, "0" * 64)
    assert e.value.first == e.value.second != e.value.want == "0" * 64


def odd(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` with one bit of one scalar flipped: a pass that computed something else."""
    bits = kv.contiguous().view(torch.int16).clone()
    bits.view(-1)[7] ^= 1
    return bits.view(torch.bfloat16)


def test_agreed_timer_recomputes_an_odd_pass_of_this_process(embedded_session, ids, caplog):
    kv = embedded_session.target.kv(ids)
    calls = []
    timer, got = wait_policy.agreed_timer("default", ids, odd(kv), lambda: calls.append(1) or kv.clone())
    with timer:
        assert 0 < timer.time()
    assert calls == [1] and torch.equal(got.view(torch.int16), kv.view(torch.int16))
    assert "this process's first target prefill gave KV" in caplog.text


def test_agreed_timer_raises_when_this_process_disagrees_twice(embedded_session, ids):
    kv = embedded_session.target.kv(ids)
    with pytest.raises(RuntimeError, match="this process's target prefill gave KV .* then .*twice"):
        wait_policy.agreed_timer("default", ids, odd(kv), lambda: odd(kv))


def test_target_timer_reports_an_early_exit(ids, tmp_path, monkeypatch):
    made = []
    real = wait_policy.tempfile.TemporaryDirectory
    monkeypatch.setattr(wait_policy.tempfile, "TemporaryDirectory", lambda **kw: made.append(real(**kw)) or made[-1])
    with pytest.raises(RuntimeError, match="exited"):
        wait_policy.TargetTimer(str(tmp_path / "no-such-model"), np.asarray(ids), "0" * 64)
    assert len(made) == 1 and not os.path.exists(made[0].name)  # its files are gone with it
