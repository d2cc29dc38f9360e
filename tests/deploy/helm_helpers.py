"""Helpers for tests/deploy: render the chart with the real Helm engine, walk the
rendered objects, and validate them offline (Kubernetes OpenAPI schemas shipped
by kubernetes-validate; the prometheus-operator ServiceMonitor CRD vendored
under schemas/); the values sets the chart tests render (``CASES``) and what the
chart should make of them (the vLLM connector's kv-transfer-config, selectors, the
README's examples).

No cluster and no network: helm_python binds Helm's Go SDK, kubernetes_validate
carries the Kubernetes JSON schemas, the CRD is a file in this repository.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import yaml

from speckv.v1 import decoder_pb2, encoder_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "speckv"
EXAMPLES_DIR = CHART_DIR / "examples"
SCHEMAS_DIR = Path(__file__).resolve().parent / "schemas"
SERVICEMONITOR_CRD = SCHEMAS_DIR / "monitoring.coreos.com_servicemonitors.yaml"
PROMETHEUSRULE_CRD = SCHEMAS_DIR / "monitoring.coreos.com_prometheusrules.yaml"

RELEASE = "speckv"
NAMESPACE = "llm"

# Names of the chart's own containers (the vLLM example container is "vllm").
FETCH = "speckv-predictor-fetch"
VERIFY = "speckv-predictor-verify"
SERVE = {"encoder": "speckv-encoder", "decoder": "speckv-decoder"}

RESTRICTED_CONTAINER_SC = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def load_example(path: Path) -> dict[str, Any]:
    values = yaml.safe_load(path.read_text())
    assert isinstance(values, dict), f"{path} is not a values mapping"
    return values


def render(chart: helm_python.Chart, values: dict[str, Any] | None = None,
           release: str = RELEASE) -> dict[str, str]:
    """template path -> rendered text (NOTES.txt included)."""
    return chart.render(values=values or {}, name=release, namespace=NAMESPACE)


def objects(manifests: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render (yaml.safe_load_all over each manifest)."""
    out = []
    for path, text in sorted(manifests.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            assert isinstance(doc, dict) and "kind" in doc and "apiVersion" in doc, (path, doc)
            out.append(doc)
    return out


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def pod_specs(objs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod spec) of every Deployment."""
    for o in of_kind(objs, "Deployment"):
        yield o, o["spec"]["template"]["spec"]


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def serve_containers(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(role, container) for every `speckv serve <role>` container of a pod."""
    out = []
    for c in all_containers(spec):
        args = c.get("args") or []
        if args[:1] == ["serve"]:
            out.append((args[1], c))
    return out


def env_map(container: dict[str, Any]) -> dict[str, str]:
    """Literal env values (valueFrom entries are skipped)."""
    return {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}


def port_of(container: dict[str, Any], name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports") or []}
    assert name in ports, f"{container['name']} has no port named {name}: {ports}"
    return ports[name]


def mounts(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["mountPath"]: m for m in container.get("volumeMounts") or []}


def volumes(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in spec.get("volumes") or []}


# --- Kubernetes OpenAPI validation -------------------------------------------------

def k8s_validate(obj: dict[str, Any], version: str) -> str:
    """Strict validation of a built-in object; returns the schema version used."""
    return kubernetes_validate.validate(obj, version, strict=True)


def _strictify(schema: Any) -> Any:
    """An openAPIV3Schema with unknown fields rejected, as the API server's strict
    field validation (kubectl --validate=strict) does for structural schemas:
    every object schema with `properties` and no `additionalProperties` or
    `x-kubernetes-preserve-unknown-fields` gets `additionalProperties: false`."""
    if isinstance(schema, dict):
        # NOTE: a Go regexp inline flag (the PrometheusRule CRD's Thanos-only
        # partial_response_strategy "^(?i)(abort|warn)?$") is no ECMA-262 pattern: dropped
        out = {k: _strictify(v) for k, v in schema.items()
               if not (k == "pattern" and isinstance(v, str) and "(?i)" in v)}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strictify(v) for v in schema]
    return schema


@functools.cache
def crd_validator(path: Path = SERVICEMONITOR_CRD, version: str = "v1") -> jsonschema.Validator:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert len(docs) == 1 and docs[0]["kind"] == "CustomResourceDefinition", path
    crd = docs[0]
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = copy.deepcopy(ver["schema"]["openAPIV3Schema"])
    # the API server validates metadata itself; check at least its shape here
    schema["properties"]["metadata"] = {
        "type": "object",
        "required": ["name"],
        "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                       "namespace": {"type": "string"},
                       "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                       "annotations": {"type": "object", "additionalProperties": {"type": "string"}}},
    }
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    schema["properties"]["apiVersion"] = {"const": f"{crd['spec']['group']}/{version}"}
    schema["properties"]["kind"] = {"const": crd["spec"]["names"]["kind"]}
    schema = _strictify(schema)
    # OpenAPI v3.0 schemas are a JSON Schema draft-4 dialect (boolean exclusiveMinimum etc.)
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def crd_validate(obj: dict[str, Any], crd: Path = SERVICEMONITOR_CRD) -> None:
    errors = sorted(crd_validator(crd).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def dashboard_json() -> Any:
    return json.loads((CHART_DIR / "dashboards" / "speckv.json").read_text())


def validate_all(objs: list[dict[str, Any]], versions: tuple[str, ...]) -> None:
    """Every built-in object of a render, strictly, for each Kubernetes version."""
    builtin = [o for o in objs if o["kind"] not in ("ServiceMonitor", "PrometheusRule")]
    assert builtin, "nothing rendered"
    for version in versions:
        for obj in builtin:
            assert k8s_validate(obj, version) == version, obj["metadata"]["name"]


def lint_clean(chart_dir: Path, values: dict[str, Any], namespace: str = NAMESPACE) -> None:
    """`helm lint --strict` with these values: no error and no warning."""
    report = helm_python.lint(chart_dir, values, strict=True, namespace=namespace)
    assert report["errors"] == [], report["errors"]
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report["messages"]


def hook_pods(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `helm test` hook Pods of a render."""
    return [o for o in of_kind(objs, "Pod")
            if (o["metadata"].get("annotations") or {}).get("helm.sh/hook") == "test"]


def every_pod_spec(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pod spec of every Deployment and of every bare Pod (the test hook)."""
    return [spec for _, spec in pod_specs(objs)] + [p["spec"] for p in of_kind(objs, "Pod")]


# --- the values sets the chart tests render, and what the chart should make of them --------

PIN = "c99abc452c89150d303f103aeaa0fa129824e7b0e3b5a0489bdb4ea9ce18badd"  # the shipped checkpoint
HEALTH_SERVICE = {
    "encoder": encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name,
    "decoder": decoder_pb2.DESCRIPTOR.services_by_name["DecoderService"].full_name,
}
# The chart's floor (Chart.yaml kubeVersion) and the newest schema kubernetes-validate ships.
K8S_VERSIONS = ("1.29", kubernetes_validate.utils.major_minor(kubernetes_validate.utils.latest_version()))

EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))

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


def case_ids(pred=lambda v: True) -> list[str]:
    return [n for n, v in CASES.items() if pred(v)]


def expected_roles(values: dict[str, Any]) -> set[str]:
    return {r for r in ("encoder", "decoder") if values[r]["enabled"]}


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
    else:
        chart |= {"speckv_decoder_address": local}
    if vl["localHandoff"]["enabled"]:  # the sidecar's local socket (hand-off or fetch), in the shared dir
        chart |= {"speckv_local_socket": f"{vl['localHandoff']['dir']}/{role}.sock"}
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
