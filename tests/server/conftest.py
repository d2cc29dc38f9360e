"""Fixtures of the sidecar tests: one Sidecars loop sharing the session's loaded
predictor, one default decoder + encoder pair for the many tests that need
nothing special, and the real KV of a few short prompts (computed once).

Starting sidecars is cheap (milliseconds); loading the predictor is not, so
every sidecar here wraps ``embedded_session.predictor``.
"""

from __future__ import annotations

import numpy as np
import pytest
from server_helpers import Pair
from sidecars import Sidecars

from speckv.coder.codec import Fp8KV

TEXTS = {
    "short": "Hello world, this is a test of the sidecars.",  # ~11 tokens
    "medium": "The quick brown fox jumps over the lazy dog while the sidecars move its key-value cache "
              "from the prefill node to the decode node, bit for bit.",  # ~30 tokens
    # ~56 tokens: a KV (30 layers x 42 KiB) ~10 times a 128 KiB in-flight cap
    "long": "Lossless compression of the key-value cache needs the same predictor on both sides, and every "
            "bit the coder spends is the mismatch between the model and the data. Bridges hum in the wind "
            "because every span has a note of its own, and the river below keeps time.",
}


@pytest.fixture(scope="session")
def sidecars(embedded_session):
    sc = Sidecars(embedded_session.predictor)
    yield sc
    sc.close()


@pytest.fixture(scope="session")
def pair(sidecars):
    """The shared default pair (never stopped or reconfigured by a test)."""
    p = Pair.start(sidecars)
    yield p
    p.stop()


@pytest.fixture(scope="session")
def prompts(embedded_session):
    """``prompts(name) -> (ids int64, kv torch.bfloat16 (30, 2, 3, T, 64))``, cached."""
    cache: dict[str, tuple[np.ndarray, object]] = {}

    def get(name: str):
        if name not in cache:
            ids = embedded_session.target.tokenize(TEXTS[name])
            cache[name] = (ids, embedded_session.target.kv(ids))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def fp8_kv(prompts):
    """``fp8_kv(name) -> (ids, Fp8KV)`` of a prompt's KV."""
    from speckv.predictor.fp8 import kv_to_fp8

    def get(name: str):
        ids, kv = prompts(name)
        codes, scales = kv_to_fp8(kv)
        return ids, Fp8KV(codes.cpu().numpy().astype(np.uint8, copy=False),
                          scales.cpu().numpy().astype(np.float32, copy=False))

    return get
