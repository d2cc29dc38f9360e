"""benchmarks/attention_bench.py, briefly: the report's bookkeeping and the kernel's bit-for-bit
comparison with its scalar path (not its speed)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("speckv.coder._native", reason="the native extension is not built")


def test_short_run_reports_equal_bits(load_script, capsys):
    bench = load_script("attention_bench")
    assert bench.main(["--tokens", "70", "--threads", "1", "2", "--repeats", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["scalar_equal"] is True and r["tokens"] == 70 and [x["threads"] for x in r["rows"]] == [1, 2]
    for row in r["rows"]:
        assert row["speedup_vs_fp32"] == pytest.approx(row["sdpa_fp32_ms"] / row["int8_ms"], rel=1e-9)
        assert row["int8_ms"] > 0 and row["int8_no_amx_ms"] > 0
    assert 0.005 < r["rel_error_vs_fp32"] < 0.04
