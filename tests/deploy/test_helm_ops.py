"""The chart's operational values (issue 20, item 5 a, d, e, f, h): the `helm test` hook
pod (rendered, and its `speckv health` commands run against a real sidecar pair),
priorityClassName and topologySpreadConstraints per role, extraVolumes /
extraVolumeMounts, and predictor.device (SPECKV_PREDICTOR_DEVICE, the decode-node
example on its GPU). Every values set is rendered by the real Helm engine, linted
strictly and validated against the Kubernetes OpenAPI schemas."""
from __future__ import annotations

from typing import Any

import helm_python
import pytest
from helm_helpers import (
    CHART_DIR,
    EXAMPLES_DIR,
    HEALTH_SERVICE,
    K8S_VERSIONS,
    NAMESPACE,
    RELEASE,
    all_containers,
    env_map,
    hook_pods,
    lint_clean,
    load_example,
    mounts,
    objects,
    of_kind,
    pod_specs,
    port_of,
    render,
    selects,
    serve_containers,
    validate_all,
    volumes,
)

from speckv.cli.main import main
from speckv.server.config import ServerConfig

SPREAD = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
OWN_SELECTOR = {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"team": "llm"}}}
PLACEMENT = {"priorityClassName": "llm-serving", "topologySpreadConstraints": [SPREAD, OWN_SELECTOR]}
EXTRA_VOLUMES = {"extraVolumes": [{"name": "corp-ca", "configMap": {"name": "corp-ca"}}],
                 "extraVolumeMounts": [{"name": "corp-ca", "mountPath": "/etc/corp-ca", "readOnly": True}],
                 "config": {"extraEnv": [{"name": "SSL_CERT_DIR", "value": "/etc/corp-ca"}]}}
TLS = {"tls": {"enabled": True, "secretName": "speckv-tls"}}


