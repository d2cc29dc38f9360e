"""A sidecar's load-time self-check (``Predictor.self_check``): passes of one fixed prompt, each
on a fresh thread, compared bit for bit; a predictor that computes two mu for one prompt is named
(which layers differ) before it serves; a first pass alone that differs is the process's set-up
(a warning; the third pass agreed with the second)."""
from __future__ import annotations

import logging
import types

import numpy as np


def test_the_shipped_predictor_repeats_itself(embedded_session):
    assert embedded_session.predictor.self_check() is True


def flaky_stream(p, monkeypatch, odd_pass: int):
    """``p.stream`` with one bit of layer 3 flipped in pass ``odd_pass`` (1-based); the calls' lengths."""
    calls = []
    inner = type(p).stream

    def flaky(self, ids, on_layer, fp8_attention=None):
        calls.append(len(ids))

        def sink(i, bits):
            if len(calls) == odd_pass and i == 3:
                bits = bits.copy()
                bits.reshape(-1)[0] ^= np.uint16(1)
            on_layer(i, bits)
        inner(self, ids, sink, fp8_attention)

    monkeypatch.setattr(p, "stream", types.MethodType(flaky, p))
    return calls


def test_a_predictor_whose_second_pass_differs_is_named(embedded_session, caplog, monkeypatch):
    p = embedded_session.predictor
    calls = flaky_stream(p, monkeypatch, 2)
    with caplog.at_level(logging.ERROR, logger="speckv.predictor.predict"):
        assert p.self_check(tokens=16) is False
    assert calls == [16, 16, 16]  # the third agreed with the first, not the second
    assert "layers [3] of 16 tokens differ" in caplog.text


def test_a_first_pass_alone_that_differs_is_a_warning(embedded_session, caplog, monkeypatch):
    p = embedded_session.predictor
    calls = flaky_stream(p, monkeypatch, 1)
    with caplog.at_level(logging.WARNING, logger="speckv.predictor.predict"):
        assert p.self_check(tokens=16) is True
    assert calls == [16, 16, 16]
    assert "its first pass at load computed another mu (layers [3] of 16 tokens); the next two agree" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
