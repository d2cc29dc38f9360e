"""Transfer benchmark over loopback: raw (stored) vs coded (speckv) streams.

Starts a decoder and an encoder sidecar as separate ``speckv serve``
processes on loopback, prefills a real KV with the embedded model, and for
each encoding submits it ``--repeats`` times while a FetchKV client pulls it
back layer by layer, checking every delivery bit for bit. Prints, per
encoding: bytes on the wire, ratio, end-to-end time (Submit start to last
layer fetched), effective raw throughput, the decoder's time to first layer
(Submit start to the first layer arriving at the fetching engine), and the
time the same wire bytes would need on 10/100 Gb/s links.

Usage: .venv/bin/python benchmarks/transfer_bench.py [--tokens 2048] [--repeats 3] [--json]
NOTE: on this 2-core machine all three processes share the CPU, and loopback
moves GB/s, so the stored stream wins here; speckv pays where the link, not
the coder, is the bottleneck (see the link columns).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from speckv.client.client import DecoderClient, EncoderClient
from speckv.coder.codec import bf16_bits

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "corpus" / "tinyshakespeare.txt"


# NOTE: mu cache off: every repeat of the one prompt runs both predictors
ENV = {"SPECKV_MAX_INFLIGHT_BYTES": "1Gi", "SPECKV_MU_CACHE_BYTES": "0"}


def start(role: str, env: dict[str, str] | None = None, core: int | None = None) -> tuple[subprocess.Popen, int]:
    """A ``speckv serve`` sidecar on loopback (``env``: its settings, default ENV; ``core``:
    pinned to that CPU, every thread) and its port."""
    proc = subprocess.Popen([sys.executable, "-m", "speckv.cli.main", "serve", role, "--listen", "127.0.0.1:0",
                             "--metrics-port", "-1"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(ENV if env is None else env)},
                            preexec_fn=None if core is None else lambda: os.sched_setaffinity(0, {core}))
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"listening on port (\d+)", line)
        if m:
            return proc, int(m.group(1))
    raise RuntimeError(f"{role} sidecar exited with {proc.wait()}")


def one(enc: EncoderClient, dec_addr: str, kv, ids, rid: str, encoding: str, model_id: str) -> dict:
    times: dict[str, float] = {}
    want = bf16_bits(kv)

    def fetch(t0: float) -> bool:
        with DecoderClient(dec_addr, timeout=600) as dec:
            ok = True
            for layer, arr, _ in dec.fetch_layers(rid, wait=600):
                times.setdefault("first", time.perf_counter() - t0)
                ok &= bool(np.array_equal(arr, want[layer]))
            times["last"] = time.perf_counter() - t0
            return ok

    with ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        fut = pool.submit(fetch, t0)
        res = enc.submit(rid, kv, ids, dec_addr, model_id, encoding=encoding)
        ok = fut.result(timeout=600)
    return {"ok": ok, "wire": res.wire_bytes, "raw": res.raw_bytes, "first": times["first"],
            "total": times["last"], "encode_s": res.encode_seconds, "predictor_s": res.predictor_seconds}


def summarize(runs: list[dict]) -> dict:
    raw, wire = runs[0]["raw"], runs[0]["wire"]
    total = statistics.median(r["total"] for r in runs)
    return {"lossless": all(r["ok"] for r in runs), "raw_bytes": raw, "wire_bytes": wire,
            "ratio": raw / wire, "total_s": total, "raw_MBps": raw / total / 1e6,
            "first_layer_s": statistics.median(r["first"] for r in runs),
            "encoder_predictor_s": statistics.median(r["predictor_s"] for r in runs),
            "encode_s": statistics.median(r["encode_s"] for r in runs),
            "link_10Gbps_s": 8 * wire / 10e9, "link_100Gbps_s": 8 * wire / 100e9, "repeats": len(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from speckv.predictor.calibrate import read_text
    from speckv.predictor.target import load_target

    target = load_target()
    ids = target.tokenize(read_text(args.text, chars=args.tokens * 32), args.tokens)
    kv = target.kv(ids)
    procs = [start("decoder"), start("encoder")]
    try:
        (_, dport), (_, eport) = procs
        dec_addr = f"127.0.0.1:{dport}"
        report = {"tokens": int(len(ids)), "transport": "grpc-loopback, separate processes"}
        with EncoderClient(f"127.0.0.1:{eport}", timeout=600) as enc:
            for encoding in ("stored", "speckv"):
                one(enc, dec_addr, kv, ids, f"warm-{encoding}", encoding, target.name)  # warm-up
                runs = [one(enc, dec_addr, kv, ids, f"{encoding}-{k}", encoding, target.name)
                        for k in range(args.repeats)]
                report[encoding] = summarize(runs)
    finally:
        for p, _ in procs:
            p.terminate()
            p.wait(timeout=30)
    if args.json:
        print(json.dumps(report))
        return
    print(f"transfer over {report['transport']}: {report['tokens']} tokens, "
          f"{report['stored']['raw_bytes'] / 1e6:.1f} MB raw BF16 KV, median of {args.repeats}")
    cols = ("encoding", "lossless", "wire MB", "ratio", "end-to-end s", "raw MB/s", "first layer s",
            "predictor s", "encode s", "10 Gb/s link s", "100 Gb/s link s")
    print(" | ".join(cols))
    for enc in ("stored", "speckv"):
        r = report[enc]
        print(" | ".join([enc, str(r["lossless"]), f"{r['wire_bytes'] / 1e6:.2f}", f"{r['ratio']:.3f}",
                          f"{r['total_s']:.3f}", f"{r['raw_MBps']:.1f}", f"{r['first_layer_s']:.3f}",
                          f"{r['encoder_predictor_s']:.2f}", f"{r['encode_s']:.2f}", f"{r['link_10Gbps_s']:.4f}",
                          f"{r['link_100Gbps_s']:.5f}"]))


if __name__ == "__main__":
    main()
