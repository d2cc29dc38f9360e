"""The prompt length limit and the served model's context: ``max_tokens`` defaults to
the context (``max_position_embeddings`` of the model's config, 8192 for
SmolLM2-135M), a larger one is refused when a sidecar starts, and a request
longer than the context is INVALID_ARGUMENT whatever max_tokens says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
from server_helpers import MODEL, raw_submit, raw_transfer, rid

from speckv.errors import RpcError
from speckv.server.config import ServerConfig
from speckv.server.runtime import Runtime, model_context
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import encoder_pb2 as epb

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings


def shape(tokens: int) -> tuple[int, int, int, int, int]:
    return (30, 2, 3, tokens, 64)


@pytest.fixture(scope="module")
def runtime(embedded_session):
    return Runtime.from_predictor(embedded_session.predictor, ServerConfig(role="encoder"))


def test_max_tokens_is_unset_by_default():
    assert ServerConfig(role="encoder").max_tokens is None
    assert ServerConfig.from_env("decoder", {"SPECKV_MAX_TOKENS": "4096"}).max_tokens == 4096
    assert ServerConfig.from_env("decoder", {"SPECKV_MAX_TOKENS": ""}).max_tokens is None
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_tokens must be >= 1"):
            ServerConfig(role="encoder", max_tokens=bad)


def test_the_context_comes_from_the_model_config(runtime, embedded_target):
    assert embedded_target.config.max_position_embeddings == CONTEXT
    assert runtime.context == CONTEXT
    assert runtime.max_tokens(None) == CONTEXT  # unset: the context
    assert runtime.max_tokens(100) == 100
    assert model_context({"max_position_embeddings": 512}) == 512
    assert model_context({}) is None


@pytest.mark.parametrize("max_tokens", [CONTEXT + 1, 131072])
def test_max_tokens_past_the_context_is_refused_at_startup(embedded_session, max_tokens):
    with pytest.raises(ValueError, match=rf"max_tokens {max_tokens} \(--max-tokens / SPECKV_MAX_TOKENS\) exceeds "
                                         rf"the context of {MODEL}: {CONTEXT} tokens"):
        Runtime.from_predictor(embedded_session.predictor, ServerConfig(role="decoder", max_tokens=max_tokens))


@pytest.mark.parametrize("max_tokens", [None, 1, CONTEXT])
def test_max_tokens_within_the_context_starts(embedded_session, max_tokens):
    rt = Runtime.from_predictor(embedded_session.predictor, ServerConfig(role="encoder", max_tokens=max_tokens))
    assert rt.max_tokens(max_tokens) == (max_tokens or CONTEXT)


@pytest.mark.parametrize("max_tokens", [None, 16, CONTEXT])
def test_request_past_the_context_is_invalid_argument(runtime, max_tokens):
    ids = np.zeros(CONTEXT + 1, np.int64)
    with pytest.raises(RpcError, match=rf"{CONTEXT + 1} tokens exceed the context of {MODEL} \({CONTEXT} tokens\)") \
            as e:
        runtime.check(MODEL, shape(CONTEXT + 1), ids, max_tokens)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_request_within_the_context(runtime):
    runtime.check(MODEL, shape(CONTEXT), np.zeros(CONTEXT, np.int64), None)  # the whole context: accepted
    with pytest.raises(RpcError, match="17 tokens: this sidecar takes 1 to 16") as e:
        runtime.check(MODEL, shape(17), np.zeros(17, np.int64), 16)  # past max_tokens, within the context
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(RpcError, match=f"0 tokens: this sidecar takes 1 to {CONTEXT}"):
        runtime.check(MODEL, shape(0), np.zeros(0, np.int64), None)


def _kv_shape(tokens: int) -> pb.KVShape:
    L, kv, H, T, D = shape(tokens)
    return pb.KVShape(layers=L, kv=kv, kv_heads=H, tokens=T, head_dim=D)


def test_sidecars_refuse_a_prompt_past_the_context(pair, embedded_session):
    """The default pair (max_tokens unset): the header alone is refused, by both sidecars."""
    tokens = CONTEXT + 1
    ids = [0] * tokens
    want = f"{tokens} tokens exceed the context of {MODEL} ({CONTEXT} tokens)"
    submit = epb.SubmitRequest(header=epb.SubmitHeader(
        request_id=rid("ctx"), decoder_address=pair.daddr, model_id=MODEL, dtype=pb.DTYPE_BF16,
        shape=_kv_shape(tokens), prompt_token_ids=ids))
    e = raw_submit(pair.eaddr, [submit])
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and want in e.details()
    transfer = dpb.TransferRequest(header=dpb.TransferHeader(
        request_id=rid("ctx"), predictor_pin=bytes.fromhex(embedded_session.pin), model_id=MODEL,
        dtype=pb.DTYPE_BF16, shape=_kv_shape(tokens), prompt_token_ids=ids))
    with pytest.raises(grpc.RpcError) as ei:
        raw_transfer(pair.daddr, [transfer])
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and want in ei.value.details()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_refuses_max_tokens_past_the_context(how):
    """``speckv serve`` exits with status 2 and the reason, before loading any model
    (a sidecar that started would serve until killed: the timeout fails the test)."""
    cmd = [sys.executable, "-m", "speckv.cli.main", "serve", "encoder", "--listen", "127.0.0.1:0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECKV_")}
    if how == "flag":
        cmd += ["--max-tokens", "100000"]
    else:
        env["SPECKV_MAX_TOKENS"] = "100000"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    assert proc.stderr.startswith("speckv: error: max_tokens 100000 (--max-tokens / SPECKV_MAX_TOKENS) exceeds "
                                  f"the context of {MODEL}: {CONTEXT} tokens"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
