"""The Helm chart helm/speckv, offline: linted and rendered by the real Helm
engine (helm_python binds Helm's Go SDK), every object validated against the
Kubernetes OpenAPI schemas (kubernetes-validate, strict) and the ServiceMonitor
against the prometheus-operator CRD, the important properties asserted on the
rendered objects (in sidecar mode: the kv-transfer-config speckv's vLLM connector
reads, the headless decode Service, POD_IP), bad values rejected by
values.schema.json, and the README's "Deploy on Kubernetes" and "vLLM
(prefill/decode pair)" sections and the example's Dockerfile checked against what
is rendered here.

No cluster is involved anywhere.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from helm_helpers import (
    CHART_DIR,
    EXAMPLES_DIR,
    FETCH,
    NAMESPACE,
    RELEASE,
    REPO_ROOT,
    RESTRICTED_CONTAINER_SC,
    SERVE,
    VERIFY,
    all_containers,
    crd_validate,
    dashboard_json,
    env_map,
    k8s_validate,
    load_example,
    mounts,
    objects,
    of_kind,
    pod_specs,
    port_of,
    render,
    serve_containers,
    volumes,
)

from speckv.server.config import FIELDS, ServerConfig
from speckv.v1 import decoder_pb2, encoder_pb2

PIN = "c99abc452c89150d303f103aeaa0fa129824e7b0e3b5a0489bdb4ea9ce18badd"  # the shipped checkpoint
HEALTH_SERVICE = {
    "encoder": encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name,
    "decoder": decoder_pb2.DESCRIPTOR.services_by_name["DecoderService"].full_name,
}
# The chart's floor (Chart.yaml kubeVersion) and the newest schema kubernetes-validate ships.
K8S_VERSIONS = ("1.29", kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version()))

EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))
REQUIRED_EXAMPLES = {"standalone.yaml", "decode-node.yaml", "vllm-sidecar.yaml", "mtls-servicemonitor.yaml"}

# Every values set the suite renders: the defaults, every example file, and a few
# combinations the examples do not cover (sidecar mode with fetch + TLS, etc.).
CASES: dict[str, dict[str, Any]] = {"default": {}}
CASES.update({f"examples/{p.name}": load_example(p) for p in EXAMPLES})
CASES["sidecar-fetch-tls"] = {
    "mode": "sidecar",
    "vllm": {"kvConnector": "MyConnector", "hfTokenSecret": {"name": "hf"},
             "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
             "kvConnectorExtraConfig": {"speckv_model_id": "overridden-by-chart", "speckv_encoding": "stored"}},
    "predictor": {"source": "fetch", "pin": PIN, "fetch": {"url": "https://example.com/p.tar.gz"}},
    "tls": {"enabled": True, "secretName": "speckv-tls"},
    "serviceMonitor": {"enabled": True},
    "ports": {"health": 9000},
    "config": {"graceSeconds": 25},
    "terminationGracePeriodSeconds": 40,
}
CASES["sidecar-decode-only-pvc"] = {
    "mode": "sidecar",
    "vllm": {"kvConnector": "MyConnector", "kvConnectorModulePath": "", "model": "/models/my-llama/"},
    "config": {"modelId": "my-llama-3"},
    "encoder": {"enabled": False},
    "predictor": {"source": "pvc", "pin": PIN, "pvc": {"claimName": "ckpt", "subPath": "smollm2"}},
}
CASES["sidecar-prefill-only"] = {"mode": "sidecar", "decoder": {"enabled": False},
                                 "vllm": {"model": "/models/SmolLM2-135M-Instruct/"}}
CASES["sidecar-local-handoff"] = {"mode": "sidecar",
                                  "vllm": {"localHandoff": {"enabled": True, "dir": "/run/kv", "uids": "10001"}}}
CASES["no-dashboard-encoder-only"] = {"decoder": {"enabled": False}, "dashboard": {"enabled": False}}
CASES["standalone-extras"] = {
    "imagePullSecrets": [{"name": "regcred"}],
    "config": {"extraEnv": [{"name": "SPECKV_MAX_TOKENS", "value": "65536"}], "modelId": "SmolLM2-135M-Instruct"},
    "encoder": {"env": [{"name": "SPECKV_THREADS", "value": "4"}],
                # a pod label cannot take over a selector label
                "podLabels": {"team": "inference", "app.kubernetes.io/component": "other"},
                "podAnnotations": {"example.com/a": "b"},
                "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
                "pdb": {"minAvailable": "50%"}},
    "decoder": {"replicas": 0, "pdb": {"enabled": False}},
}


@pytest.fixture(scope="module")
def chart():
    c = helm_python.Chart.load(CHART_DIR)
    yield c
    c.close()


@pytest.fixture(scope="module")
def rendered(chart) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]], dict[str, str]]]:
    """case -> (merged values, objects, manifests); every case rendered once."""
    out = {}
    for name, values in CASES.items():
        manifests = render(chart, values)
        out[name] = (chart.merge_values(values), objects(manifests), manifests)
    return out


def case_ids(pred=lambda v: True) -> list[str]:
    return [n for n, v in CASES.items() if pred(v)]


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


# --- what is rendered, per mode ---------------------------------------------------------

def expected_roles(values: dict[str, Any]) -> set[str]:
    return {r for r in ("encoder", "decoder") if values[r]["enabled"]}


@pytest.mark.parametrize("case", list(CASES))
def test_workloads_per_mode_and_role(rendered, case):
    values, objs, _ = rendered[case]
    roles = expected_roles(values)
    deps = of_kind(objs, "Deployment")
    comp = sorted(d["metadata"]["labels"]["app.kubernetes.io/component"] for d in deps)
    assert comp == sorted(roles)
    headless = values["mode"] == "sidecar" and "decoder" in roles  # <fullname>-decode-pods
    assert len(of_kind(objs, "Service")) == len(roles) + headless
    if values["mode"] == "standalone":
        assert sorted(d["metadata"]["name"] for d in deps) == sorted(f"{RELEASE}-{r}" for r in roles)
        pdbs = of_kind(objs, "PodDisruptionBudget")
        for dep in deps:
            (role, c), = serve_containers(dep["spec"]["template"]["spec"])
            assert c in dep["spec"]["template"]["spec"]["containers"]
            assert dep["spec"]["replicas"] == values[role]["replicas"]
        assert sorted(p["metadata"]["name"] for p in pdbs) == \
            sorted(f"{RELEASE}-{r}" for r in roles if values[r]["pdb"]["enabled"])
    else:
        names = {"encoder": f"{RELEASE}-prefill", "decoder": f"{RELEASE}-decode"}
        assert sorted(d["metadata"]["name"] for d in deps) == sorted(names[r] for r in roles)
        assert of_kind(objs, "PodDisruptionBudget") == []
    assert {o["kind"] for o in objs} <= {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap",
                                          "ServiceMonitor", "ServiceAccount", "Pod"}


@pytest.mark.parametrize("case", list(CASES))
def test_labels_and_selectors(rendered, case):
    values, objs, _ = rendered[case]
    for o in objs:
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "speckv"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        if o["kind"] in ("Deployment", "Service", "PodDisruptionBudget"):
            assert labels["app.kubernetes.io/component"] in ("encoder", "decoder")
    deps = of_kind(objs, "Deployment")
    for dep in deps:
        sel = dep["spec"]["selector"]["matchLabels"]
        assert sel.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    for svc in of_kind(objs, "Service"):
        sel = svc["spec"]["selector"]
        matching = [d for d in deps if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matching) == 1, svc["metadata"]["name"]
        assert svc["metadata"]["labels"]["app.kubernetes.io/component"] == \
            matching[0]["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = matching[0]["spec"]["template"]["spec"]
        (_, c), = serve_containers(pod)
        ports = {p["name"]: p for p in svc["spec"]["ports"]}
        assert ports["grpc"]["port"] == port_of(c, "grpc") == values["ports"]["grpc"]
        if is_headless(svc):  # scraped once, through the other Service
            assert "metrics" not in ports
        else:
            assert ports["metrics"]["port"] == port_of(c, "metrics") == values["ports"]["metrics"]
        for p in ports.values():  # every named targetPort exists in the pod
            assert any(p["targetPort"] in {q["name"] for q in x.get("ports") or []} for x in all_containers(pod))
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert len([d for d in deps if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]) == 1


# --- security ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_security_context_on_every_container(rendered, case):
    _, objs, _ = rendered[case]
    n = 0
    for _, spec in pod_specs(objs):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for c in all_containers(spec):
            sc = c.get("securityContext") or {}
            assert {k: sc.get(k) for k in RESTRICTED_CONTAINER_SC} == RESTRICTED_CONTAINER_SC, c["name"]
            # a read-only root filesystem needs a writable /tmp
            tmp = mounts(c).get("/tmp")
            assert tmp is not None and not tmp.get("readOnly"), c["name"]
            assert "emptyDir" in volumes(spec)[tmp["name"]]
            n += 1
    assert n > 0


@pytest.mark.parametrize("case", list(CASES))
def test_serve_env_is_a_valid_sidecar_config(rendered, case):
    """The env the chart sets parses into the sidecar's own ServerConfig, with
    the addresses, files and limits the chart means, and names only variables
    speckv reads (a typo such as SPECKV_GRACE_SECONDS would be silently ignored)."""
    values, objs, _ = rendered[case]
    known = {f.env for f in FIELDS} | {"SPECKV_CACHE"}
    n = 0
    for _, spec in pod_specs(objs):
        for role, c in serve_containers(spec):
            env = env_map(c)
            unknown = {k for k in env if k.startswith("SPECKV_")} - known
            assert not unknown, unknown
            cfg = ServerConfig.from_env(role, env=env)
            assert cfg.listen == f"0.0.0.0:{port_of(c, 'grpc')}"
            assert (cfg.metrics_host, cfg.metrics_port) == ("0.0.0.0", port_of(c, "metrics"))
            assert cfg.grace_s == float(values["config"]["graceSeconds"])
            assert cfg.pin == (values["predictor"]["pin"] or None)
            assert env["SPECKV_CACHE"] == "/cache" and not mounts(c)["/cache"].get("readOnly")
            assert "emptyDir" in volumes(spec)[mounts(c)["/cache"]["name"]]
            if values["predictor"]["source"] == "image":
                assert cfg.predictor is None
                assert "speckv-predictor" not in volumes(spec)
            else:
                assert cfg.predictor == values["predictor"]["mountPath"]
                assert mounts(c)[cfg.predictor]["readOnly"] is True
            if values["tls"]["enabled"]:
                for path in (cfg.tls_cert, cfg.tls_key, cfg.tls_ca):
                    assert path is not None and path.startswith("/etc/speckv/tls/")
                assert mounts(c)["/etc/speckv/tls"]["readOnly"] is True
                secret = volumes(spec)[mounts(c)["/etc/speckv/tls"]["name"]]["secret"]
                assert secret["secretName"] == values["tls"]["secretName"]
                assert cfg.health_listen == f"0.0.0.0:{values['ports']['health']}"
            else:
                assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca, cfg.health_listen) == (None,) * 4
            n += 1
    assert n == len(expected_roles(values))


@pytest.mark.parametrize("case", list(CASES))
def test_grpc_probes(rendered, case):
    values, objs, _ = rendered[case]
    tls = values["tls"]["enabled"]
    for _, spec in pod_specs(objs):
        for role, c in serve_containers(spec):
            want_port = port_of(c, "health") if tls else port_of(c, "grpc")
            assert want_port == (values["ports"]["health"] if tls else values["ports"]["grpc"])
            if tls:
                assert env_map(c)["SPECKV_HEALTH_LISTEN"].endswith(f":{want_port}")
                assert want_port != port_of(c, "grpc")
            probes = {k: c[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
            for kind, probe in probes.items():
                assert set(probe) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, kind
                assert probe["grpc"]["port"] == want_port, kind
            assert probes["startupProbe"]["grpc"]["service"] == HEALTH_SERVICE[role]
            assert probes["readinessProbe"]["grpc"]["service"] == HEALTH_SERVICE[role]
            assert probes["livenessProbe"]["grpc"]["service"] == ""


@pytest.mark.parametrize("case", list(CASES))
def test_termination_grace_exceeds_sidecar_grace(rendered, case):
    values, objs, _ = rendered[case]
    for _, spec in pod_specs(objs):
        for _, c in serve_containers(spec):
            assert spec["terminationGracePeriodSeconds"] > float(env_map(c)["SPECKV_GRACE_S"])
            assert spec["terminationGracePeriodSeconds"] == values["terminationGracePeriodSeconds"]


def test_termination_grace_not_above_sidecar_grace_refused(chart):
    with pytest.raises(helm_python.HelmError, match="terminationGracePeriodSeconds"):
        render(chart, {"config": {"graceSeconds": 30}, "terminationGracePeriodSeconds": 30})
    render(chart, {"config": {"graceSeconds": 30}, "terminationGracePeriodSeconds": 31})


def test_port_clash_refused(chart):
    with pytest.raises(helm_python.HelmError, match="ports must differ"):
        render(chart, {"ports": {"metrics": 50051}})
    with pytest.raises(helm_python.HelmError, match="ports must differ"):
        render(chart, {"mode": "sidecar", "vllm": {"kvConnector": "X", "port": 9100}})
    render(chart, {"ports": {"metrics": 9200}})


# --- native sidecars (mode: sidecar) -------------------------------------------------

def kv_transfer_config(vllm: dict[str, Any]) -> dict[str, Any]:
    """The JSON of the vLLM container's single --kv-transfer-config argument."""
    kv_args = [a for a in vllm["args"] if a.startswith("--kv-transfer-config=")]
    assert len(kv_args) == 1, vllm["args"]
    return json.loads(kv_args[0].split("=", 1)[1])