def rendered_objects(chart: helm_python.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Render, lint strictly and validate every object; the objects."""
    objs = objects(render(chart, values))
    lint_clean(CHART_DIR, values)
    validate_all(objs, K8S_VERSIONS)
    return objs


def role_of(dep: dict[str, Any]) -> str:
    role: str = dep["metadata"]["labels"]["app.kubernetes.io/component"]
    return role


# --- helm test ----------------------------------------------------------------------------

def health_targets(objs: list[dict[str, Any]]) -> dict[str, tuple[str, list[str]]]:
    """role -> (Service name, the rest of `speckv health`'s arguments) of the hook pod."""
    (pod,) = hook_pods(objs)
    out = {}
    for c in pod["spec"]["containers"]:
        assert c["args"][0] == "health"
        host, port = c["args"][1].rsplit(":", 1)
        out[c["name"].removeprefix("health-")] = (host, [port, *c["args"][2:]])
    return out


@pytest.mark.parametrize("values", [{}, {"mode": "sidecar"}, TLS, {"decoder": {"enabled": False}}],
                         ids=["standalone", "sidecar", "tls", "encoder-only"])
def test_helm_test_pod_checks_each_role_through_its_service(chart, values):
    objs = rendered_objects(chart, values)
    (pod,) = hook_pods(objs)
    assert pod["metadata"]["annotations"]["helm.sh/hook-delete-policy"] == "before-hook-creation"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    targets = health_targets(objs)
    deps = {role_of(d): d for d in of_kind(objs, "Deployment")}
    assert set(targets) == set(deps)
    services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}
    for role, (svc_name, rest) in targets.items():
        svc = services[svc_name]  # a Service of this release, selecting this role's pods
        assert selects({"matchLabels": svc["spec"]["selector"]}, deps[role]["spec"]["template"]["metadata"]["labels"])
        (_, serve), = serve_containers(deps[role]["spec"]["template"]["spec"])
        grpc_port = {p["name"]: p["port"] for p in svc["spec"]["ports"]}["grpc"]
        assert int(rest[0]) == grpc_port == port_of(serve, "grpc")
        assert rest[1:3] == ["--service", HEALTH_SERVICE[role]]
        c = next(x for x in spec["containers"] if x["name"] == f"health-{role}")
        assert c["image"] == serve["image"]  # the chart's own image, no other pull
        tls_args = [a for a in rest if a.startswith("--tls-")]
        if "tls" in values:
            cfg = ServerConfig.from_env(role, env=env_map(serve))
            assert sorted(tls_args) == sorted([f"--tls-ca={cfg.tls_ca}", f"--tls-cert={cfg.tls_cert}",
                                               f"--tls-key={cfg.tls_key}"])
            secret = volumes(spec)[mounts(c)["/etc/speckv/tls"]["name"]]["secret"]
            assert secret["secretName"] == "speckv-tls"
        else:
            assert tls_args == []


def test_helm_test_pod_can_be_switched_off(chart):
    notes = "speckv/templates/NOTES.txt"
    assert f"helm test {RELEASE} -n {NAMESPACE}" in render(chart, {})[notes]
    off = render(chart, {"helmTest": {"enabled": False}})
    assert hook_pods(objects(off)) == [] and "helm test" not in off[notes]
    assert hook_pods(objects(render(chart, {"encoder": {"enabled": False}, "decoder": {"enabled": False}}))) == []


def test_helm_test_commands_against_real_sidecars(chart, embedded_session, capsys):
    """The hook's own argument lists, pointed at a live pair instead of the Services:
    SERVING for each role; a stopped sidecar fails the check."""
    from speckv.server.local import LocalPair

    targets = health_targets(objects(render(chart, {})))
    with LocalPair(embedded_session.predictor, metrics=False) as pair:
        for role, (_, rest) in targets.items():
            addr = pair.address(role)
            assert main(["health", addr, *rest[1:]]) == 0, role
            assert capsys.readouterr().out.strip() == "SERVING"
        # the encoder's check names the encoder's service: the decoder does not serve it
        assert main(["health", pair.address("decoder"), *targets["encoder"][1][1:]]) != 0
    assert main(["health", addr, *rest[1:]]) != 0  # the pair is gone


# --- placement ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["standalone", "sidecar"])
def test_priority_class_and_topology_spread(chart, mode):
    # sidecar mode places pods by vllm.<side>; the role's own placement is for standalone
    values: dict[str, Any] = {"mode": mode, "decoder": PLACEMENT}
    if mode == "sidecar":
        values |= {"decoder": {"priorityClassName": "ignored"}, "vllm": {"decode": PLACEMENT}}
    objs = rendered_objects(chart, values)
    for dep, spec in pod_specs(objs):
        if role_of(dep) == "encoder":  # not configured: nothing rendered
            assert "priorityClassName" not in spec and "topologySpreadConstraints" not in spec
            continue
        assert spec["priorityClassName"] == "llm-serving"
        spread, own = spec["topologySpreadConstraints"]
        assert own == OWN_SELECTOR  # an explicit labelSelector is kept
        assert {k: spread[k] for k in SPREAD} == SPREAD
        # a constraint without one counts this role's pods exactly
        assert spread["labelSelector"] == {"matchLabels": dep["spec"]["selector"]["matchLabels"]}
        assert selects(spread["labelSelector"], dep["spec"]["template"]["metadata"]["labels"])


def test_defaults_render_no_placement_extras(chart):
    for _, spec in pod_specs(objects(render(chart, {}))):
        assert not {"priorityClassName", "topologySpreadConstraints", "nodeSelector", "affinity"} & set(spec)


# --- extra volumes and env ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["standalone", "sidecar"])
def test_extra_volumes_and_mounts_reach_every_sidecar(chart, mode):
    objs = rendered_objects(chart, {"mode": mode, **EXTRA_VOLUMES})
    n = 0
    for _, spec in pod_specs(objs):
        assert volumes(spec)["corp-ca"] == {"name": "corp-ca", "configMap": {"name": "corp-ca"}}
        for _, c in serve_containers(spec):
            assert mounts(c)["/etc/corp-ca"] == EXTRA_VOLUMES["extraVolumeMounts"][0]
            assert env_map(c)["SSL_CERT_DIR"] == "/etc/corp-ca"
            n += 1
        for c in all_containers(spec):  # every mount names a volume of the pod
            assert {m["name"] for m in c.get("volumeMounts") or []} <= set(volumes(spec)), c["name"]
    assert n == 2


# --- predictor device ------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "auto"])
def test_predictor_device_reaches_both_sidecars(chart, device):
    values = {"predictor": {"device": device}, "image": {"variant": "cuda" if device != "cpu" else "cpu"}}
    objs = rendered_objects(chart, values)
    got = {role: ServerConfig.from_env(role, env=env_map(c)).predictor_device
           for _, spec in pod_specs(objs) for role, c in serve_containers(spec)}
    assert got == {"encoder": device, "decoder": device}


def test_default_device_is_the_sidecars_default(chart):
    for _, spec in pod_specs(objects(render(chart, {}))):
        (role, c), = serve_containers(spec)
        assert env_map(c)["SPECKV_PREDICTOR_DEVICE"] == ServerConfig(role=role).predictor_device == "cpu"


def test_decode_node_example_runs_the_predictor_on_its_gpu(chart):
    values = load_example(EXAMPLES_DIR / "decode-node.yaml")
    (dep,) = of_kind(objects(render(chart, values)), "Deployment")
    (role, c), = serve_containers(dep["spec"]["template"]["spec"])
    assert role == "decoder" and c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert ServerConfig.from_env(role, env=env_map(c)).predictor_device == "cuda"
    assert c["image"].endswith("-cuda")


def test_cuda_device_on_the_cpu_image_refused(chart):
    with pytest.raises(helm_python.HelmError, match="image.variant cuda"):
        render(chart, {"predictor": {"device": "cuda"}})
    render(chart, {"predictor": {"device": "cuda"}, "image": {"variant": ""}})  # a custom image: trusted


BAD_VALUES = {
    "device gpu": ({"predictor": {"device": "gpu"}}, {"predictor": {"device": "auto"}}),
    "device cuda:x": ({"predictor": {"device": "cuda:x"}}, {"predictor": {"device": "cpu"}}),
    "priority class upper-case": ({"encoder": {"priorityClassName": "High"}},
                                  {"encoder": {"priorityClassName": "high"}}),
    "spread without topologyKey": ({"decoder": {"topologySpreadConstraints": [{"maxSkew": 1,
                                                                               "whenUnsatisfiable": "DoNotSchedule"}]}},
                                   {"decoder": {"topologySpreadConstraints": [SPREAD]}}),
    "extra mount without path": ({"extraVolumeMounts": [{"name": "x"}]},
                                 {"extraVolumeMounts": [{"name": "x", "mountPath": "/x"}],
                                  "extraVolumes": [{"name": "x", "emptyDir": {}}]}),
    "helmTest unknown key": ({"helmTest": {"timeout": 5}}, {"helmTest": {"timeoutSeconds": 5}}),
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


# --- vLLM's GPU memory fraction and the predictor's footprint (item 6 b) ---------------------

GIB = 2**30
GPU = {"mode": "sidecar", "image": {"variant": "cuda"}, "predictor": {"device": "cuda"}}


def gpu_memory_args(objs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """vLLM Deployment (prefill | decode) -> its --gpu-memory-utilization arguments."""
    out = {}
    for dep, spec in pod_specs(objs):
        (vllm,) = [c for c in spec["containers"] if c["name"] == "vllm"]
        out[dep["metadata"]["name"].rsplit("-", 1)[1]] = [a for a in vllm["args"]
                                                          if a.startswith("--gpu-memory-utilization")]
    return out


def with_gpu(predictor_bytes: int, total: int = 80 * GIB, base: float = 0, device: str = "cuda") -> dict[str, Any]:
    return {**GPU, "predictor": {"device": device, "gpuMemoryBytes": predictor_bytes},
            "vllm": {"gpuMemoryUtilization": base, "gpuTotalBytes": total}}


def test_no_gpu_memory_flag_by_default(chart):
    assert gpu_memory_args(objects(render(chart, {"mode": "sidecar"}))) == {"prefill": [], "decode": []}
    # a predictor on the CPU takes nothing from the engine's GPU: nothing to lower
    assert gpu_memory_args(objects(render(chart, with_gpu(4 * GIB, device="cpu")))) == {"prefill": [],
                                                                                          "decode": []}


@pytest.mark.parametrize(("values", "want"), [
    ({"mode": "sidecar", "vllm": {"gpuMemoryUtilization": 0.9}}, "0.9000"),  # as given
    (with_gpu(4 * GIB), "0.8500"),                                          # 0.9 (vLLM's default) - 4/80
    (with_gpu(2 * GIB), "0.8750"),                                          # the value moves the flag
    (with_gpu(3 * GIB, base=0.95), "0.9125"),                               # from the chart's own fraction
    (with_gpu(1_000_000_000, total=141 * 10**9, base=0.8), "0.7929"),       # 0.79290...: rounded down
    ({**with_gpu(4 * GIB), "predictor": {"device": "auto", "gpuMemoryBytes": 4 * GIB}}, "0.8500"),
], ids=["fraction-only", "4GiB-of-80", "2GiB-of-80", "base-0.95", "round-down", "auto"])
def test_predictor_footprint_lowers_vllm_gpu_memory_utilization(chart, values, want):
    objs = rendered_objects(chart, values)
    assert gpu_memory_args(objs) == {"prefill": [f"--gpu-memory-utilization={want}"],
                                     "decode": [f"--gpu-memory-utilization={want}"]}


@pytest.mark.parametrize(("values", "match"), [
    (with_gpu(4 * GIB, total=0), "vllm.gpuTotalBytes"),
    (with_gpu(80 * GIB), "leaves the engine no memory"),
    ({**with_gpu(GIB), "vllm": {"gpuTotalBytes": 80 * GIB, "extraArgs": ["--gpu-memory-utilization=0.5"]}},
     "vllm.extraArgs sets --gpu-memory-utilization"),
], ids=["no-total", "too-big", "extra-args"])
def test_gpu_memory_values_refused(chart, values, match):
    with pytest.raises(helm_python.HelmError, match=match):
        render(chart, values)


@pytest.mark.parametrize("bad", [{"vllm": {"gpuMemoryUtilization": 1.2}}, {"vllm": {"gpuTotalBytes": -1}},
                                 {"predictor": {"gpuMemoryBytes": "4Gi"}}], ids=["over-1", "negative", "quantity"])
def test_schema_rejects_bad_gpu_memory_values(chart, bad):
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(bad)
