"""What the Helm chart renders for each values set (tests/deploy/helm_helpers.py: CASES),
offline: the workloads and Services of each mode and role, labels and selectors, the
native sidecars of mode: sidecar (the kv-transfer-config speckv's vLLM connector reads,
the headless decode Service, POD_IP), the predictor checkpoint's init containers and
mounts (fetch, pvc), extras reaching the objects, NOTES.txt and the image references.
"""

from __future__ import annotations

import pytest
from helm_helpers import (
    CASES,
    FETCH,
    NAMESPACE,
    RELEASE,
    SERVE,
    VERIFY,
    all_containers,
    case_ids,
    env_map,
    expected_kv_transfer_config,
    expected_roles,
    is_headless,
    kv_transfer_config,
    mounts,
    objects,
    of_kind,
    pod_specs,
    port_of,
    render,
    serve_containers,
    volumes,
)

from speckv.server.config import ServerConfig

# --- what is rendered, per mode ---------------------------------------------------------

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


# --- native sidecars (mode: sidecar) -------------------------------------------------

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
        if values["vllm"]["localHandoff"]["enabled"]:
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
