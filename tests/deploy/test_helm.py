"""The Helm chart helm/speckv, offline: linted and rendered by the real Helm
engine (helm_python binds Helm's Go SDK), every object validated against the
Kubernetes OpenAPI schemas (kubernetes-validate, strict) and the ServiceMonitor
against the prometheus-operator CRD, the dashboard ConfigMap and the ServiceMonitor
asserted on the rendered objects, and bad values rejected by values.schema.json.
What each mode renders: test_helm_workloads.py; the containers' security, env and
probes: test_helm_containers.py; the README's examples: test_helm_readme.py. The values
sets rendered (CASES) and the helpers: helm_helpers.py; the ``chart`` and ``rendered``
fixtures: conftest.py.

No cluster is involved anywhere.
"""

from __future__ import annotations

import copy
import json

import helm_python
import kubernetes_validate
import pytest
from helm_helpers import (
    CASES,
    CHART_DIR,
    EXAMPLES,
    K8S_VERSIONS,
    NAMESPACE,
    PIN,
    RELEASE,
    REPO_ROOT,
    crd_validate,
    dashboard_json,
    is_headless,
    k8s_validate,
    objects,
    of_kind,
    render,
    selects,
)

REQUIRED_EXAMPLES = {"standalone.yaml", "decode-node.yaml", "vllm-sidecar.yaml", "mtls-servicemonitor.yaml"}


def test_examples_present():
    assert REQUIRED_EXAMPLES <= {p.name for p in EXAMPLES}


def test_chart_metadata(chart):
    md = chart.metadata
    assert (md["apiVersion"], md["name"], md["version"], md["appVersion"]) == ("v2", "speckv", "0.1.0", "0.1.0")
    assert chart.values["image"]["repository"] == "ghcr.io/speckv/speckv"
    assert chart.schema is not None and chart.schema["additionalProperties"] is False


# --- lint ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_helm_lint(case):
    report = helm_python.lint(CHART_DIR, CASES[case], strict=True, namespace=NAMESPACE)
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # strict: warnings count; only the info "icon is recommended" may remain
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_helm_lint_at_minimum_kube_version(chart):
    # native sidecars are on by default from 1.29; the chart declares that floor
    assert chart.metadata["kubeVersion"] == ">=1.29.0-0"
    report = helm_python.lint(CHART_DIR, {}, strict=True, kube_version="v1.29.0")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


# --- schema validation of rendered objects --------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_objects_validate_against_kubernetes_openapi(rendered, case, version):
    _, objs, _ = rendered[case]
    builtin = [o for o in objs if o["kind"] != "ServiceMonitor"]
    assert builtin, "nothing rendered"
    for obj in builtin:
        assert k8s_validate(obj, version) == version, obj["metadata"]["name"]
        assert obj["metadata"]["namespace"] == NAMESPACE
    for sm in of_kind(objs, "ServiceMonitor"):
        crd_validate(sm)


def test_validators_reject_bad_objects(rendered):
    """The two validators do fail on a wrong object (strict: unknown fields too)."""
    _, objs, _ = rendered["examples/mtls-servicemonitor.yaml"]
    dep = copy.deepcopy(of_kind(objs, "Deployment")[0])
    dep["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFilesytem"] = True  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(dep, K8S_VERSIONS[-1])
    dep = copy.deepcopy(of_kind(objs, "Deployment")[0])
    dep["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(dep, K8S_VERSIONS[-1])
    (sm,) = of_kind(objs, "ServiceMonitor")
    for mutate in (lambda s: s["spec"]["endpoints"][0].update(scrapeTimout="5s"),   # unknown field
                   lambda s: s["spec"]["endpoints"][0].update(interval="soon"),     # not a duration
                   lambda s: s["spec"].update(endpoints="metrics")):                 # wrong type
        bad = copy.deepcopy(sm)
        mutate(bad)
        with pytest.raises(AssertionError):
            crd_validate(bad)


def test_vendored_crd_has_source_header():
    head = (REPO_ROOT / "tests/deploy/schemas/monitoring.coreos.com_servicemonitors.yaml").read_text()[:800]
    assert "github.com/prometheus-operator/prometheus-operator" in head and "Apache" in head


# --- dashboard, ServiceMonitor -------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_dashboard_configmap(rendered, case):
    values, objs, _ = rendered[case]
    cms = [o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] == f"{RELEASE}-dashboard"]
    if not values["dashboard"]["enabled"]:
        assert cms == []
        return
    (cm,) = cms
    label = values["dashboard"]["label"]
    assert cm["metadata"]["labels"][label["key"]] == label["value"]
    assert json.loads(cm["data"]["speckv.json"]) == dashboard_json()


def test_dashboard_label_configurable(chart):
    objs = objects(render(chart, {"dashboard": {"label": {"key": "my/dash", "value": "yes"},
                                                "namespace": "monitoring"}}))
    (cm,) = of_kind(objs, "ConfigMap")
    assert cm["metadata"]["labels"]["my/dash"] == "yes" and "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert dashboard_json()["uid"]  # a dashboard Grafana can key on


