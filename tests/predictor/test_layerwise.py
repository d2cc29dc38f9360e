"""mu layer by layer: ``Predictor.mu(ids, on_layer)`` hands each layer's BF16 bits over
as soon as that decoder layer has run, bit-identical with the whole mu, in layer
order, before the pass ends; an exception raised by the callback aborts the pass."""
from __future__ import annotations

import numpy as np
import pytest

from speckv.coder.codec import bf16_bits


def test_layers_arrive_in_order_and_equal_the_whole_mu(embedded_session):
    ids = embedded_session.target.tokenize("Layer by layer, the same bits as the whole pass.")
    got: list[tuple[int, np.ndarray]] = []
    mu = bf16_bits(embedded_session.predictor.mu(ids, lambda i, b: got.append((i, b.copy()))))
    assert [i for i, _ in got] == list(range(mu.shape[0]))
    for i, b in got:
        assert b.dtype == np.uint16 and np.array_equal(b, mu[i]), i
    assert np.array_equal(mu, bf16_bits(embedded_session.predictor.mu(ids)))  # hooks only read


class Abort(Exception):
    pass


def test_the_callback_can_abort_the_pass(embedded_session):
    ids = embedded_session.target.tokenize("Stop after the third layer.")
    seen = []

    def on_layer(i, _b):
        seen.append(i)
        if i == 2:
            raise Abort("stop")

    with pytest.raises(Abort):
        embedded_session.predictor.mu(ids, on_layer)
    assert seen == [0, 1, 2]
    model = embedded_session.predictor.model
    exact = getattr(model, "head", None) or model  # w8a8:k's exact head runs the first layers
    mods = exact.model.layers if hasattr(exact, "model") else [exact]  # w8a8:k's llama.ExactHead emits itself
    assert not any(m._forward_hooks for m in mods)
