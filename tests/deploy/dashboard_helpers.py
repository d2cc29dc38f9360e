"""What the dashboard tests share: the dashboard's constants and panel walkers
(tests/deploy/test_dashboard.py, test_dashboard_panels.py; fixtures in conftest.py)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "helm" / "speckv" / "dashboards" / "speckv.json"
VARIABLES = ("datasource", "namespace", "role", "model", "pin")
FILTERS = ("namespace", "role", "model")  # every speckv selector filters on these three
# the gRPC families (no role/model labels): kept to the selected sidecars by this join
GRPC_JOIN = ('* on (namespace, instance) group_left () max by (namespace, instance) (speckv_build_info{'
             'namespace=~"$namespace", role=~"$role", model=~"$model", pin=~"$pin"})')
# Grafana unit ids the dashboard may use (a typo renders as a bare number)
UNITS = {"s", "bytes", "Bps", "percentunit", "reqps", "ops", "cps", "short", "none", "suffix:x"}
MODEL = "SmolLM2-135M-Instruct"
NAMESPACE = "speckv-test"
SECONDS_HISTOGRAMS = ("encode", "decode", "predictor", "transfer", "first_layer")
# what Grafana substitutes when every variable is "All" (allValue ".*"); 1m covers the test's scrapes
ALL = {"namespace": NAMESPACE, "role": ".*", "model": ".*", "pin": ".*", "__rate_interval": "1m",
       "__range": "5m", "__interval": "15s"}
GAUGE_AT_REST = re.compile(r"\bspeckv_inflight_(transfers|bytes)\b")  # legitimately 0 when idle
# no fallback happens in this run (both sidecars share one predictor): the panel must still
# evaluate to a finite value >= 0; tests/server/test_fallback.py and test_dashboard_panels.py
# make the counters move. Likewise a method's share of calls not OK (FetchKV: none here), and the
# bytes through the local sockets (no engine here uses one: tests/server/test_local_*.py count them), and
# the encoder's second predictor passes (none without a disagreement: tests/server/test_mu_recheck.py).
RARE_AT_REST = re.compile(r'\bspeckv_fallback(s|_transfers)_total\b|grpc_code!="OK"|\bspeckv_local_bytes_total\b'
                          r'|\bspeckv_mu_rechecks_total\b')


# the rows of issue 20 item 1 (their live checks: tests/deploy/test_dashboard_panels.py)
NEW_PANELS = ("Mean time per transfer by stage", "Stage p95", "Wire wait (encoder)", "Mu wait",
              "Predictor passes by result", "Chunks sent stored by reason", "Transfers with stored chunks by reason",
              "Share of transfers falling back", "gRPC calls by method and code", "gRPC error ratio by method",
              "gRPC handling time", "Completed transfers by model", "Bandwidth saved by model",
              "Compression ratio by model", "Transfer latency p95 by model")


def _server_helpers():
    """tests/server/server_helpers.py (its raw-stream builders), imported by path under
    its own name so a session that also runs tests/server shares one module."""
    if "server_helpers" in sys.modules:
        return sys.modules["server_helpers"]
    path = REPO / "tests" / "server" / "server_helpers.py"
    spec = importlib.util.spec_from_file_location("server_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["server_helpers"] = mod
    spec.loader.exec_module(mod)
    return mod


def _panels(d: dict) -> list[dict]:
    """Every panel, those nested in collapsed rows included."""
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _charts(d: dict) -> list[dict]:
    return [p for p in _panels(d) if p["type"] != "row"]


def _targets(d: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in _charts(d) for t in p["targets"]]


def _variables(d: dict) -> dict[str, dict]:
    return {v["name"]: v for v in d["templating"]["list"]}


def _var_query(v: dict) -> str:
    q = v["query"]
    return q["query"] if isinstance(q, dict) else q


def _panel(d: dict, title: str) -> dict:
    found = [p for p in _charts(d) if p["title"] == title]
    assert len(found) == 1, f"want exactly one panel titled {title!r}, found {len(found)}"
    return found[0]


def _series(result: list[dict], *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for s in result}


