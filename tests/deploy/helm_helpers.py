"""Helpers for tests/deploy: render the chart with the real Helm engine, walk the
rendered objects, and validate them offline (Kubernetes OpenAPI schemas shipped
by kubernetes-validate; the prometheus-operator ServiceMonitor CRD vendored
under schemas/).

No cluster and no network: helm_python binds Helm's Go SDK, kubernetes_validate
carries the Kubernetes JSON schemas, the CRD is a file in this repository.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import yaml

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
