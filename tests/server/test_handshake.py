"""The encoder's handshake with a decoder of another release (server/replies.py): a
decoder that does not read the encoder's stream format version gets the same stream
one version older, still coded, whether it refuses the header the way decoders do now
(UNSUPPORTED_VERSION) or the way decoders before that reason did (MALFORMED_STREAM,
"unsupported format version"); a stored stream is written in version 3, which every
such decoder reads. (A decoder under another predictor pin: tests/server/test_fallback.py.)"""
from __future__ import annotations

import logging

import numpy as np
import pytest
from test_fallback import _metric, _transfer, running_pair

from speckv.client.client import DecoderClient, EncoderClient
from speckv.coder import container as ct
from speckv.coder.codec import bf16_bits
from speckv.errors import FormatError, UnsupportedVersionError
from speckv.server.decoder import DecoderService

OLD = 3  # the newest version the simulated older decoder reads (by default)


def _refuse_newer(exc: type[FormatError], old: int = OLD):
    real = DecoderService._check_header
    seen: list[int] = []

    def check(self, hdr):
        h, _ = ct.unpack_header(hdr.header_record)
        seen.append(h.version)
        if h.version > old:  # NOTE: the message decoders of version 3 gave
            raise exc(f"unsupported format version {h.version}")
        return real(self, hdr)
    return check, seen


@pytest.mark.parametrize("exc,old", [(UnsupportedVersionError, 4), (UnsupportedVersionError, 3), (FormatError, 3)],
                         ids=["reason-v4", "reason-v3", "legacy-message-v3"])
def test_a_decoder_reading_older_versions_gets_an_older_coded_stream(embedded_session, monkeypatch, caplog, exc,
                                                                      old):
    """The encoder steps down one version per refusal until the decoder takes the stream."""
    check, seen = _refuse_newer(exc, old)
    monkeypatch.setattr(DecoderService, "_check_header", check)
    target, p = embedded_session.target, embedded_session.predictor
    with running_pair(p, p) as ((enc, eaddr), (dec, daddr)):
        with caplog.at_level(logging.WARNING, logger="speckv"):
            for k, text in enumerate(["A decoder one release behind.", "And its second transfer."]):
                ids = target.tokenize(text)
                kv = target.kv(ids)
                res, back = _transfer(eaddr, daddr, f"ver-{exc.__name__}-{old}-{k}", kv, ids)
                assert np.array_equal(back, bf16_bits(kv))
                assert (res.encoding, res.fallback, res.stored_chunks) == ("speckv", False, 0), res
                assert res.wire_bytes < res.raw_bytes / 2  # still coded, in the older version
        assert seen == list(range(ct.FORMAT_VERSION, old - 1, -1)) * 2  # refused, then taken older
        assert _metric(enc, "speckv_fallbacks_total", "pin_mismatch") == 0
        warned = [r for r in caplog.records if r.name == "speckv.server.encoder" and
                  f"reads stream format {ct.FORMAT_VERSION - 1}" in r.getMessage()]
        assert len(warned) == 1  # once per peer


def test_a_stored_stream_is_written_in_version_3(embedded_session, monkeypatch):
    check, seen = _refuse_newer(UnsupportedVersionError)
    monkeypatch.setattr(DecoderService, "_check_header", check)
    p = embedded_session.predictor
    with running_pair(p, p) as ((_, eaddr), (_, daddr)):
        ids = embedded_session.target.tokenize("Stored, for any decoder since version 3.")
        kv = embedded_session.target.kv(ids)
        with EncoderClient(eaddr) as e, DecoderClient(daddr) as d:
            res = e.submit("ver-stored", kv, ids, daddr, "SmolLM2-135M-Instruct", encoding="stored", timeout=60)
            back = d.fetch("ver-stored", 30, 60)
        assert np.array_equal(back, bf16_bits(kv)) and res.encoding == "stored"
        assert seen == [OLD]  # taken at once: no refusal, no second call
