"""benchmarks/portable_profile.py on a short prompt: it runs, profiles the portable forward and
reports a relative error per layer for the portable rung and the FP8 copy."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "portable_profile.py"


def test_short_run(corpus_file):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "64", "--error-tokens", "32",
                           "--text", str(corpus_file("tinyshakespeare.txt"))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rep["tokens"] == 64 and rep["total_s"] > 0 and rep["profile"]
    errors = rep["rel_error"]
    assert len(errors["portable"]) == len(errors["fp8"]) == 30
    assert all(0 < e < 0.5 for layer in errors["portable"] for e in layer)
