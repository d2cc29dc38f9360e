"""benchmarks/portable_kernels.py, briefly: the report's bookkeeping and the bit-for-bit comparison of
the fused kernels with the paths they replace (not their speed)."""
from __future__ import annotations

import json

from speckv.predictor import integer as ix


def test_short_run_reports_equal_bits(load_script, capsys):
    bench = load_script("portable_kernels")
    rc = bench.main(["--tokens", "70", "--layer", "2", "--repeats", "1", "--json"])
    if not ix.fused_hardware():
        assert rc == 2  # says so, and measures nothing: no fused kernels on this CPU
        return
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["tokens"] == 70 and r["layer"] == 2
    assert set(r["attention"]["s"]) == {"fused, 2 threads", "fused, 1 thread", "tiled"}
    for part in ("forward", "linear", "attention"):
        assert r[part]["equal"] is True and all(s > 0 for s in r[part]["s"].values())
