"""Coder speed: ``speckv bench`` for each CPU coder, thread count and dtype, against
zstd-3 in the same runs; writes the "Coder speed" section of benchmarks/RESULTS.md.

Usage: .venv/bin/python benchmarks/coder_bench.py [--tokens 2048] [--json out.json]
                                                  [--update benchmarks/RESULTS.md]

Rows: the native extension with 1 and 2 threads and the numpy reference (2 threads),
BF16 and FP8 KV of 2048 tokens of Tiny Shakespeare, the shipped checkpoint. Every row
is one ``run_bench`` (its own prefill; coder alone timed, mu given, best of 2); the
zstd-3 figures are that run's, on the same raw bytes. The rows run minutes apart, so
their 2-thread / 1-thread ratio carries this shared machine's drift; the scaling line
under the table times 1 and 2 threads alternately on the same KV and mu instead
(``--scaling-runs`` pairs, medians), with zstd-3 compressing two halves of the same KV
on 1 and 2 threads in the same pairs: how far plain compute scales on this machine in
that run. GPU figures come from ``benchmarks/gpu_check.py`` on a CUDA machine.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from speckv.cli.bench import run_bench

ROWS = (("native", 1), ("native", 2), ("numpy", 2))
BEGIN, END = "<!-- coder-speed: begin -->", "<!-- coder-speed: end -->"


def measure(tokens: int, text: str | None) -> list[dict[str, Any]]:
    out = []
    for dtype in ("bf16", "fp8"):
        for coder, threads in ROWS:
            r = run_bench(text, tokens, dtype, quiet=True, coder=coder, threads=threads, timing_runs=1, memory=False)
            assert r["coder"] == coder and r["threads"] == threads and r["lossless"], r
            zstd = next(p for p in r["peers"] if p["name"] == "zstd-3")
            out.append({k: r[k] for k in ("dtype", "coder", "threads", "tokens", "raw_bytes", "coded_bytes",
                                          "bits_per_scalar", "encode_mb_s", "decode_mb_s", "encode_s",
                                          "decode_s", "digest_s", "vs_zstd3")}
                       | {"zstd3_encode_mb_s": zstd["encode_mb_s"], "zstd3_decode_mb_s": zstd["decode_mb_s"]})
    return out


def alternating(tokens: int, text: str | None, runs: int) -> dict[str, dict[str, float]]:
    """Per dtype, the native coder's median encode and decode seconds with 1 and 2 threads,
    timed alternately (1, 2, 1, 2, ...) on one KV and mu, each decode checked bit for bit; and
    the process's CPU seconds of the same calls (``*_cpu_*``: every thread's, Python's included)."""
    import statistics

    import numpy as np

    from speckv.cli.bench import load_text
    from speckv.coder.codec import Codec, CodecConfig, Fp8KV, bf16_bits
    from speckv.predictor.fp8 import kv_to_fp8
    from speckv.predictor.session import Session

    sess = Session.open()
    ids = sess.target.tokenize(load_text(text)[0], tokens)
    pre = sess.prefill(ids)
    q, scale = kv_to_fp8(pre.kv)
    kvs = {"bf16": pre.kv, "fp8": Fp8KV(q.numpy(), scale.numpy())}
    codecs = {t: Codec.from_predictor(sess.predictor, CodecConfig(coder="native", threads=t)) for t in (1, 2)}
    out: dict[str, dict[str, float]] = {}
    for dtype, kv in kvs.items():
        want = kv.codes if isinstance(kv, Fp8KV) else bf16_bits(kv)
        times: dict[str, list[float]] = {f"{w}_{t}": [] for w in ("encode", "decode", "zstd", "encode_cpu",
                                                                  "decode_cpu") for t in (1, 2)}
        for _ in range(runs):
            for t in (1, 2):
                times[f"zstd_{t}"].append(zstd_halves(want.tobytes(), t))
            for t, codec in codecs.items():
                c0, t0 = time.process_time(), time.perf_counter()
                records = list(codec.encode(kv, ids, pre.mu))
                c1, t1 = time.process_time(), time.perf_counter()
                back = codec.decode(records, ids, pre.mu)
                times[f"encode_{t}"].append(t1 - t0)
                times[f"decode_{t}"].append(time.perf_counter() - t1)
                times[f"encode_cpu_{t}"].append(c1 - c0)
                times[f"decode_cpu_{t}"].append(time.process_time() - c1)
                assert np.array_equal(back.codes if isinstance(back, Fp8KV) else back, want)
        out[dtype] = {k: statistics.median(v) for k, v in times.items()}
    return out


