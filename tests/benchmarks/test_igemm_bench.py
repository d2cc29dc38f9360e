"""benchmarks/igemm_bench.py, briefly: every route checked against the int64 reference (the W8A8
linear's two routes against each other), the report's bookkeeping (ratios from its own totals) and the
route it names (not its speed)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("speckv.coder._native", reason="the native extension is not built")


def test_short_run_reports_every_route(load_script, capsys):
    bench = load_script("igemm_bench")
    assert bench.main(["--tokens", "37", "--threads", "2", "--repeats", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tokens"] == 37 and set(r["shapes"]) == {"qkv", "o", "gate_up", "down"}
    from speckv.predictor import w8a8

    amx = w8a8._amx_fits(w8a8._native(), 64, 16)  # every shape here fits the kernel: k, n multiples of 64, 16
    routes = {"torch_int_mm", "fp32_mm", "native", "linear_two_pass"} | ({"linear_amx"} if amx else set())
    for row in r["shapes"].values():
        assert set(row) == routes and all(v["s"] > 0 for v in row.values())
    t = r["total_s"]
    assert r["native_vs_torch_int_mm"] == pytest.approx(t["torch_int_mm"] / t["native"], rel=1e-12)
    if amx:
        assert r["linear_amx_vs_two_pass"] == pytest.approx(t["linear_two_pass"] / t["linear_amx"], rel=1e-12)
    else:
        assert r["linear_amx_vs_two_pass"] is None
    assert r["route"] == ("torch" if {"avx512_vnni", "avx_vnni", "amx_int8"} & set(r["cpu_int8_flags"]) else "native")
