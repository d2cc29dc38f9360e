"""benchmarks/mlp_rows.py, briefly: every chunk length gives the first one's bits, the ratios come
from the run's own medians (not its speed)."""
from __future__ import annotations

import json

import pytest


def test_short_run_compares_bits_and_reports_ratios(load_script, capsys):
    bench = load_script("mlp_rows")
    assert bench.main(["--tokens", "70", "--rows", "7", "64", "--repeats", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["bits_equal"] is True and r["tokens"] == 70 and [x["rows"] for x in r["rows"]] == [7, 64]
    base = r["rows"][-1]["pass_s"]
    assert all(x["vs_largest"] == pytest.approx(x["pass_s"] / base, rel=1e-12) for x in r["rows"])
