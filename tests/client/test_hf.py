"""HF DynamicCache adapters on the real embedded model: the canonical tensor they
build equals the target's KV bit for bit, and a cache rebuilt from it continues
generation with bit-identical logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from speckv.client.hf import cache_from_kv, kv_from_cache
from speckv.coder.codec import bf16_bits


@pytest.fixture(scope="module")
def prefill(embedded_target):
    ids = embedded_target.tokenize("The adapters hand a Hugging Face cache to the sidecars.")
    inp = torch.as_tensor(ids).unsqueeze(0)
    with torch.no_grad():
        out = embedded_target.model(input_ids=inp, use_cache=True)
    return ids, out


def test_kv_from_cache_is_the_canonical_kv(embedded_target, prefill):
    ids, out = prefill
    kv = kv_from_cache(out.cache)  # the cache, or the output holding it
    assert torch.equal(kv_from_cache(out).view(torch.int16), kv.view(torch.int16))
    assert kv.dtype == torch.bfloat16 and tuple(kv.shape) == (30, 2, 3, len(ids), 64)
    assert np.array_equal(bf16_bits(kv), bf16_bits(embedded_target.kv(ids)))


@pytest.mark.parametrize("as_numpy", [False, True])
def test_cache_round_trip_continues_generation_bit_exactly(embedded_target, prefill, as_numpy):
    ids, out = prefill
    kv = kv_from_cache(out)
    rebuilt = cache_from_kv(bf16_bits(kv) if as_numpy else kv, embedded_target.model.config)
    assert np.array_equal(bf16_bits(kv_from_cache(rebuilt)), bf16_bits(kv))
    nxt = torch.tensor([[42]])
    with torch.no_grad():
        a = embedded_target.model(input_ids=nxt, cache=cache_from_kv(kv), use_cache=True).logits
        b = embedded_target.model(input_ids=nxt, cache=rebuilt, use_cache=True).logits
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.dtype == torch.bfloat16 else torch.equal(a, b)


def test_bad_inputs_raise():
    with pytest.raises(TypeError):
        kv_from_cache(object())
    with pytest.raises(ValueError):
        cache_from_kv(torch.zeros(2, 3, 1, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        cache_from_kv(np.zeros((1, 2, 1, 1, 1), np.float32))
