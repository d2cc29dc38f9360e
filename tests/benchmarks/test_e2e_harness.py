"""benchmarks/e2e.py for real, briefly: two network namespaces joined by a shaped veth,
real sidecars and engines whose KV comes from eager attention (another engine's kernels), 32
tokens over one 100 Mbit/s link. Checks the report's
bookkeeping (every row lossless, every field there and sane, speckv moves fewer bytes,
the link gives about its nominal rate) and that nothing is left behind: no ``spk-*``
namespace and no process of the run. Needs root, ``ip``, ``tc`` and ``taskset``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from require import missing

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
# calibrated TCP goodput / nominal tbf rate: TCP/IP headers take ~5%, tbf's burst may add a little
GOODPUT_RATIO = (0.75, 1.10)
FIELDS = {"link", "encoding", "rung", "total_s", "after_prefill_s", "first_layer_s", "decode_node_cpu_s",
          "critical_path_s", "lossless"}


def _need_netns() -> None:
    if os.geteuid() != 0:
        missing("NETNS", "benchmarks/e2e.py needs root (network namespaces, tc)")
    for tool in ("ip", "tc", "taskset"):
        if shutil.which(tool) is None:
            missing("NETNS", f"benchmarks/e2e.py needs {tool}, not found")


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("spk-")]


def _processes_of(run_pid: int) -> list[int]:
    """Live processes started by the run (e2e_net.Child marks them SPECKV_E2E_RUN=<pid>)."""
    mark = f"SPECKV_E2E_RUN={run_pid}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if mark in (d / "environ").read_bytes().split(b"\0"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


@pytest.fixture(scope="module")
def report() -> dict:
    _need_netns()
    proc = subprocess.Popen([sys.executable, str(BENCH / "e2e.py"), "--links", "100mbit", "--tokens", "32",
                             "--rtt-ms", "1", "--engine", "eager", "--json", "--timeout", "280"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rep = json.loads(out)
    rep["_run_pid"] = proc.pid
    return rep


def test_rows_are_lossless_and_sane(report):
    rows = {r["encoding"]: r for r in report["rows"]}
    assert set(rows) == {"stored", "speckv", "recompute"} and len(report["rows"]) == 3
    assert report["hook_matches_target_kv"] is True and report["engine"] == "eager"
    for r in rows.values():
        assert FIELDS <= set(r) and r["link"] == "100mbit" and r["lossless"] is True, r
        assert r["total_s"] >= r["first_layer_s"] > 0 and r["decode_node_cpu_s"] > 0, r
        assert r["after_prefill_s"] <= r["total_s"], r
    for enc in ("stored", "speckv"):
        assert rows[enc]["critical_path_s"] > 0, rows[enc]
        # the encoder's per-chunk timings: one per chunk, each ready no later than written
        tl = rows[enc]["timeline"]
        assert len(tl) > 0 and all(max(t[0], t[5], t[6]) <= t[1] <= t[3] for t in tl), rows[enc]
        assert rows[enc]["paced_path_s"] > 0, rows[enc]
        assert sum(t[4] for t in tl) < rows[enc]["wire_bytes"], rows[enc]  # the header record is not a chunk
    assert rows["speckv"]["rung"] and rows["stored"]["rung"] is None
    assert 0 < rows["speckv"]["wire_bytes"] < rows["stored"]["wire_bytes"]
    assert rows["recompute"]["wire_bytes"] == 0


def test_rows_carry_their_cost_model(report, load_script):
    """critical_path_s is the shared-core model over the row's per-chunk costs: its chunks' bytes,
    the engine's layer times of the stored row (no predictor beside it) in both rows, mu only for
    speckv; even_path_s the even-chunk model."""
    e2e = load_script("e2e_model")
    rows = {r["encoding"]: r for r in report["rows"]}
    goodput = report["calibration"]["100mbit"]["measured_MBps"] * 1e6
    for enc in ("stored", "speckv"):
        r, c = rows[enc], rows[enc]["costs"]
        assert c["B"] == [float(t[4]) for t in r["timeline"]] and all(len(c[k]) == len(c["B"]) for k in "PMED"), c
        assert r["critical_path_s"] == pytest.approx(e2e.critical_path(c, goodput))
        assert r["even_path_s"] == pytest.approx(e2e.even_path(r["stages"], goodput))
        # encode and decode: the coder alone (a loopback transfer) where the row's wall time is longer
        assert sum(c["E"]) <= r["stages"]["encode_s"] + 1e-9 and sum(c["D"]) <= r["stages"]["decode_s"] + 1e-9
    assert rows["speckv"]["costs"]["P"] == rows["stored"]["costs"]["P"] and sum(rows["stored"]["costs"]["P"]) > 0
    assert sum(rows["stored"]["costs"]["M"]) == 0 and sum(rows["speckv"]["costs"]["M"]) > 0


def test_loopback_and_break_even(report):
    lb = report["loopback"]
    assert lb["stored_raw_MBps"] > 0 and lb["speckv_raw_MBps"] > 0 and lb["stored_lossless"] and lb["speckv_lossless"]
    # the warm transfer ran no predictor on either side; the cold one ran both
    assert lb["speckv_mu_cached"] is True and lb["speckv_cold_mu_cached"] is False and lb["speckv_cold_lossless"]
    for key in ("stored", "speckv", "speckv_cold"):  # each figure the median of its three transfers
        runs = lb[f"{key}_raw_MBps_runs"]
        assert len(runs) == 3 and lb[f"{key}_raw_MBps"] == sorted(runs)[1]
    assert report["break_even_mbit"] is None or report["break_even_mbit"] > 0


def test_calibration_near_nominal(report):
    c = report["calibration"]["100mbit"]
    assert c["nominal_MBps"] == 12.5
    assert GOODPUT_RATIO[0] <= c["measured_MBps"] / c["nominal_MBps"] <= GOODPUT_RATIO[1], c


def test_nothing_left_behind(report):
    assert _namespaces() == []
    assert _processes_of(report["_run_pid"]) == []
    assert report["logs"] is None  # removed after a clean run


def test_not_root_exits_2(load_script, monkeypatch, capsys):
    e2e = load_script("e2e")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert e2e.main(["--links", "100mbit"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_break_even_of_a_model(load_script):
    """Synthetic rows of 10 chunks: the engine 0.1 s a chunk on the prefill node's core; stored
    sends 16 MB, speckv 2 MB and adds 0.2 s of predictor a chunk on that core. They cross where
    stored's wire, 0.1 + 16 MB / R, meets speckv's core, 3.0 + 0.2 MB / R: R = 15.8 MB / 2.9 s."""
    e2e = load_script("e2e_model")

    def row(enc, mu, wire, link_mbit):
        costs = {"P": [0.1] * 10, "M": [mu] * 10, "E": [0.0] * 10, "D": [0.0] * 10, "B": [wire / 10] * 10}
        g = link_mbit * 1e6 / 8
        return {"encoding": enc, "costs": costs, "total_s": e2e.critical_path(costs, g),
                "critical_path_s": e2e.critical_path(costs, g), "link": f"{link_mbit}mbit"}

    rows = [row(e, mu, w, m) for m in (10, 100) for e, mu, w in (("stored", 0.0, 16e6), ("speckv", 0.2, 2e6))]
    cal = {f"{m}mbit": {"ratio": 1.0} for m in (10, 100)}
    assert e2e.break_even(rows, cal) == pytest.approx(8 * 15.8 / 2.9, rel=1e-3)


def test_critical_path_of_a_model(load_script):
    """The shared-core model: an engine and a predictor on one core add up, the first chunks'
    exact layers (costly, nearly free on the wire) hold the link back, and the decode node's core
    runs its predictor and its decoding in turn."""
    e2e = load_script("e2e_model")

    def path(P, M, D, B, goodput=1e6):
        return e2e.critical_path({"P": P, "M": M, "E": [0.0] * len(P), "D": D, "B": B}, goodput)

    # core 0: 1 + 2, then 1 a chunk; the link: chunk 0 free, then 1 s a chunk, as its inputs allow
    assert path([1, 1, 1], [2, 0, 0], [0, 0, 0], [0, 1e6, 1e6]) == pytest.approx(6.0)
    # 2 s of mu and 2 MB: front-loaded, the link waits for the mu; spread evenly, it starts sooner
    assert path([0, 0, 0], [2, 0, 0], [0, 0, 0], [0, 1e6, 1e6]) == pytest.approx(4.0)
    assert path([0, 0, 0], [2 / 3] * 3, [0, 0, 0], [2e6 / 3] * 3) == pytest.approx(8 / 3)
    # the decode node's core: its own mu (3 s) first, then 1 s of decoding a chunk
    assert path([0, 0, 0], [3, 0, 0], [1, 1, 1], [0, 0, 0]) == pytest.approx(6.0)
    assert path([], [], [], []) == 0.0
    assert e2e.increments([0.5, 0.4, 1.5]) == [0.5, 0.0, 1.0]


def test_paced_path_of_a_model(load_script):
    """The paced model: a FIFO pipeline fed at the chunks' measured pace."""
    e2e = load_script("e2e_model")
    st = {"encode_s": 0.0, "decode_s": 0.0}
    even = [[0.0, 9.0, 9.0, 9.0, 1e6, 0.0, 0.0] for _ in range(3)]  # ready..written: the sender's, unused
    late = [[0.0, 9.0, 9.0, 9.0, 1e6, r, p] for r, p in ((1.0, 0.5), (1.0, 2.0), (5.0, 0.0))]
    assert e2e.paced_path(even, st, 1e6) == pytest.approx(3.0)  # the wire alone: 3 MB at 1 MB/s
    assert e2e.paced_path(late, st, 1e6) == pytest.approx(6.0)  # the wire idles until each chunk is ready
    assert e2e.paced_path(late, st, 0.25e6) == pytest.approx(13.0)  # slow wire: 1 s of wait, then 12 s busy
    assert e2e.paced_path(late, {"encode_s": 3.0, "decode_s": 3.0}, 1e6) == pytest.approx(8.0)  # 1 s each side
    assert e2e.paced_path([], st, 1e6) is None