@pytest.mark.parametrize("case", list(CASES))
def test_servicemonitor_only_when_enabled(rendered, case):
    values, objs, _ = rendered[case]
    sms = of_kind(objs, "ServiceMonitor")
    if not values["serviceMonitor"]["enabled"]:
        assert sms == []
        return
    (sm,) = sms
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert values["serviceMonitor"]["labels"].items() <= sm["metadata"]["labels"].items()
    (ep,) = sm["spec"]["endpoints"]
    assert (ep["port"], ep["path"], ep["interval"]) == ("metrics", "/metrics", values["serviceMonitor"]["interval"])
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    services = of_kind(objs, "Service")
    selected = [s for s in services if selects(sm["spec"]["selector"], s["metadata"]["labels"])]
    # every Service of the release but the headless one, whose pods are scraped through the other
    assert selected and selected == [s for s in services if not is_headless(s)]
    for s in selected:
        assert "metrics" in {p["name"] for p in s["spec"]["ports"]}


# --- values.schema.json rejects bad values -------------------------------------------

BAD_VALUES = {
    "unknown top-level key": ({"replicaCount": 2}, {}),
    "unknown nested key": ({"encoder": {"replica": 2}}, {"encoder": {"replicas": 2}}),
    "pin not hex": ({"predictor": {"pin": "z" * 64}}, {"predictor": {"pin": PIN}}),
    "pin upper-case": ({"predictor": {"pin": PIN.upper()}}, {"predictor": {"pin": PIN}}),
    "pin too short": ({"predictor": {"pin": PIN[:63]}}, {"predictor": {"pin": PIN}}),
    "mode not in enum": ({"mode": "daemonset"}, {"mode": "standalone"}),
    "source not in enum": ({"predictor": {"source": "s3"}}, {"predictor": {"source": "image"}}),
    "negative replicas": ({"decoder": {"replicas": -1}}, {"decoder": {"replicas": 0}}),
    "pvc without pin": ({"predictor": {"source": "pvc", "pvc": {"claimName": "c"}}},
                        {"predictor": {"source": "pvc", "pvc": {"claimName": "c"}, "pin": PIN}}),
    "pvc without claim": ({"predictor": {"source": "pvc", "pin": PIN}},
                          {"predictor": {"source": "pvc", "pin": PIN, "pvc": {"claimName": "c"}}}),
    "fetch without url": ({"predictor": {"source": "fetch", "pin": PIN}},
                          {"predictor": {"source": "fetch", "pin": PIN, "fetch": {"url": "https://x/p.tar.gz"}}}),
    "fetch without pin": ({"predictor": {"source": "fetch", "fetch": {"url": "https://x/p.tar.gz"}}},
                          {"predictor": {"source": "fetch", "pin": PIN, "fetch": {"url": "https://x/p.tar.gz"}}}),
    "port 70000": ({"ports": {"grpc": 70000}}, {"ports": {"grpc": 50052}}),
    "port 0": ({"ports": {"metrics": 0}}, {"ports": {"metrics": 9101}}),
    "bad quantity": ({"encoder": {"resources": {"limits": {"memory": "8 GB"}}}},
                     {"encoder": {"resources": {"limits": {"memory": "8G"}}}}),
    "bad byte size": ({"config": {"maxInflightBytes": "2GB"}}, {"config": {"maxInflightBytes": "2Gi"}}),
    "byte size not a quantity": ({"config": {"muCacheBytes": "1.5 Gi"}}, {"config": {"muCacheBytes": "1.5Gi"}}),
    "decimal byte size": ({"config": {"maxInflightBytes": "2K"}}, {"config": {"maxInflightBytes": "2G"}}),
    "tls without secret": ({"tls": {"enabled": True}}, {"tls": {"enabled": True, "secretName": "s"}}),
    "image variant": ({"image": {"variant": "rocm"}}, {"image": {"variant": "cuda"}}),
    "sidecar without connector": ({"mode": "sidecar", "vllm": {"kvConnector": ""}}, {"mode": "sidecar"}),
    "bad interval": ({"serviceMonitor": {"interval": "30 seconds"}}, {"serviceMonitor": {"interval": "1m30s"}}),
    "grace not positive": ({"config": {"graceSeconds": 0}}, {"config": {"graceSeconds": 0.5}}),
}


@pytest.mark.parametrize("what", list(BAD_VALUES))
def test_schema_rejects_bad_values(chart, what):
    bad, good = BAD_VALUES[what]
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(bad)
    with pytest.raises(helm_python.HelmError):  # install/template would refuse too
        render(chart, bad)
    chart.validate_schema(good)  # the same key with a good value passes: the rejection is specific
    render(chart, good)


def test_schema_accepts_every_case(chart):
    for values in CASES.values():
        chart.validate_schema(values)
