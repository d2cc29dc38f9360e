"""benchmarks/gpu_predictor.py with --device cpu: the script a lent GPU machine runs (the shipped
rung's mu and the target's prefill timed on the device, determinism, agreement with the CPU's mu,
the codec on the device's KV) works end to end here, and its figures hang together: on the CPU the
"device" is the CPU, so mu and KV agree with the CPU's everywhere and all four pairs code to the
same bytes. NOTE: this checks the script, not a GPU (benchmarks/device_check.sh runs it there)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_predictor.py"
PAIRS = ("gpu_kv_gpu_mu", "gpu_kv_cpu_mu", "cpu_kv_gpu_mu", "cpu_kv_cpu_mu")


def test_cpu_smoke_run(corpus_file):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tokens", "48", "--repeats", "1",
                           "--coder", "native", "--text", str(corpus_file("tinyshakespeare.txt"))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rep["tokens"] == 48 and rep["device"] == "cpu" and rep["rung"] == "w8a8x:4"
    assert rep["mu_deterministic"] and rep["host_int8_attention_deterministic"]
    assert rep["mu_equal_cpu_fraction"] == 1.0 and rep["kv_equal_cpu_fraction"] == 1.0
    assert all(rep[p]["lossless"] for p in PAIRS)
    assert len({rep[p]["bits_per_scalar"] for p in PAIRS}) == 1 and 3 < rep[PAIRS[0]]["bits_per_scalar"] < 8
    assert rep["predictor_cost"] > 0 and rep["engine_bf16_s"] > 0 and rep["host_int8_attention_s"] > 0