def expected_kv_transfer_config(values: dict[str, Any], role: str) -> dict[str, Any]:
    """What SpeckvConnector must be given, worked out here from the values (not the
    chart): the policy, and exactly the extra-config keys the connector reads for the role."""
    vl, grpc = values["vllm"], values["ports"]["grpc"]
    local = f"127.0.0.1:{grpc}"
    # the connector's own default: os.path.basename(model.rstrip("/"))
    chart = {"speckv_model_id": values["config"]["modelId"] or vl["model"].rstrip("/").rsplit("/", 1)[-1]}
    if role == "encoder":
        chart |= {"speckv_encoder_address": local,
                  "speckv_decoder_service": f"{RELEASE}-decode.{NAMESPACE}.svc:{grpc}"}
        if vl["localHandoff"]["enabled"]:  # the encoder sidecar's hand-off socket, in the shared dir
            chart |= {"speckv_local_socket": f"{vl['localHandoff']['dir']}/encoder.sock"}
    else:
        chart |= {"speckv_decoder_address": local}
    kv = {"kv_connector": vl["kvConnector"],
          "kv_role": {"encoder": "kv_producer", "decoder": "kv_consumer"}[role],
          "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {**vl["kvConnectorExtraConfig"], **chart}}  # the chart's keys win
    if vl["kvConnectorModulePath"]:
        kv["kv_connector_module_path"] = vl["kvConnectorModulePath"]
    return kv


def is_headless(svc: dict[str, Any]) -> bool:
    return svc["spec"].get("clusterIP") == "None"


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, vals = e["key"], e["operator"], e.get("values") or []
        ok = {"Exists": key in labels, "DoesNotExist": key not in labels,
              "In": labels.get(key) in vals, "NotIn": key not in labels or labels[key] not in vals}[op]
        if not ok:
            return False
    return True


@pytest.mark.parametrize("case", case_ids(lambda v: v.get("mode") == "sidecar"))
def test_native_sidecar(rendered, case):
    values, objs, _ = rendered[case]
    deps = of_kind(objs, "Deployment")
    assert deps
    for dep, spec in pod_specs(objs):
        role = dep["metadata"]["labels"]["app.kubernetes.io/component"]
        init = spec["initContainers"]
        sidecar = init[-1]  # after any predictor init containers
        assert sidecar["name"] == SERVE[role] and sidecar["args"] == ["serve", role]
        assert sidecar["restartPolicy"] == "Always"
        assert "startupProbe" in sidecar  # vLLM starts once the sidecar serves
        for c in init[:-1]:
            assert "restartPolicy" not in c, c["name"]  # run-to-completion init containers
        (vllm,) = spec["containers"]
        assert vllm["name"] == "vllm"
        assert vllm["image"] == f"{values['vllm']['image']['repository']}:{values['vllm']['image']['tag']}"
        assert vllm["command"] == ["vllm", "serve"] and vllm["args"][0] == values["vllm"]["model"]
        assert kv_transfer_config(vllm) == expected_kv_transfer_config(values, role)
        env = env_map(vllm)
        local = f"127.0.0.1:{port_of(sidecar, 'grpc')}"
        assert env[f"SPECKV_{role.upper()}_ADDRESS"] == local
        # the connector's env fallbacks: the same addresses as its extra config
        want_env = {"encoder": {"SPECKV_ENCODER_ADDRESS", "SPECKV_DECODER_SERVICE"},
                    "decoder": {"SPECKV_DECODER_ADDRESS"}}[role]
        if values["tls"]["enabled"]:
            want_env |= {"SPECKV_TLS_CA", "SPECKV_TLS_CERT", "SPECKV_TLS_KEY"}
        if role == "encoder" and values["vllm"]["localHandoff"]["enabled"]:
            want_env |= {"SPECKV_LOCAL_SOCKET"}
        assert {k for k in env if k.startswith("SPECKV_")} == want_env
        if role == "encoder":
            assert env["SPECKV_DECODER_SERVICE"] == f"{RELEASE}-decode.{NAMESPACE}.svc:{values['ports']['grpc']}"
        pod_ip = [e for e in vllm["env"] if e["name"] == "POD_IP"]
        if role == "decoder":  # the decode pod's own IP, from the downward API
            assert pod_ip == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        else:
            assert pod_ip == []
        assert mounts(vllm)["/dev/shm"]["name"] in volumes(spec)
        assert volumes(spec)[mounts(vllm)["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"




@pytest.mark.parametrize("case", case_ids(lambda v: v.get("mode", "standalone") == "standalone"))
def test_standalone_has_no_restarting_init_containers(rendered, case):
    _, objs, _ = rendered[case]
    for _, spec in pod_specs(objs):
        for c in spec.get("initContainers") or []:
            assert "restartPolicy" not in c
            assert (c.get("args") or [None])[0] != "serve"


# --- predictor checkpoint ------------------------------------------------------------

@pytest.mark.parametrize("case", case_ids(lambda v: v.get("predictor", {}).get("source") == "fetch"))
def test_fetch_then_verify_init_containers(rendered, case):
    values, objs, _ = rendered[case]
    pred = values["predictor"]
    assert of_kind(objs, "Deployment")
    for _dep, spec in pod_specs(objs):
        names = [c["name"] for c in spec["initContainers"]]
        assert names[:2] == [FETCH, VERIFY]
        fetch, verify = spec["initContainers"][:2]
        (_, serve), = serve_containers(spec)
        # fetch: downloads the configured URL into the (writable) predictor emptyDir
        assert fetch["image"] == f"{pred['fetch']['image']['repository']}:{pred['fetch']['image']['tag']}"
        assert env_map(fetch)["PREDICTOR_URL"] == pred["fetch"]["url"]
        assert env_map(fetch)["DEST"] == pred["mountPath"]
        script = fetch["command"][-1]
        assert 'curl -fsSL' in script and '"$PREDICTOR_URL"' in script and "tar -xzf" in script
        assert fetch["command"][:2] == ["sh", "-ec"]  # any failing step fails the pod
        assert not mounts(fetch)[pred["mountPath"]].get("readOnly")
        vol = volumes(spec)[mounts(fetch)[pred["mountPath"]]["name"]]
        assert "emptyDir" in vol
        # verify: the speckv image checks the pin, read-only, before the sidecar starts
        assert verify["image"] == serve["image"]
        assert verify["args"] == ["predictor", "info", pred["mountPath"], "--pin", pred["pin"]]
        assert mounts(verify)[pred["mountPath"]]["readOnly"] is True
        assert mounts(verify)[pred["mountPath"]]["name"] == mounts(fetch)[pred["mountPath"]]["name"]
        assert mounts(serve)[pred["mountPath"]]["name"] == mounts(fetch)[pred["mountPath"]]["name"]
        assert env_map(serve)["SPECKV_PIN"] == pred["pin"]
        if serve in spec["initContainers"]:  # native sidecar: after both
            assert spec["initContainers"].index(serve) == 2


@pytest.mark.parametrize("case", case_ids(lambda v: v.get("predictor", {}).get("source") == "pvc"))
def test_pvc_checkpoint_mounted_read_only(rendered, case):
    values, objs, _ = rendered[case]
    pred = values["predictor"]
    assert of_kind(objs, "Deployment")
    for _, spec in pod_specs(objs):
        (_, serve), = serve_containers(spec)
        m = mounts(serve)[pred["mountPath"]]
        assert m["readOnly"] is True
        assert m.get("subPath", "") == pred["pvc"]["subPath"]
        claim = volumes(spec)[m["name"]]["persistentVolumeClaim"]
        assert claim == {"claimName": pred["pvc"]["claimName"], "readOnly": True}
        assert env_map(serve)["SPECKV_PREDICTOR"] == pred["mountPath"]
        assert env_map(serve)["SPECKV_PIN"] == pred["pin"]
        assert [c["name"] for c in spec.get("initContainers") or [] if c["name"] in (FETCH, VERIFY)] == []


def test_extras_reach_the_objects(rendered):
    _, objs, _ = rendered["standalone-extras"]
    enc = next(d for d in of_kind(objs, "Deployment") if d["metadata"]["name"] == f"{RELEASE}-encoder")
    spec = enc["spec"]["template"]["spec"]
    (_, c), = serve_containers(spec)
    cfg = ServerConfig.from_env("encoder", env=env_map(c))
    assert (cfg.max_tokens, cfg.threads, cfg.model_id) == (65536, 4, "SmolLM2-135M-Instruct")
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    meta = enc["spec"]["template"]["metadata"]
    assert meta["labels"]["team"] == "inference" and meta["labels"]["app.kubernetes.io/component"] == "encoder"
    assert meta["annotations"]["example.com/a"] == "b"
    svc = next(s for s in of_kind(objs, "Service") if s["metadata"]["name"] == f"{RELEASE}-encoder")
    assert svc["spec"]["type"] == "LoadBalancer" and svc["metadata"]["annotations"] == {"example.com/lb": "internal"}
    (pdb,) = of_kind(objs, "PodDisruptionBudget")
    assert pdb["spec"] == {"minAvailable": "50%", "selector": enc["spec"]["selector"]}
    dec = next(d for d in of_kind(objs, "Deployment") if d["metadata"]["name"] == f"{RELEASE}-decoder")
    assert dec["spec"]["replicas"] == 0


def test_notes(rendered):
    for case, (values, _, manifests) in rendered.items():
        notes = manifests["speckv/templates/NOTES.txt"]
        assert f"({values['mode']} mode)" in notes
        if values["mode"] == "standalone" and values["encoder"]["enabled"]:
            port = values["ports"]["health"] if values["tls"]["enabled"] else values["ports"]["grpc"]
            assert f"port-forward deploy/{RELEASE}-encoder {port}" in notes, case


def test_decode_node_example(rendered):
    _, objs, _ = rendered["examples/decode-node.yaml"]
    (dep,) = of_kind(objs, "Deployment")
    (role, c), = serve_containers(dep["spec"]["template"]["spec"])
    assert role == "decoder" and c["image"] == "ghcr.io/speckv/speckv:0.1.0-cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


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


# --- images ------------------------------------------------------------------------------

MOUNTED = {"source": "pvc", "pin": "ab" * 32, "pvc": {"claimName": "ckpt"}}  # a mounted checkpoint


@pytest.mark.parametrize("image, predictor, want", [
    ({}, {}, "ghcr.io/speckv/speckv:0.1.0-cpu-demo"),  # the shipped checkpoint needs the demo model
    ({}, MOUNTED, "ghcr.io/speckv/speckv:0.1.0-cpu"),
    ({"variant": "cuda"}, MOUNTED, "ghcr.io/speckv/speckv:0.1.0-cuda"),
    ({"variant": "cuda"}, {}, "ghcr.io/speckv/speckv:0.1.0-cuda-demo"),
    ({"tag": "0.2.0"}, MOUNTED, "ghcr.io/speckv/speckv:0.2.0-cpu"),
    ({"repository": "registry.example.com/speckv-cuda", "variant": "", "tag": "0.1.0"}, {},
     "registry.example.com/speckv-cuda:0.1.0"),
    ({"digest": "sha256:" + "ab" * 32}, {}, "ghcr.io/speckv/speckv@sha256:" + "ab" * 32),
])
def test_image_reference(chart, image, predictor, want):
    objs = objects(render(chart, {"image": image, "predictor": predictor}))
    imgs = {c["image"] for _, spec in pod_specs(objs) for _, c in serve_containers(spec)}
    assert imgs == {want}


# --- the named template, included from a user's chart (as the README shows) ------------

README = REPO_ROOT / "README.md"


def readme_section() -> str:
    text = README.read_text()
    m = re.search(r"^## Deploy on Kubernetes\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "README has no '## Deploy on Kubernetes' section"
    return m.group(1)


def readme_block(name: str) -> str:
    m = re.search(r"<!-- README-EXAMPLE: %s .*?-->\n```yaml\n(.*?)```" % re.escape(name), readme_section(), re.S)
    assert m, f"README example {name!r} not found"
    return m.group(1)


def test_readme_refers_only_to_rendered_examples():
    refs = set(re.findall(r"helm/speckv/examples/[A-Za-z0-9_.-]+\.yaml", readme_section()))
    assert refs, "the section names no example values file"
    rendered_examples = {f"helm/speckv/{k}" for k in CASES if k.startswith("examples/")}
    assert refs <= rendered_examples, refs - rendered_examples
    for ref in refs:
        assert (REPO_ROOT / ref).is_file(), ref
    # and every example is documented there
    assert {f"helm/speckv/examples/{p.name}" for p in EXAMPLES} <= refs



def test_named_templates_from_a_parent_chart(tmp_path):
    """The README's include example, as a user's chart with speckv as a dependency."""
    parent = tmp_path / "engine"
    (parent / "templates").mkdir(parents=True)
    (parent / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "engine", "version": "1.2.3", "appVersion": "9.9.9",
        "dependencies": [{"name": "speckv", "version": "0.1.0", "repository": "file://../speckv"}]}))
    (parent / "values.yaml").write_text(readme_block("helm-include-values"))
    (parent / "templates" / "prefill.yaml").write_text(readme_block("helm-include-template"))
    shutil.copytree(CHART_DIR, parent / "charts" / "speckv", ignore=shutil.ignore_patterns("examples"))

    report = helm_python.lint(parent, strict=True)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    with helm_python.Chart.load(parent) as c:
        objs = objects(c.render(name="eng", namespace=NAMESPACE))
        values = c.merge_values()["speckv"]
    for o in objs:
        if o["kind"] != "ServiceMonitor":
            k8s_validate(o, K8S_VERSIONS[-1])
    (dep,) = of_kind(objs, "Deployment")  # the user's; speckv renders no workloads of its own
    assert dep["metadata"]["name"] == "eng-prefill"
    spec = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == [FETCH, VERIFY, SERVE["encoder"]]
    sidecar = spec["initContainers"][2]
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"].startswith("ghcr.io/speckv/speckv:0.1.0-cpu")  # speckv's appVersion, not the parent's
    assert spec["initContainers"][1]["args"][-1] == values["predictor"]["pin"]
    assert sidecar["resources"] == values["encoder"]["resources"]
    assert {m["name"] for c in spec["initContainers"] for m in c["volumeMounts"]} <= set(volumes(spec))
    cfg = ServerConfig.from_env("encoder", env=env_map(sidecar))
    assert cfg.predictor == "/predictor" and cfg.pin == values["predictor"]["pin"]
    (engine,) = spec["containers"]
    assert env_map(engine)["SPECKV_ENCODER_ADDRESS"] == f"127.0.0.1:{port_of(sidecar, 'grpc')}"
