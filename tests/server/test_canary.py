"""A portable-rung sidecar checks the checkpoint's canary mu at start-up: where this machine
computes other bits it logs why and keeps its health NOT_SERVING (so probes keep traffic away)."""
from __future__ import annotations

import json
import logging
import shutil

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sidecars import LoopThread

from speckv.errors import RpcError
from speckv.predictor.calibrate import build_checkpoint
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.predict import Predictor
from speckv.predictor.store import MANIFEST, canonical_json
from speckv.server.app import create_server
from speckv.server.config import ServerConfig
from speckv.server.runtime import Runtime


@pytest.fixture(scope="module")
def portable_ckpts(tiny_target, tiny_text, tmp_path_factory):
    good = tmp_path_factory.mktemp("canary") / "good"
    build_checkpoint(tiny_target, tiny_text, good, tokens=64, segment=32, rung="portable")
    bad = good.parent / "bad"
    shutil.copytree(good, bad)
    manifest = json.loads((bad / MANIFEST).read_bytes())
    manifest["canary"]["mu_sha256"] = "0" * 64  # as if the building machine had computed other bits
    (bad / MANIFEST).write_bytes(canonical_json(manifest))
    return good, bad


def test_canary_recorded_and_checked(portable_ckpts):
    good, bad = portable_ckpts
    assert load_checkpoint(good).manifest["canary"]["tokens"] == 256
    assert Predictor.from_checkpoint(load_checkpoint(good)).canary_ok() is True
    assert Predictor.from_checkpoint(load_checkpoint(bad)).canary_ok() is False


@pytest.mark.parametrize("which,want", [(0, health_pb2.HealthCheckResponse.SERVING),
                                        (1, health_pb2.HealthCheckResponse.NOT_SERVING)])
def test_sidecar_health_follows_the_canary(portable_ckpts, tiny_model_dir, caplog, which, want):
    config = ServerConfig(role="decoder", predictor=str(portable_ckpts[which]), target=str(tiny_model_dir))
    with caplog.at_level(logging.ERROR, logger="speckv.server.runtime"):
        runtime = Runtime.load(config)
    assert runtime.numeric_ok is (which == 0)
    assert runtime.self_check_ok is (True if which == 0 else None)  # two passes at load, when it may serve
    if which == 1:  # callers that ignore health are refused too
        with pytest.raises(RpcError) as ei:
            runtime.check(runtime.model_id, (2, 2, 2, 3, 16), np.zeros(3, np.int64), None)
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and ei.value.reason == "NUMERIC_ENV"
    assert ("refusing to serve" in caplog.text) is (which == 1)
    loop = LoopThread()
    try:
        sidecar, port = loop.run(_started(config, runtime))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for name in ("", "speckv.v1.DecoderService"):
                assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == want
        loop.run(sidecar.stop(0.1))
    finally:
        loop.close()


async def _started(config, runtime):
    sidecar, port = create_server(config, runtime)
    await sidecar.start()
    return sidecar, port
