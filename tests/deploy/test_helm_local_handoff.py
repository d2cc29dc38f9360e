"""The chart's local KV hand-off option (vllm.localHandoff, mode: sidecar): off by default;
on, each pod gets a memory emptyDir mounted at the same directory in the vLLM container and
its sidecar, the sidecar SPECKV_LOCAL_SOCKET (encoder.sock in the prefill pod, decoder.sock
in the decode pod; and SPECKV_LOCAL_UIDS when set), and the vLLM container the same socket
path as the connector's speckv_local_socket (kv_connector_extra_config) and
SPECKV_LOCAL_SOCKET, both read by the connector; every object validates (kubernetes-validate)."""
from __future__ import annotations

import pytest
import yaml
from helm_helpers import (
    EXAMPLES_DIR,
    K8S_VERSIONS,
    all_containers,
    env_map,
    kv_transfer_config,
    load_example,
    mounts,
    objects,
    of_kind,
    readme_block,
    render,
    validate_all,
    volumes,
)
from test_helm_vllm import connector_reads

SIDECAR = {"mode": "sidecar", "encoder": {"enabled": True}, "decoder": {"enabled": True}}


def _pods(chart, local: dict | None) -> dict[str, dict]:
    values = {**SIDECAR, **({"vllm": {"localHandoff": local}} if local is not None else {})}
    objs = objects(render(chart, values))
    validate_all(objs, K8S_VERSIONS)
    return {d["metadata"]["name"].rsplit("-", 1)[-1]: d["spec"]["template"]["spec"]
            for d in of_kind(objs, "Deployment")}


def _by_name(spec: dict) -> dict[str, dict]:
    return {c["name"]: c for c in all_containers(spec)}


def test_off_by_default(chart):
    for spec in _pods(chart, None).values():
        assert "speckv-local" not in volumes(spec)
        for c in all_containers(spec):
            assert "SPECKV_LOCAL_SOCKET" not in env_map(c)
            assert all(m["name"] != "speckv-local" for m in mounts(c).values())
        assert "speckv_local_socket" not in kv_transfer_config(_by_name(spec)["vllm"])["kv_connector_extra_config"]


@pytest.mark.parametrize(("pod", "role"), [("prefill", "encoder"), ("decode", "decoder")])
def test_each_pod_shares_the_socket_dir(chart, pod, role):
    spec = _pods(chart, {"enabled": True, "dir": "/run/kv", "uids": "10001,1000"})[pod]
    assert volumes(spec)["speckv-local"]["emptyDir"]["medium"] == "Memory"
    c = _by_name(spec)
    assert mounts(c["vllm"])["/run/kv"]["name"] == "speckv-local"
    assert mounts(c[f"speckv-{role}"])["/run/kv"]["name"] == "speckv-local"
    env = env_map(c[f"speckv-{role}"])
    assert (env["SPECKV_LOCAL_SOCKET"], env["SPECKV_LOCAL_UIDS"]) == (f"/run/kv/{role}.sock", "10001,1000")


@pytest.mark.parametrize(("pod", "role"), [("prefill", "encoder"), ("decode", "decoder")])
def test_connector_finds_the_socket(chart, pod, role):
    """Each vLLM container is given its sidecar's socket path the way it is given the sidecar's
    address: the extra-config key and its SPECKV_* fallback, both read by the connector."""
    c = _by_name(_pods(chart, {"enabled": True, "dir": "/run/kv"})[pod])
    path = env_map(c[f"speckv-{role}"])["SPECKV_LOCAL_SOCKET"]
    assert path == f"/run/kv/{role}.sock"
    vllm = c["vllm"]
    assert kv_transfer_config(vllm)["kv_connector_extra_config"]["speckv_local_socket"] == path
    assert env_map(vllm)["SPECKV_LOCAL_SOCKET"] == path
    assert path.rsplit("/", 1)[0] in mounts(vllm)  # the shared directory, mounted in vLLM too
    keys, env = connector_reads()
    assert "speckv_local_socket" in keys and "SPECKV_LOCAL_SOCKET" in env


def test_readme_example(chart):
    """The README's vllm.localHandoff values, over the sidecar example it says they go on top of."""
    local = yaml.safe_load(readme_block("helm-local-handoff"))["vllm"]["localHandoff"]
    values = load_example(EXAMPLES_DIR / "vllm-sidecar.yaml")
    values["vllm"] = {**values.get("vllm", {}), "localHandoff": local}
    objs = objects(render(chart, values))
    validate_all(objs, K8S_VERSIONS)
    (prefill,) = [d["spec"]["template"]["spec"] for d in of_kind(objs, "Deployment")
                  if d["metadata"]["name"].endswith("-prefill")]
    c = _by_name(prefill)
    path = f"{local['dir']}/encoder.sock"
    assert env_map(c["speckv-encoder"])["SPECKV_LOCAL_SOCKET"] == path
    assert kv_transfer_config(c["vllm"])["kv_connector_extra_config"]["speckv_local_socket"] == path
