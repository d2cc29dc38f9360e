"""``speckv serve`` as a real process: flags and SPECKV_* variables reach the
config, health answers SERVING, and SIGTERM drains it (health NOT_SERVING seen
by a watcher) before a clean exit."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def _wait_line(proc, pattern, timeout):
    found = {}

    def read():
        for line in proc.stdout:
            m = re.search(pattern, line)
            if m:
                found["m"] = m
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    return found.get("m")


@pytest.mark.parametrize("role", ["decoder"])
def test_serve_process_health_env_and_sigterm(role, embedded_session):
    env = {**os.environ, "SPECKV_MAX_INFLIGHT_BYTES": "50.331648M",  # 48Mi as a decimal quantity
           "SPECKV_GRACE_S": "3",
           "SPECKV_LISTEN": "127.0.0.1:1"}  # the flag below must win over this variable
    proc = subprocess.Popen([sys.executable, "-m", "speckv.cli.main", "serve", role,
                             "--listen", "127.0.0.1:0", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        m = _wait_line(proc, r"listening on port (\d+), metrics on port (\d+)", 180)
        assert m, f"no listening line; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        port, mport = int(m.group(1)), int(m.group(2))
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(channel)
        name = f"speckv.v1.{role.capitalize()}Service"
        assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == SERVING
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        assert re.search(r'speckv_inflight_limit_bytes\{[^}]*role="%s"[^}]*\} 5\.0331648e\+07' % role, text)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=60)
        seen = [next(watch).status]
        proc.send_signal(signal.SIGTERM)
        for resp in watch:
            seen.append(resp.status)
            if resp.status != SERVING:
                break
        assert seen[0] == SERVING and seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 30
        assert "NOT_SERVING" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
