"""benchmarks/omp_spin.py, briefly: each setting runs in its own child under that setting, every
pass's mu agrees (the child checks it) and every round trip is lossless; medians are the runs'."""
from __future__ import annotations

import json
import statistics


def test_each_setting_in_its_own_child(load_script, tmp_path, capsys):
    bench = load_script("omp_spin")
    out = tmp_path / "spin.json"
    assert bench.main(["--tokens", "24", "--passes", "1", "--rounds", "1", "--variants", "default", "0",
                       "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [x["policy"] for x in r["runs"]["default"]] == ["default"]
    assert [x["policy"] for x in r["runs"]["0"]] == ["0"]
    for v, runs in r["runs"].items():
        for k in ("predictor_s", "target_s", "encode_mb_s", "decode_mb_s"):
            assert r["medians"][v][k] == statistics.median(x[k] for x in runs) > 0
    table = capsys.readouterr().out
    assert "| default |" in table and "| 0 |" in table and "predictor 1.000" in table
