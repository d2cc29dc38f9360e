"""The Grafana dashboard of the Helm chart (helm/speckv/dashboards/speckv.json).

Static: the JSON is a Grafana dashboard (identity, variables, unique ids, a
non-overlapping grid, a known unit on every panel, a legend on every query), every
panel queries through ``${datasource}`` with the namespace/role/model filters (the
gRPC families, which lack role and model, through a join with speckv_build_info)
and only defined variables, every metric it names is one the sidecars expose
(scraped from a real pair) and every speckv metric family the sidecars expose is
charted; promtool parses every expression.

Live: a real Prometheus scrapes a real encoder + decoder pair (namespace label
added by the scrape config, as Kubernetes service discovery would) while they
run speckv and stored transfers, a refused one and a corrupted one, in two
rounds a few scrapes apart (so every counter has an increase inside the rate
window); then every expression of the dashboard, with its variables filled in as
Grafana would, must return finite, positive (gauges: non-negative) values with
the labels its ``by`` clauses and its legend use, and a few panels must show exactly
what the test did. tests/deploy/test_dashboard_panels.py does the same for the
Stages, Fallbacks, gRPC and Per model rows with fallbacks happening.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request

import grpc
import numpy as np
import pytest
from dashboard_helpers import (
    ALL,
    FILTERS,
    GAUGE_AT_REST,
    GRPC_JOIN,
    MODEL,
    NAMESPACE,
    NEW_PANELS,
    RARE_AT_REST,
    SECONDS_HISTOGRAMS,
    UNITS,
    VARIABLES,
    _charts,
    _panel,
    _panels,
    _series,
    _server_helpers,
    _targets,
    _var_query,
    _variables,
)
from prom_helpers import (
    GRAFANA_BUILTINS,
    Prometheus,
    binary,
    by_labels,
    exposition_names,
    finite,
    legend_labels,
    metric_names,
    on_labels,
    selectors,
    substitute,
    variables_in,
    wait_until,
)

# -- the dashboard -------------------------------------------------------------

def test_dashboard_identity(dashboard):
    d = dashboard
    assert (d["uid"], d["title"], d["schemaVersion"]) == ("speckv", "speckv: KV-cache transfer", 39)
    assert d["time"] == {"from": "now-1h", "to": "now"} and d["refresh"] == "30s"
    assert "speckv" in d["tags"] and d.get("id") is None  # id: assigned by Grafana on import


def test_variables(dashboard):
    vs = _variables(dashboard)
    assert list(vs) == list(VARIABLES)  # order matters: each may only use those before it
    ds = vs["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    for i, name in enumerate(VARIABLES[1:], start=1):
        v = vs[name]
        assert v["type"] == "query" and v["includeAll"] is True and v["multi"] is True
        assert v["allValue"] == ".*"
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        q = _var_query(v)
        m = re.fullmatch(r"label_values\((speckv_\w+)(\{[^}]*\})?,\s*(\w+)\)", q)
        assert m and m.group(3) == name, q
        assert variables_in(q) <= set(VARIABLES[1:i]), (name, q)  # chained on earlier variables only
        if "definition" in v:
            assert v["definition"] == q


def test_panels(dashboard):
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["w"] >= 1 and g["h"] >= 1 and 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["y"] >= 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        if p["type"] == "row":
            assert not p.get("targets"), p["title"]
            continue
        assert p["type"] in ("timeseries", "stat"), (p["title"], p["type"])
        assert p["title"] and p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["fieldConfig"]["defaults"].get("unit") in UNITS, f"{p['title']}: unit not in {UNITS}"
        targets = p.get("targets") or []
        assert targets, f"{p['title']}: no targets"
        refs = [t.get("refId") for t in targets]
        assert all(refs) and len(refs) == len(set(refs)), (p["title"], refs)
        for t in targets:
            assert t.get("expr", "").strip(), (p["title"], t)
            assert t["datasource"] == p["datasource"], (p["title"], t["refId"])
            assert t.get("legendFormat", "").strip(), (p["title"], t["refId"], "no legendFormat")
    titles = {p["title"] for p in _charts(dashboard)}
    for want in ("Bandwidth saved", "Compression ratio", "Bits per scalar", "Raw vs wire throughput",
                 "Entropy coding latency", "Predictor latency", "Transfer latency", "Decoder time to first layer",
                 "In-flight transfers", "In-flight bytes vs limit", "Transfers by outcome", "Failed transfers",
                 "Integrity failures by kind", *NEW_PANELS):
        assert want in titles, want


def test_expressions_use_defined_variables_and_filters(dashboard):
    allowed = set(VARIABLES[1:]) | GRAFANA_BUILTINS  # ${datasource} selects the source, never in a query
    for p, t in _targets(dashboard):
        where = f"{p['title']}/{t['refId']}"
        expr = t["expr"]
        assert variables_in(expr) <= allowed, (where, variables_in(expr) - allowed)
        assert "$" not in substitute(expr, ALL), where  # no reference the variable syntax missed
        sels = list(selectors(expr))
        assert any(m.startswith("speckv_") for m, _ in sels), f"{where}: no speckv metric"
        grpc = any(m.startswith("grpc_server_") for m, _ in sels)
        for metric, matchers in sels:
            assert matchers is not None, f"{where}: {metric} without a selector"
            if metric.startswith("grpc_server_"):  # no role/model labels: the join selects the sidecars
                assert matchers.get("namespace") == ("=~", "$namespace"), f"{where}: {metric}"
                continue
            for lab in FILTERS + (("pin",) if grpc else ()):
                assert matchers.get(lab) == ("=~", f"${lab}"), f'{where}: {metric} lacks {lab}=~"${lab}"'
        ranges = re.findall(r"\[(\$\w+|\d[^\]]*)\]", expr)  # range windows, not a regex's [.]
        assert set(ranges) <= {"$__rate_interval", "$__range"}, (where, ranges)  # no hard-coded windows
        if any(re.search(r"_(total|bucket|sum|count)$", m) for m in metric_names(expr)):
            assert ranges, f"{where}: a counter or histogram charted without rate()/increase()"
        if grpc:  # every gRPC series is joined (a bare one would ignore Role, Model and Pin)
            n_grpc = sum(1 for m, _ in sels if m.startswith("grpc_server_"))
            assert expr.count(GRPC_JOIN) == n_grpc, f"{where}: {n_grpc} gRPC selectors, not each joined"
    # latency: p50 and p99 of every stage histogram
    exprs = [t["expr"] for _, t in _targets(dashboard)]
    for stage in SECONDS_HISTOGRAMS:
        for q in ("0.5", "0.99"):
            assert any(f"histogram_quantile({q}," in e and f"speckv_{stage}_seconds_bucket" in e for e in exprs), \
                (stage, q)
    for stage in ("predictor", "encode", "decode", "mu_wait", "wire_wait"):  # the Stages row: p95 and mean
        assert any(f"histogram_quantile(0.95, sum by (le, role) (rate(speckv_{stage}_seconds_bucket" in e
                   for e in exprs), stage
        assert any(f"rate(speckv_{stage}_seconds_sum" in e and f"rate(speckv_{stage}_seconds_count" in e
                   for e in exprs), stage


def test_promtool_parses_every_expression(dashboard, tmp_path):
    """Offline syntax check: each expression (variables filled in) as a recording rule."""
    promtool = binary("promtool")
    rules = [{"record": f"speckv_dashboard:target{i}", "expr": substitute(t["expr"], ALL)}
             for i, (_, t) in enumerate(_targets(dashboard))]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "speckv-dashboard", "rules": rules}]}))  # JSON is YAML
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout, proc.stdout


# -- the sidecars ----------------------------------------------------------------

def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_metric_names_exist_in_the_exposition(dashboard, local_pair):
    families, names = set(), set()
    for role in ("encoder", "decoder"):
        f, n = exposition_names(_scrape(local_pair.metrics_url(role)))
        families |= f
        names |= n
    assert "speckv_transfers_total" in names and "speckv_encode_seconds_bucket" in names  # the parse worked
    used = set().union(*(metric_names(t["expr"]) for _, t in _targets(dashboard)))
    used |= set().union(*(metric_names(_var_query(v)) for v in _variables(dashboard).values()
                          if v["type"] == "query"))
    assert used <= names, f"not exposed by the sidecars: {sorted(used - names)}"
    speckv = {f for f in families if f.startswith("speckv_")}
    charted = {f for f in speckv if f in used or {f"{f}_bucket", f"{f}_sum", f"{f}_count"} & used}
    assert charted == speckv, f"exposed but on no panel: {sorted(speckv - charted)}"


# -- live: real Prometheus, real transfers -----------------------------------------------

def _one_round(pair, n: int, ids, kv, bits, codec, pin: bytes, sh) -> None:
    """Three good transfers (speckv twice: its mu is a miss, then a hit; stored; all fetched),
    one refused, one corrupted in transit. Each round has its own prompt: a predictor pass."""
    from speckv.client.client import DecoderClient, EncoderClient, RpcFailed

    with EncoderClient(pair.encoder_address, timeout=60) as enc, DecoderClient(pair.decoder_address, timeout=60) as dec:
        for k, encoding in enumerate(("speckv", "speckv", "stored")):
            rid = f"dash-{encoding}-{n}-{k}"
            res = enc.submit(rid, kv, ids, pair.decoder_address, MODEL, encoding=encoding)
            assert res.raw_bytes == bits.nbytes
            assert np.array_equal(dec.fetch(rid, wait=10), bits)
        with pytest.raises(RpcFailed) as ei:
            enc.submit(f"dash-other-{n}", kv, ids, pair.decoder_address, "other")
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    header, recs = sh.stored_stream(codec, f"dash-corrupt-{n}", bits, ids, pin)
    bad = bytearray(recs[3])
    bad[len(bad) // 2] ^= 0x10  # one bit flipped in transit: the record's CRC32 fails
    with pytest.raises(grpc.RpcError) as ei:
        sh.raw_transfer(pair.decoder_address, [header] + sh.chunk_requests(recs[:3] + [bytes(bad)] + recs[4:]),
                        timeout=60)
    assert ei.value.code() == grpc.StatusCode.DATA_LOSS


def _expected_counts(rounds: int) -> dict[tuple[str, str], float]:
    return {("encoder", "ok"): 3.0 * rounds, ("encoder", "failed_precondition"): 1.0 * rounds,
            ("decoder", "ok"): 3.0 * rounds, ("decoder", "data_loss"): 1.0 * rounds}


def _counts(prom: Prometheus) -> dict[tuple[str, str], float]:
    res = prom.query(f'sum by (role, outcome) (speckv_transfers_total{{namespace="{NAMESPACE}"}})')
    return {(s["metric"]["role"], s["metric"]["outcome"]): float(s["value"][1]) for s in res}


def test_every_expression_on_real_prometheus(dashboard, local_pair, embedded_session, tmp_path):
    binary("prometheus")  # skip (or fail) before any transfer when it is missing
    sh = _server_helpers()
    pair = local_pair
    from speckv.coder.codec import bf16_bits

    prompts = {n: embedded_session.target.tokenize(f"Hello world, round {n} of a test of the dashboard's sidecars.")
               for n in (1, 2)}
    kvs = {n: embedded_session.target.kv(ids) for n, ids in prompts.items()}
    codec = pair.sidecars["decoder"][0].service.rt.codec
    pin = bytes.fromhex(embedded_session.predictor.pin)
    targets = [pair.metrics_url(r).removeprefix("http://").removesuffix("/metrics") for r in ("encoder", "decoder")]

    with Prometheus(tmp_path, targets, {"namespace": NAMESPACE}) as prom:
        try:
            for n in (1, 2):  # two rounds, each seen by a scrape: every counter increases inside the window
                _one_round(pair, n, prompts[n], kvs[n], bf16_bits(kvs[n]), codec, pin, sh)
                wait_until(lambda n=n: _counts(prom) == _expected_counts(n), 20,
                           f"Prometheus to scrape round {n}: {_expected_counts(n)}")
            done = time.time()
            # two more scrapes of both targets: the gauges settle and the windows hold more samples
            def scraped_since() -> bool:
                r = prom.query('timestamp(up{job="speckv"})')
                return len(r) == 2 and min(float(s["value"][1]) for s in r) > done + 2

            wait_until(scraped_since, 20, "two more scrapes of both sidecars")
            assert {s["metric"]["namespace"] for s in prom.query('up{job="speckv"} == 1')} == {NAMESPACE}
            at = time.time()

            # every expression: valid, non-empty, finite, positive, labelled as its legend expects
            results: dict[tuple[str, str], list[dict]] = {}
            for p, t in _targets(dashboard):
                where = f"{p['title']}/{t['refId']}"
                expr = substitute(t["expr"], ALL)
                res = prom.query(expr, at)
                assert res, f"{where}: empty result for {expr}"
                values = [s["value"][1] for s in res]
                assert all(finite(v) for v in values), (where, values)
                if GAUGE_AT_REST.search(expr) or RARE_AT_REST.search(expr):
                    assert all(float(v) >= 0 for v in values), (where, values)
                else:
                    assert all(float(v) > 0 for v in values), (where, values)
                # pod: added by Kubernetes SD, absent here; join keys: aggregated away outside the join
                for lab in by_labels(expr) - {"le", "pod"} - on_labels(expr):
                    assert all(s["metric"].get(lab) for s in res), f"{where}: a series lacks {lab}: {res}"
                for lab in legend_labels(t["legendFormat"]) - {"pod"}:  # what the legend shows is there
                    assert all(s["metric"].get(lab) for s in res), f"{where}: legend label {lab} missing: {res}"
                results[(p["title"], t["refId"])] = res

            # every label a selector matches on exists on that metric (a typo would match nothing or all)
            for p, t in _targets(dashboard):
                for metric, matchers in selectors(t["expr"]):
                    missing = set(matchers or {}) - prom.series_labels(metric)
                    assert not missing, f"{p['title']}/{t['refId']}: {metric} has no label {missing}"

            # the panels show what the test did
            outcome = _series(results[("Transfers by outcome", "A")], "role", "outcome")
            assert set(outcome) == set(_expected_counts(1)), outcome
            failed = _series(results[("Failed transfers", "A")], "role", "outcome")
            assert set(failed) == {("encoder", "failed_precondition"), ("decoder", "data_loss")}, failed
            integrity = _series(results[("Integrity failures by kind", "A")], "role", "kind")
            assert set(integrity) == {("decoder", "crc32")}, integrity
            ratio = _series(results[("Compression ratio", "A")], "role", "encoding")
            assert set(ratio) == {(r, e) for r in ("encoder", "decoder") for e in ("speckv", "stored")}, ratio
            for role in ("encoder", "decoder"):
                assert ratio[(role, "speckv")] > 1.2, ratio  # the predictor actually compresses
                assert 0.9 < ratio[(role, "stored")] <= 1.0, ratio  # stored: raw plus framing
            bps = _series(results[("Bits per scalar", "A")], "role", "dtype", "encoding")
            for role in ("encoder", "decoder"):
                assert 16.0 < bps[(role, "bf16", "stored")] < 16.5, bps  # 16 raw bits plus framing
                assert 1.0 < bps[(role, "bf16", "speckv")] < 14.0, bps
            # each transfer counted once: encoder and decoder both count every chunk, so the
            # headline takes one role's figure (the larger), never their sum
            saved_expr = _panel(dashboard, "Bandwidth saved")["targets"][0]["expr"]
            saved = {r: float(prom.query(substitute(saved_expr, {**ALL, "role": r}), at)[0]["value"][1])
                     for r in ("encoder", "decoder")}
            saved_all = float(results[("Bandwidth saved", "A")][0]["value"][1])
            assert saved["encoder"] > 0 and saved_all == pytest.approx(max(saved.values())), (saved_all, saved)
            assert saved_all < 1.5 * min(saved.values()), (saved_all, saved)
            limit = _series(results[("In-flight bytes vs limit", "B")], "role")
            assert limit == {(r,): float(pair.sidecars[r][0].config.max_inflight_bytes)
                             for r in ("encoder", "decoder")}, limit
            error_ratio = float(results[("Transfer error ratio", "A")][0]["value"][1])
            assert 0.2 < error_ratio < 0.5, error_ratio  # 2 failed of 6 finished per round

            # the variables: their label_values queries, and the filters actually filter
            vs = _variables(dashboard)
            for name, want in (("namespace", [NAMESPACE]), ("role", ["decoder", "encoder"]), ("model", [MODEL]),
                               ("pin", [embedded_session.predictor.pin])):
                m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", _var_query(vs[name]))
                assert sorted(prom.label_values(m.group(2), substitute(m.group(1), ALL))) == want, name
            by_outcome = _panel(dashboard, "Transfers by outcome")["targets"][0]["expr"]
            only_dec = prom.query(substitute(by_outcome, {**ALL, "role": "decoder"}), at)
            assert only_dec and {s["metric"]["role"] for s in only_dec} == {"decoder"}
            assert prom.query(substitute(by_outcome, {**ALL, "namespace": "elsewhere"}), at) == []
            assert prom.query(substitute(by_outcome, {**ALL, "model": "other-model"}), at) == []
        except BaseException:
            print("prometheus log tail:\n" + prom.log_tail())
            raise
    assert prom.proc is not None and prom.proc.poll() is not None  # stopped
