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


def test_readme_client_example(embedded_session, monkeypatch, capsys, tmp_path):
    """The client example, then the local hand-off example on the same pair (its sidecars
    listen on local sockets; the socket paths are replaced by the test's)."""
    from speckv.client.hf import kv_from_cache
    from speckv.client.local import LocalHandoff, LocalMailbox
    from speckv.predictor import target as target_mod
    from speckv.server.local import LocalPair

    code = readme_block("client")
    assert 'ENCODER, DECODER = "127.0.0.1:50051", "127.0.0.1:50052"' in code
    local = readme_block("client-local")
    assert '"/run/speckv/encoder.sock"' in local and '"/run/speckv/decoder.sock"' in local
    sock, dsock = str(tmp_path / "encoder.sock"), str(tmp_path / "decoder.sock")
    shared, taken = [], []
    share, take = LocalHandoff.share, LocalMailbox.take
    monkeypatch.setattr(LocalHandoff, "share", lambda self, bufs: shared.append(self.path) or share(self, bufs))
    monkeypatch.setattr(LocalMailbox, "take", lambda self, *a: taken.append(self.path) or take(self, *a))
    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: embedded_session.target)
    with LocalPair(embedded_session.predictor, metrics=False, encoder={"local_socket": sock},
                   decoder={"local_socket": dsock}) as pair:
        code = code.replace('"127.0.0.1:50051", "127.0.0.1:50052"',
                            f'"{pair.encoder_address}", "{pair.decoder_address}"')
        ns: dict = {}
        exec(compile(code, "README.md", "exec"), ns)
        assert shared == taken == []  # the first example: the bytes path
        local = local.replace('"/run/speckv/encoder.sock"', repr(sock)).replace('"/run/speckv/decoder.sock"',
                                                                                repr(dsock))
        exec(compile(local, "README.md", "exec"), ns)
        assert shared == [sock] and taken == [dsock]  # the second: one sealed memfd through each socket
        exec(compile(readme_block("client-tp"), "README.md", "exec"), ns)
        assert shared == [sock] and taken == [dsock]  # the third: three ranges, each on the bytes path
    want = bf16_bits(embedded_session.target.kv(ns["ids"]))
    assert np.array_equal(bf16_bits(kv_from_cache(ns["cache"])), want)
    assert ns["res"].raw_bytes == want.nbytes and ns["res"].ratio > 2
    assert np.array_equal(ns["kv2"], want)
    assert np.array_equal(ns["kv3"], want)
    assert "raw bytes sent as" in capsys.readouterr().out
