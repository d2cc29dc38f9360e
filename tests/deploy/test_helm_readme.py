"""The README's "Deploy on Kubernetes" section against the Helm chart: it names only
example values files the suite renders (and all of them), and its named-template include
example works as a user's chart with speckv as a dependency (linted, rendered, validated).
"""

from __future__ import annotations

import re
import shutil

import helm_python
import yaml
from helm_helpers import (
    CASES,
    CHART_DIR,
    EXAMPLES,
    FETCH,
    K8S_VERSIONS,
    NAMESPACE,
    REPO_ROOT,
    SERVE,
    VERIFY,
    env_map,
    k8s_validate,
    objects,
    of_kind,
    port_of,
    readme_block,
    readme_section,
    volumes,
)

from speckv.server.config import ServerConfig

# --- the named template, included from a user's chart (as the README shows) ------------

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
