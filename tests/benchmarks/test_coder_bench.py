"""benchmarks/coder_bench.py's report: its table, ratios and the section it replaces
in RESULTS.md (the measurements themselves are ``speckv bench``'s, tested in
tests/cli/test_bench.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cb(load_script):
    return load_script("coder_bench")


def _row(dtype, coder, threads, enc, dec, coded=1000):
    return {"dtype": dtype, "coder": coder, "threads": threads, "tokens": 8, "raw_bytes": 4000, "coded_bytes": coded,
            "bits_per_scalar": 4.0, "encode_mb_s": enc, "decode_mb_s": dec, "encode_s": 1.0, "decode_s": 1.0,
            "digest_s": 0.01, "vs_zstd3": {"encode": enc / 600, "decode": dec / 800},
            "zstd3_encode_mb_s": 600.0, "zstd3_decode_mb_s": 800.0}


def test_section_scaling_and_update(cb, tmp_path):
    rows = [_row(d, c, t, e, e / 2, 1000 if d == "bf16" else 500) for d in ("bf16", "fp8")
            for c, t, e in (("native", 1, 100.0), ("native", 2, 180.0), ("numpy", 2, 30.0))]
    text = cb.section(rows, 8)
    assert text.startswith(cb.BEGIN) and text.endswith(cb.END)
    assert "| bf16 | native | 2 | 1000 | 180.0 | 90.0 | 0.300 | 0.113 | 600 / 800 | 0.010 |" in text
    assert "bf16: 2 threads / 1 thread = 1.80x encode, 1.80x decode; native / numpy = 6.0x encode" in text
    assert "coded bytes identical (1000 native, 1000 numpy)" in text
    alt = {"bf16": {"encode_1": 0.2, "encode_2": 0.11, "decode_1": 0.3, "decode_2": 0.2}}
    assert ("bf16, 1 and 2 threads alternately on the same KV (5 pairs, medians): 2 threads / 1 thread = "
            "1.82x encode (0.200 s / 0.110 s), 1.50x decode (0.300 s / 0.200 s).") in cb.section(rows, 8, alt, 5)
    alt["bf16"] |= {"zstd_1": 0.1, "zstd_2": 0.0625}
    assert ("1.50x decode (0.300 s / 0.200 s); zstd-3 on two halves of the same KV, the same pairs: 1.60x."
            in cb.section(rows, 8, alt, 5))
    alt["bf16"] |= {"encode_cpu_1": 0.2, "encode_cpu_2": 0.198, "decode_cpu_1": 0.3, "decode_cpu_2": 0.36}
    assert ("The 2-thread calls kept 90% (encode) and 90% (decode) of 2 cores busy, at 0.99x and 1.20x the "
            "1-thread calls' CPU seconds.") in cb.section(rows, 8, alt, 5)
    rows[2]["coded_bytes"] = 999
    assert "coded bytes DIFFER" in cb.section(rows, 8)
    path = tmp_path / "RESULTS.md"
    path.write_text("# head\n\n" + cb.BEGIN + "\nold\n" + cb.END + "\n\n## tail\n")
    cb.update(path, text)
    new = path.read_text()
    assert new.startswith("# head\n\n" + text) and new.endswith("\n\n## tail\n") and "old" not in new
    fresh = tmp_path / "fresh.md"
    cb.update(fresh, text)
    assert fresh.read_text() == "\n\n" + text + "\n"


def test_zstd_halves_times_both_thread_counts(cb):
    raw = bytes(range(256)) * 4096
    assert all(cb.zstd_halves(raw, t) > 0 for t in (1, 2))
