"""The alerting rules (helm/speckv/rules/speckv.rules.yaml): promtool accepts them, its unit
tests (tests/deploy/rules_test.yaml) see each alert fire on a series that should trigger
it and stay silent on a healthy one, every metric they use is one the sidecars expose, and
the chart's PrometheusRule carries the same groups and validates against the CRD."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from helm_helpers import CHART_DIR, NAMESPACE, PROMETHEUSRULE_CRD, crd_validate, objects, of_kind, render
from prom_helpers import METRIC_RE, binary

RULES = CHART_DIR / "rules" / "speckv.rules.yaml"
RULES_TEST = Path(__file__).resolve().parent / "rules_test.yaml"
ALERTS = {"SpeckvIntegrityFailures", "SpeckvPredictorMismatch", "SpeckvTransferErrors", "SpeckvSavedRatioLow",
          "SpeckvInflightBytesNearCap", "SpeckvGrpcServerErrors"}


def _groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def test_promtool_checks_the_rules():
    out = subprocess.run([binary("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_promtool_unit_tests_pass():
    out = subprocess.run([binary("promtool"), "test", "rules", str(RULES_TEST)], capture_output=True, text=True,
                         timeout=120, cwd=RULES_TEST.parent)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    tested = {t["alertname"] for case in yaml.safe_load(RULES_TEST.read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    assert tested == ALERTS  # every alert has a unit test


def test_promtool_unit_tests_can_fail(tmp_path):
    """The same unit tests against rules whose thresholds are off: promtool reports failures."""
    broken = RULES.read_text().replace("> 0.9", "> 0.99").replace("> 0.05", "> 0.5")
    (tmp_path / "speckv.rules.yaml").write_text(broken)
    test = RULES_TEST.read_text().replace("../../helm/speckv/rules/speckv.rules.yaml", "speckv.rules.yaml")
    (tmp_path / "rules_test.yaml").write_text(test)
    out = subprocess.run([binary("promtool"), "test", "rules", "rules_test.yaml"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode != 0 and "SpeckvInflightBytesNearCap" in out.stdout + out.stderr


def test_alerts_use_only_exposed_metric_families():
    from speckv.server.metrics import Metrics

    names = {m.name for m in Metrics("encoder", "m").registry.collect()}
    for group in _groups():
        for rule in group["rules"]:
            for metric in METRIC_RE.findall(rule["expr"]):
                assert metric.removesuffix("_total") in names, (rule["alert"], metric)
            assert rule["labels"]["severity"] in ("critical", "warning") and rule["annotations"]["summary"]
    assert {r["alert"] for g in _groups() for r in g["rules"]} == ALERTS


def test_chart_prometheusrule(chart):
    assert of_kind(objects(render(chart)), "PrometheusRule") == []  # off by default
    objs = objects(render(chart, {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}))
    (pr,) = of_kind(objs, "PrometheusRule")
    assert pr["apiVersion"] == "monitoring.coreos.com/v1" and pr["metadata"]["namespace"] == NAMESPACE
    assert pr["metadata"]["labels"]["release"] == "kps"
    assert pr["spec"]["groups"] == _groups()  # verbatim, {{ $labels }} templates included
    crd_validate(pr, PROMETHEUSRULE_CRD)
    bad = yaml.safe_load(yaml.safe_dump(pr))
    bad["spec"]["groups"][0]["rules"][0]["exprs"] = bad["spec"]["groups"][0]["rules"][0].pop("expr")
    with pytest.raises(AssertionError):
        crd_validate(bad, PROMETHEUSRULE_CRD)  # the validator does reject a wrong rule
