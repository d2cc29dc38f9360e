"""benchmarks/gpu_portable.py with --device cpu: the script a lent GPU machine runs (portable mu on
the CPU and on the device, digests compared, costs against the target and the FP8 copy) works end
to end here. NOTE: this checks the script, not a GPU; tests/predictor/test_predictor_portable.py
has the gpu-marked comparison."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_portable.py"


def test_cpu_smoke_run(corpus_file):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tokens", "40", "--repeats", "1",
                           "--text", str(corpus_file("tinyshakespeare.txt"))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rep["tokens"] == 40 and rep["agree"] is True and rep["device"] == "cpu"
    assert len(rep["device_mu_sha256"]) == 64 and rep["portable_cost"] > 0 and rep["fp8_copy_cost"] > 0
