"""benchmarks/results.py's exact per-element code length: it must add up to the real
codec's coded size (less the container's fixed overhead) under every model variant."""
from __future__ import annotations

import numpy as np
import pytest

from speckv.coder import container as ct
from speckv.coder.codec import Codec, CodecConfig, Fp8KV
from speckv.predictor.fp8 import kv_to_fp8


@pytest.fixture(scope="module")
def results(load_script):
    return load_script("results")


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_element_bits_add_up_to_the_coded_size(results, embedded_session, dtype):
    sess = embedded_session
    ck = sess.predictor.checkpoint
    ids = sess.target.tokenize("To be, or not to be, that is the question: whether 'tis nobler in the mind")
    kv, mu = sess.target.kv(ids), sess.predictor.mu(ids)
    if dtype == "fp8":
        q, s = kv_to_fp8(kv)
        kv = Fp8KV(q.numpy(), s.numpy())
    n = kv.codes.size if dtype == "fp8" else kv.numel()
    for name, model in results.variant_models(ck).items():
        codec = Codec(ck.tables, ck.calib.sigma_log2_q, ck.pin, config=CodecConfig(coder="numpy", threads=1),
                      models={model.model_id: model})
        k, v, total = results.stream_bits(codec, kv, ids, mu)
        assert total == pytest.approx((k + v) / 2)
        records = list(codec.encode(kv, ids, mu))
        h, _ = ct.unpack_header(records[0])
        overhead = sum(len(r) for r in records) - sum(len(ct.unpack_chunk(r, h)[0].bits) for r in records[1:])
        chunks = [ct.unpack_chunk(r, h)[0] for r in records[1:]]
        blocks = sum(c.n_blocks for c in chunks)
        # rANS words + final states + raw sections hold the exact code length, up to the
        # states' unused bits (each lane starts at 2^16 and ends below 2^32) and the byte
        # padding of the raw sections (4 per chunk)
        coded = 16 * sum(c.words.size for c in chunks) + 32 * sum(c.states.size for c in chunks)
        coded += 8 * sum(len(c.bits) for c in chunks)
        assert total * n <= coded + 32 * blocks, name
        assert coded - total * n <= 32 * 32 * blocks + 4 * 8 * len(chunks), name
        assert overhead > 0


def test_report_renders_every_row(results):
    import argparse

    from results_report import render

    kvt = (1.0, 2.0, 1.5)
    rows = [{"rung": r, "predictor_cost": 1.0, "fp8_copy_cost": 1.0, "nominal_cost": 0.5,
             **{f"{t}/{d}/{m}": kvt for t in ("tinyshakespeare", "wikitext-held-out") for d in ("bf16", "fp8")
                for m in results.VARIANTS},
             **{f"tinyshakespeare/{d}/coded": 1.6 for d in ("bf16", "fp8")}} for r in ("fp8", "hybrid:4")]
    md = render(rows, "## Coder speed\n(coder_bench.py's section)",
                argparse.Namespace(tokens=2048), results.IDEA_RUNGS, results.VARIANTS)
    rows_of = [line.split(" | ")[0] for line in md.splitlines() if line.startswith("| ")]
    assert rows_of.count("| fp8") == 1 + 8 and rows_of.count("| hybrid:4") == 1 + 8
    assert "## Coder speed\n(coder_bench.py's section)" in md and np.isfinite(kvt).all()
