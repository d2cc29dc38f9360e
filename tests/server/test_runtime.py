"""A sidecar's runtime fits the exact head's MLP to its role (``server.runtime.fit_head``): row blocks
on a decoder, the whole prompt on an encoder, and both give the same mu, bit for bit."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from speckv.predictor.llama import MLP_ROWS
from speckv.server.config import ServerConfig
from speckv.server.runtime import Runtime


@pytest.fixture
def head(embedded_session):
    head = embedded_session.predictor.model.head
    kept = head.mlp_rows
    yield head
    head.mlp_rows = kept  # NOTE: the session's predictor is shared with other tests' runtimes


def mu_bits(runtime: Runtime, ids: np.ndarray) -> np.ndarray:
    async def run() -> np.ndarray:
        mu = runtime.mu_layers(ids)
        await mu.done()
        return mu.bits.copy()

    return asyncio.run(run())


def test_each_role_runs_the_head_its_way_with_the_same_mu(embedded_session, head):
    ids = embedded_session.target.tokenize("Speculative KV coding, bit for bit. " * 200, 1100)
    assert len(ids) == 1100  # two MLP blocks on the decoder: 512 and 588 rows
    decoder = Runtime.from_predictor(embedded_session.predictor, ServerConfig(role="decoder"))
    assert head.mlp_rows == MLP_ROWS
    blocked = mu_bits(decoder, ids)
    encoder = Runtime.from_predictor(embedded_session.predictor, ServerConfig(role="encoder"))
    assert head.mlp_rows is None
    whole = mu_bits(encoder, ids)
    assert blocked.dtype == whole.dtype and blocked.shape == whole.shape
    assert blocked.tobytes() == whole.tobytes()
