"""The chart's pod identity and isolation (issue 20, item 5 b, c, g): the ServiceAccount
(created or named, no token mounted by default), the pod and container securityContext
values (the restricted defaults, the uid left out for OpenShift's restricted SCC, a
context dropped entirely) and the optional NetworkPolicy. Every values set is rendered
by the real Helm engine, linted strictly and validated against the Kubernetes OpenAPI
schemas; fixtures: tests/deploy/conftest.py; renderers: helm_helpers.py."""
from __future__ import annotations

from typing import Any

import helm_python
import pytest
from helm_helpers import (
    CHART_DIR,
    K8S_VERSIONS,
    RELEASE,
    RESTRICTED_CONTAINER_SC,
    all_containers,
    every_pod_spec,
    hook_pods,
    lint_clean,
    objects,
    of_kind,
    pod_specs,
    port_of,
    render,
    selects,
    serve_containers,
    validate_all,
)

DEFAULT_POD_SC = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                  "seccompProfile": {"type": "RuntimeDefault"}}
DEFAULT_CONTAINER_SC = {**RESTRICTED_CONTAINER_SC, "runAsGroup": 10001}
SIDECAR = {"mode": "sidecar"}
FETCH = {"predictor": {"source": "fetch", "pin": "c" * 64, "fetch": {"url": "https://example.com/p.tar.gz"}}}
OPENSHIFT = {"podSecurityContext": {"runAsUser": None, "runAsGroup": None, "fsGroup": None},
             "securityContext": {"runAsUser": None, "runAsGroup": None}}
PEER_ENGINE = {"podSelector": {"matchLabels": {"app": "engine"}}}
PEER_MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
PEER_ROUTER = {"ipBlock": {"cidr": "10.0.0.0/8"}}
NETPOL = {"networkPolicy": {"enabled": True, "grpc": {"from": [PEER_ENGINE]},
                            "metrics": {"from": [PEER_MONITORING]}, "http": {"from": [PEER_ROUTER]}}}


