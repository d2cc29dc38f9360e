"""A sidecar's load-time self-check (``Predictor.self_check``): two passes of one fixed prompt,
each on a fresh thread, compared bit for bit; a predictor that computes two mu for one prompt
is named (which layers differ) before it serves."""
from __future__ import annotations

import logging
import types

import numpy as np


def test_the_shipped_predictor_repeats_itself(embedded_session):
    assert embedded_session.predictor.self_check() is True


def test_a_predictor_whose_second_pass_differs_is_named(embedded_session, caplog, monkeypatch):
    p = embedded_session.predictor
    calls = []
    inner = type(p).stream

    def flaky(self, ids, on_layer, fp8_attention=None):
        calls.append(len(ids))

        def sink(i, bits):
            if len(calls) == 2 and i == 3:  # the second pass, layer 3: one bit off
                bits = bits.copy()
                bits.reshape(-1)[0] ^= np.uint16(1)
            on_layer(i, bits)
        inner(self, ids, sink, fp8_attention)

    monkeypatch.setattr(p, "stream", types.MethodType(flaky, p))
    with caplog.at_level(logging.ERROR, logger="speckv.predictor.predict"):
        assert p.self_check(tokens=16) is False
    assert calls == [16, 16]
    assert "layers [3] of 16 tokens differ" in caplog.text
