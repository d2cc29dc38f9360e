"""The CUDA coder's test cases (tests/coder/test_cuda_kernels.py, test_cuda_batch.py; their
``coders`` fixture is in conftest.py): KV drawn at random, streams compared."""
from __future__ import annotations

import hashlib

import numpy as np

from speckv.coder.model import fp8_log2_sigma
from speckv.errors import IntegrityError, RansDecodeError


def kv_case(model, fp8, layers, tokens, seed):
    rng = np.random.default_rng(seed)
    shape = (layers, 2, 3, tokens, 64)
    mu = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    x = rng.integers(0, 256, shape, dtype=np.uint8) if fp8 else (mu ^ rng.integers(0, 16, shape)).astype(np.uint16)
    scales = rng.uniform(1e-3, 4, (layers, 2)).astype(np.float32) if fp8 else None
    a = None if model.mu_scale is None else model.mu_scale[:layers]
    b = None if model.mu_shift is None else model.mu_shift[:layers]
    L = model.log2_sigma[:layers].astype(np.int32)
    if fp8:
        L = fp8_log2_sigma(L, scales.view(np.uint32)[:, :, None, None]).astype(np.int32)
    return x, mu, a, b, scales, L


def assert_same_streams(pc, pn):
    assert len(pc) == len(pn)
    for c, n in zip(pc, pn, strict=True):
        assert c.bits == n.bits and np.array_equal(c.blocks.words, n.blocks.words)
        assert np.array_equal(c.blocks.states, n.blocks.states)
        assert np.array_equal(c.blocks.word_counts, n.blocks.word_counts)


def decode_outcome(coder, m, L, counts, epl, streams, tables, like):
    """The decode's error, or "ok" and a digest of what it wrote (a stream the checks accept may still
    decode to other values: the codec's checksum catches those; both coders must write the same)."""
    out = np.empty_like(like)
    try:
        coder.decode(m, L, counts, epl, streams, tables, out)
        return f"ok {hashlib.sha256(out.tobytes()).hexdigest()[:16]}"
    except (IntegrityError, RansDecodeError) as e:
        return f"{type(e).__name__}: {e}"