def rendered_objects(chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Render, lint strictly and validate every object; the objects."""
    objs = objects(render(chart, values))
    lint_clean(CHART_DIR, values)
    validate_all(objs, K8S_VERSIONS)
    return objs


def merged(*parts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in parts:
        out |= p
    return out


# --- defaults: rendered as before ---------------------------------------------------

@pytest.mark.parametrize("values", [{}, SIDECAR, FETCH], ids=["standalone", "sidecar", "fetch"])
def test_default_security_contexts_everywhere(chart, values):
    objs = rendered_objects(chart, values)
    specs = every_pod_spec(objs)
    assert len(specs) == 3  # encoder, decoder and the helm test pod
    n = 0
    for spec in specs:
        assert spec["securityContext"] == DEFAULT_POD_SC
        for c in all_containers(spec):
            assert c["securityContext"] == DEFAULT_CONTAINER_SC, c["name"]
            n += 1
    assert n >= 3 + (2 if values is SIDECAR else 0) + (4 if values is FETCH else 0)


def test_defaults_have_no_network_policy_and_a_tokenless_service_account(chart):
    objs = rendered_objects(chart, {})
    assert of_kind(objs, "NetworkPolicy") == []
    (sa,) = of_kind(objs, "ServiceAccount")
    assert sa["metadata"]["name"] == RELEASE and sa["automountServiceAccountToken"] is False
    assert "annotations" not in sa["metadata"]
    for spec in every_pod_spec(objs):
        assert spec["serviceAccountName"] == RELEASE
        assert spec["automountServiceAccountToken"] is False


# --- serviceAccount --------------------------------------------------------------------

@pytest.mark.parametrize("sa, want_name, want_object", [
    ({"name": "speckv-runner", "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/r"}},
     "speckv-runner", True),
    ({"create": False, "name": "shared-sa"}, "shared-sa", False),
    ({"create": False}, "default", False),
])
def test_service_account(chart, sa, want_name, want_object):
    objs = rendered_objects(chart, merged(SIDECAR, {"serviceAccount": sa}))
    sas = of_kind(objs, "ServiceAccount")
    if want_object:
        (obj,) = sas
        assert obj["metadata"]["name"] == want_name
        assert obj["metadata"]["annotations"] == sa["annotations"]
    else:
        assert sas == []
    specs = every_pod_spec(objs)
    assert len(specs) == 3
    assert {s["serviceAccountName"] for s in specs} == {want_name}


def test_service_account_token_can_be_mounted(chart):
    objs = rendered_objects(chart, {"serviceAccount": {"automountServiceAccountToken": True}})
    assert of_kind(objs, "ServiceAccount")[0]["automountServiceAccountToken"] is True
    assert {s["automountServiceAccountToken"] for s in every_pod_spec(objs)} == {True}


# --- securityContext overrides -----------------------------------------------------------

@pytest.mark.parametrize("values", [OPENSHIFT, merged(OPENSHIFT, SIDECAR, FETCH)], ids=["standalone", "sidecar-fetch"])
def test_openshift_uid_left_to_the_platform(chart, values):
    """Nulls drop the uid, gid and fsGroup from every pod and container (the restricted
    SCC assigns them); everything else of the restricted profile stays."""
    objs = rendered_objects(chart, values)
    specs = every_pod_spec(objs)
    assert len(specs) == 3
    for spec in specs:
        assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        for c in all_containers(spec):
            sc = c["securityContext"]
            assert not {"runAsUser", "runAsGroup"} & set(sc), c["name"]
            assert sc == {k: v for k, v in DEFAULT_CONTAINER_SC.items() if k not in ("runAsUser", "runAsGroup")}


def test_security_contexts_replaced_or_dropped(chart):
    custom = {"podSecurityContext": None,
              "securityContext": {"runAsUser": 20000, "capabilities": {"add": ["NET_BIND_SERVICE"]}}}
    objs = rendered_objects(chart, merged(SIDECAR, custom))
    for spec in every_pod_spec(objs):
        assert "securityContext" not in spec
        for c in all_containers(spec):
            assert c["securityContext"]["runAsUser"] == 20000
            assert c["securityContext"]["capabilities"] == {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]}
    objs = rendered_objects(chart, {"securityContext": None})
    assert all("securityContext" not in c for s in every_pod_spec(objs) for c in all_containers(s))


# --- NetworkPolicy ---------------------------------------------------------------------

def pod_labels(objs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """name -> labels of every pod the render makes (Deployments' templates, hook Pods)."""
    out = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in of_kind(objs, "Deployment")}
    out |= {p["metadata"]["name"]: p["metadata"]["labels"] for p in of_kind(objs, "Pod")}
    return out


def rule_for(policy: dict[str, Any], port: int) -> list[dict[str, Any]]:
    return [r for r in policy["spec"]["ingress"] if [p["port"] for p in r["ports"]] == [port]]


@pytest.mark.parametrize("mode", ["standalone", "sidecar"])
def test_network_policy_admits_only_the_configured_peers(chart, mode):
    objs = rendered_objects(chart, merged(NETPOL, {"mode": mode}))
    (pol,) = of_kind(objs, "NetworkPolicy")
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    labels = pod_labels(objs)
    workloads = {d["metadata"]["name"] for d in of_kind(objs, "Deployment")}
    (test_pod,) = [p["metadata"]["name"] for p in hook_pods(objs)]
    # it selects exactly the encoder and decoder pods (not the hook pod)
    assert {n for n, lab in labels.items() if selects(pol["spec"]["podSelector"], lab)} == workloads
    _, spec = next(pod_specs(objs))
    (_, serve), = serve_containers(spec)
    (grpc,) = rule_for(pol, port_of(serve, "grpc"))
    own, *others = grpc["from"]
    # the release's own pods: the encoder reaching the decoder, the helm test pod
    assert {n for n, lab in labels.items() if selects(own["podSelector"], lab)} == workloads | {test_pod}
    assert others == [PEER_ENGINE]
    (metrics,) = rule_for(pol, port_of(serve, "metrics"))
    assert metrics["from"] == [PEER_MONITORING]
    http = rule_for(pol, 8000)
    if mode == "sidecar":
        vllm = next(c for c in spec["containers"] if c["name"] == "vllm")
        assert port_of(vllm, "http") == 8000 and http[0]["from"] == [PEER_ROUTER]
        assert len(pol["spec"]["ingress"]) == 3
    else:
        assert http == [] and len(pol["spec"]["ingress"]) == 2


def test_network_policy_with_empty_lists_closes_metrics(chart):
    objs = rendered_objects(chart, {"networkPolicy": {"enabled": True}, "decoder": {"enabled": False}})
    (pol,) = of_kind(objs, "NetworkPolicy")
    (rule,) = pol["spec"]["ingress"]  # gRPC from the release's own pods only
    assert [p["port"] for p in rule["ports"]] == [50051] and len(rule["from"]) == 1
    assert of_kind(rendered_objects(chart, {"networkPolicy": {"enabled": True}, "encoder": {"enabled": False},
                                            "decoder": {"enabled": False}}), "NetworkPolicy") == []


# --- values.schema.json ---------------------------------------------------------------

BAD_VALUES = {
    "securityContext typo": ({"securityContext": {"readOnlyRootFilesytem": True}},
                             {"securityContext": {"readOnlyRootFilesystem": True}}),
    "runAsUser not a number": ({"podSecurityContext": {"runAsUser": "10001"}},
                               {"podSecurityContext": {"runAsUser": 10002}}),
    "serviceAccount unknown key": ({"serviceAccount": {"automount": False}},
                                   {"serviceAccount": {"automountServiceAccountToken": False}}),
    "serviceAccount bad name": ({"serviceAccount": {"name": "Speckv_SA"}}, {"serviceAccount": {"name": "speckv-sa"}}),
    "networkPolicy peer unknown key": ({"networkPolicy": {"grpc": {"from": [{"podSelectr": {}}]}}},
                                       {"networkPolicy": {"grpc": {"from": [{"podSelector": {}}]}}}),
    "networkPolicy ipBlock without cidr": ({"networkPolicy": {"metrics": {"from": [{"ipBlock": {}}]}}},
                                           {"networkPolicy": {"metrics": {"from": [PEER_ROUTER]}}}),
}


@pytest.mark.parametrize("what", list(BAD_VALUES))
def test_schema_rejects_bad_values(chart, what):
    bad, good = BAD_VALUES[what]
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(bad)
    with pytest.raises(helm_python.HelmError):
        render(chart, bad)
    chart.validate_schema(good)
    render(chart, good)
