"""The README's Python client example, run as written against two real sidecars
on loopback (only the two addresses are replaced by the ephemeral ports, and
``load_target`` returns the already loaded embedded model)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from speckv.coder.codec import bf16_bits

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(name: str) -> str:
    text = README.read_text()
    m = re.search(r"<!-- README-EXAMPLE: %s .*?-->\n```python\n(.*?)```" % name, text, re.S)
    assert m, f"README example {name!r} not found"
    return m.group(1)


def test_readme_client_example(embedded_session, monkeypatch, capsys):
    from speckv.client.hf import kv_from_cache
    from speckv.predictor import target as target_mod
    from speckv.server.local import LocalPair

    code = readme_block("client")
    assert 'ENCODER, DECODER = "127.0.0.1:50051", "127.0.0.1:50052"' in code
    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: embedded_session.target)
    with LocalPair(embedded_session.predictor, metrics=False) as pair:
        code = code.replace('"127.0.0.1:50051", "127.0.0.1:50052"',
                            f'"{pair.encoder_address}", "{pair.decoder_address}"')
        ns: dict = {}
        exec(compile(code, "README.md", "exec"), ns)
    want = bf16_bits(embedded_session.target.kv(ns["ids"]))
    assert np.array_equal(bf16_bits(kv_from_cache(ns["cache"])), want)
    assert ns["res"].raw_bytes == want.nbytes and ns["res"].ratio > 2
    assert "raw bytes sent as" in capsys.readouterr().out
