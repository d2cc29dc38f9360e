"""benchmarks/load.py end to end, briefly: two real ``speckv serve`` processes, one
client for a few seconds on short real prompts. Checks the report's bookkeeping
(every completed transfer was compared bit for bit, nothing lost, buffers given
back, both sidecars healthy), not its speed."""
from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def load(load_script):
    return load_script("load")


def test_short_load_run_loses_and_corrupts_nothing(load, tmp_path):
    out = tmp_path / "load.json"
    rc = load.main(["--clients", "2", "--seconds", "4", "--tokens", "8,12", "--stored-fraction", "0.5",
                    "--json", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0, r
    assert r["completed"] >= 1 and r["lost"] == 0 and r["corrupt"] == 0 and r["hung_clients"] == 0
    assert sum(e["completed"] for e in r["by_encoding"].values()) == r["completed"]
    for role in ("decoder", "encoder"):
        assert r["after"][role]["health"] == "SERVING"
        assert r["after"][role]["inflight_bytes"] == 0 and r["after"][role]["inflight_transfers"] == 0
        assert r["rss"][role]["peak_mib"] >= r["rss"][role]["idle_mib"] > 0
        assert r["sidecar_logs"][role] == {"exit": 0, "error_lines": 0}


def test_percentiles_pick_ranks(load):
    xs = [float(i) for i in range(1, 101)]
    assert load.pct(xs, 50) == 51.0 and load.pct(xs, 99) == 99.0 and load.pct(xs, 0) == 1.0
    assert load.pct([], 50) != load.pct([], 50)  # NaN for no samples