def zstd_halves(raw: bytes, threads: int) -> float:
    """Seconds for zstd-3 to compress both halves of ``raw``, one after the other (1 thread) or
    at once (2 threads: zstandard releases the GIL): the peer that shows how far two threads of
    plain compute scale on this machine in the same run, beside the coder's own ratio."""
    import zstandard

    halves = [raw[:len(raw) // 2], raw[len(raw) // 2:]]
    c = [zstandard.ZstdCompressor(level=3) for _ in halves]  # NOTE: a compressor per thread
    with ThreadPoolExecutor(threads) as pool:  # NOTE: started outside the timer
        list(pool.map(lambda _: None, range(threads)))
        t0 = time.perf_counter()
        list(pool.map(lambda a: a[0].compress(a[1]), zip(c, halves, strict=True)))
        return time.perf_counter() - t0


def section(rows: list[dict[str, Any]], tokens: int, alt: dict[str, dict[str, float]] | None = None,
            runs: int = 0) -> str:
    """The markdown section, between markers so that a rerun replaces it."""
    lines = [BEGIN, "## Coder speed", "",
             f"Generated by `.venv/bin/python benchmarks/coder_bench.py --update benchmarks/RESULTS.md` on "
             f"{time.strftime('%Y-%m-%d')}: `speckv bench` ({tokens} tokens of Tiny Shakespeare, shipped "
             "checkpoint, coder alone with mu given, best of 2) once per row, on this 2-core CPU; zstd-3 on the "
             "same raw bytes in the same run. MB/s of raw KV (BF16: 2 bytes, FP8: 1 byte per scalar). digest s: "
             "the format's two xxh3-128 digests (raw KV, mu) on one thread, which every encode and every "
             "decode computes.", "",
             "| dtype | coder | threads | coded bytes | encode MB/s | decode MB/s | x zstd-3 encode | "
             "x zstd-3 decode | zstd-3 MB/s (enc / dec) | digest s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['coder']} | {r['threads']} | {r['coded_bytes']} | "
                     f"{r['encode_mb_s']:.1f} | {r['decode_mb_s']:.1f} | {r['vs_zstd3']['encode']:.3f} | "
                     f"{r['vs_zstd3']['decode']:.3f} | {r['zstd3_encode_mb_s']:.0f} / "
                     f"{r['zstd3_decode_mb_s']:.0f} | {r['digest_s']:.3f} |")
    lines += ["", *scaling(rows)]
    for dtype, m in (alt or {}).items():
        lines += [f"{dtype}, 1 and 2 threads alternately on the same KV ({runs} pairs, medians): 2 threads / "
                  f"1 thread = {m['encode_1'] / m['encode_2']:.2f}x encode ({m['encode_1']:.3f} s / "
                  f"{m['encode_2']:.3f} s), {m['decode_1'] / m['decode_2']:.2f}x decode ({m['decode_1']:.3f} s / "
                  f"{m['decode_2']:.3f} s)" + (f"; zstd-3 on two halves of the same KV, the same pairs: "
                                                f"{m['zstd_1'] / m['zstd_2']:.2f}x" if "zstd_1" in m else "")
                  + ".", *cpu_line(m), ""]
    lines.append(END)
    return "\n".join(lines)


def cpu_line(m: dict[str, float]) -> list[str]:
    """Where a 2-thread shortfall comes from: the share of 2 cores the 2-thread calls kept busy (idle
    threads: serial work or imbalance in the coder), and their CPU seconds against the 1-thread calls'
    (above 1: the same work cost more, the cores slowed each other or the machine was shared)."""
    if "encode_cpu_1" not in m:
        return []
    busy = {w: m[f"{w}_cpu_2"] / (2 * m[f"{w}_2"]) for w in ("encode", "decode")}
    cost = {w: m[f"{w}_cpu_2"] / m[f"{w}_cpu_1"] for w in ("encode", "decode")}
    return ["", f"The 2-thread calls kept {100 * busy['encode']:.0f}% (encode) and {100 * busy['decode']:.0f}% "
                f"(decode) of 2 cores busy, at {cost['encode']:.2f}x and {cost['decode']:.2f}x the 1-thread calls' "
                "CPU seconds."]


def scaling(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for dtype in ("bf16", "fp8"):
        one, two = (next(r for r in rows if (r["dtype"], r["coder"], r["threads"]) == (dtype, "native", t))
                    for t in (1, 2))
        ref = next(r for r in rows if (r["dtype"], r["coder"]) == (dtype, "numpy"))
        out.append(f"{dtype}: 2 threads / 1 thread = {two['encode_mb_s'] / one['encode_mb_s']:.2f}x encode, "
                   f"{two['decode_mb_s'] / one['decode_mb_s']:.2f}x decode; native / numpy = "
                   f"{two['encode_mb_s'] / ref['encode_mb_s']:.1f}x encode, "
                   f"{two['decode_mb_s'] / ref['decode_mb_s']:.1f}x decode; coded bytes "
                   f"{'identical' if two['coded_bytes'] == ref['coded_bytes'] else 'DIFFER'} "
                   f"({two['coded_bytes']} native, {ref['coded_bytes']} numpy).")
        out.append("")
    return out


def update(path: Path, text: str) -> None:
    """Replace the marked section of ``path`` (or append it)."""
    old = path.read_text() if path.exists() else ""
    pat = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    path.write_text(pat.sub(lambda _: text, old) if pat.search(old) else old.rstrip("\n") + "\n\n" + text + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text", default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--update", type=Path, default=None, help="replace the coder-speed section of this file")
    ap.add_argument("--scaling-runs", type=int, default=7, help="alternating 1/2-thread pairs (0: none)")
    args = ap.parse_args(argv)
    rows = measure(args.tokens, args.text)
    alt = alternating(args.tokens, args.text, args.scaling_runs) if args.scaling_runs > 0 else None
    text = section(rows, args.tokens, alt, args.scaling_runs)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.update:
        update(args.update, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
