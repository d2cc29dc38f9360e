"""Load test: N concurrent engines moving real KV caches through two sidecar processes.

Starts a decoder and an encoder as separate ``speckv serve`` processes on loopback
(so each one's resident memory, and its kernel-recorded peak VmHWM, can be read from /proc), prefills a
few real KV caches of 32-128 tokens with the embedded model in this process, then
runs ``--clients`` threads for ``--seconds``. Each thread has its own EncoderClient
and DecoderClient and loops: pick a prompt, submit it under a unique request id
while a FetchKV for the same id runs concurrently, compare the fetched KV with
the submitted one bit for bit, record the latency (Submit start to the last layer
fetched and verified). ``--stored-fraction`` of the transfers use encoding="stored".

Reports transfers completed, transfers/s, p50/p99 latency (per encoding), raw
throughput, peak RSS per sidecar (against the target's BF16 weights, and beside the runtime floor:
the peak of a process that only imports what a sidecar runs on), lost transfers (Submit OK but the fetch failed),
corrupt ones (fetched, not bit-equal), errors by gRPC code, and the sidecars'
health, in-flight bytes and transfers after the run. Exit status 1 if anything was
lost or corrupt, or a sidecar is unhealthy afterwards.

Usage::

    .venv/bin/python benchmarks/load.py [--clients 8] [--seconds 60] [--stored-fraction 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from speckv.server.memory import peak_rss_bytes, rss_bytes, runtime_floor_bytes

MODEL = "SmolLM2-135M-Instruct"
CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus" / "tinyshakespeare.txt"
FALLBACK_TEXT = (
    "Lossless compression of the key-value cache needs the same predictor on both sides, and every bit the "
    "coder spends is the mismatch between the model and the data. Bridges hum in the wind because every span "
    "has a note of its own, and the river below keeps time. ") * 8


class Sidecar:
    """One ``speckv serve`` process: its gRPC and metrics ports, a drained stdout, a log
    file for stderr, and an RSS sampler (peak VmRSS)."""

    def __init__(self, role: str, env: dict[str, str], logdir: str, cpus: str | None = None) -> None:
        self.role = role
        self.log = open(os.path.join(logdir, f"{role}.log"), "w")
        pin = ["taskset", "-c", cpus] if cpus else []  # cpus: the process's CPU list (an emulated node)
        self.proc = subprocess.Popen(
            pin + [sys.executable, "-m", "speckv.cli.main", "serve", role, "--listen", "127.0.0.1:0",
                   "--metrics-port", "0"],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.port = self.metrics_port = None
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            m = re.search(r"listening on port (\d+)", line)
            if m:
                self.port = int(m.group(1))
                mm = re.search(r"metrics on port (\d+)", line)
                self.metrics_port = int(mm.group(1)) if mm else None
                break
        if self.port is None:
            raise RuntimeError(f"{role} sidecar exited with {self.proc.wait()} (see {self.log.name})")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def rss(self) -> int:
        """VmRSS in bytes (0 once the process is gone)."""
        return rss_bytes(self.proc.pid)

    def rss_peak(self) -> int:
        """The kernel's high-water mark VmHWM in bytes: the true peak, not a sample."""
        return peak_rss_bytes(self.proc.pid)

    def metric(self, name: str) -> float | None:
        """Sum of a Prometheus metric's samples from /metrics."""
        if not self.metrics_port:
            return None
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(name + "{") or line.startswith(name + " ")]
        return sum(vals) if vals else None

    def health(self) -> str:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address) as ch:
            try:
                st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                return health_pb2.HealthCheckResponse.ServingStatus.Name(st)
            except grpc.RpcError as e:
                return f"error {e.code().name}"

    def stop(self) -> int:
        self.proc.terminate()
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(10)
        self.log.close()
        return rc


def prompts(lengths: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, BF16 KV bit patterns) of real prompts of the given token counts."""
    from speckv.coder.codec import bf16_bits
    from speckv.predictor.target import load_target

    target = load_target()
    text = CORPUS.read_text(encoding="utf-8")[:200_000] if CORPUS.is_file() else FALLBACK_TEXT
    ids_all = target.tokenize(text[:20_000])
    out = []
    for k, n in enumerate(lengths):
        start = (k * 997) % max(1, len(ids_all) - n)
        ids = np.asarray(ids_all[start:start + n], np.int64)
        out.append((ids, bf16_bits(target.kv(ids)).copy()))
    return out


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.submit_latency: dict[str, list[float]] = defaultdict(list)
        self.completed: Counter = Counter()
        self.raw_bytes: Counter = Counter()
        self.wire_bytes: Counter = Counter()
        self.lost = 0
        self.corrupt = 0
        self.errors: Counter = Counter()
        self.examples: list[str] = []
        self.fallbacks = 0

    def note(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what)


def client_loop(k: int, eaddr: str, daddr: str, data, stop_at: float, stored_fraction: float, stats: Stats,
                seed: int) -> None:
    from speckv.client.client import DecoderClient, EncoderClient, RpcFailed

    rng = random.Random(f"{seed}:{k}")
    enc, dec = EncoderClient(eaddr, timeout=300), DecoderClient(daddr, timeout=300)
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"fetch-{k}")
    n = 0
    try:
        while time.monotonic() < stop_at:
            ids, bits = data[rng.randrange(len(data))]
            encoding = "stored" if rng.random() < stored_fraction else "speckv"
            rid = f"load-{seed}-{k}-{n}"
            n += 1
            t0 = time.perf_counter()
            fut = pool.submit(dec.fetch, rid, 30, 300)
            try:
                res = enc.submit(rid, bits, ids, daddr, MODEL, encoding=encoding, timeout=300)
                t_sub = time.perf_counter() - t0
            except RpcFailed as e:
                with stats.lock:
                    stats.errors[f"submit {e.code.name}"] += 1
                    stats.note(f"{rid}: submit {e}")
                try:  # end the fetch (it waits for a retry otherwise)
                    dec.cancel(rid, timeout=10)
                except RpcFailed:
                    pass
                try:
                    fut.result(timeout=120)
                    with stats.lock:
                        stats.errors["fetched although submit failed"] += 1
                except Exception:  # noqa: BLE001 -- a failed submit must not be fetchable; any error is fine
                    pass
                continue
            try:
                got = fut.result(timeout=300)
            except Exception as e:  # noqa: BLE001 -- RpcFailed or a timeout: either way it is lost
                with stats.lock:
                    stats.lost += 1
                    stats.errors[f"fetch {getattr(getattr(e, 'code', None), 'name', type(e).__name__)}"] += 1
                    stats.note(f"{rid}: submit OK, fetch failed: {e}")
                continue
            el = time.perf_counter() - t0
            ok = isinstance(got, np.ndarray) and got.dtype == np.uint16 and np.array_equal(got, bits)
            with stats.lock:
                if not ok:
                    stats.corrupt += 1
                    stats.note(f"{rid}: fetched KV differs from the submitted one")
                    continue
                stats.completed[encoding] += 1
                stats.latency[encoding].append(el)
                stats.submit_latency[encoding].append(t_sub)
                stats.raw_bytes[encoding] += res.raw_bytes
                stats.wire_bytes[encoding] += res.wire_bytes
                stats.fallbacks += int(getattr(res, "fallback", False) or False)
    finally:
        pool.shutdown(wait=True)
        enc.close()
        dec.close()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--stored-fraction", type=float, default=0.0, help="share of transfers with encoding=stored")
    ap.add_argument("--tokens", default="32,64,96,128", help="prompt lengths (one real KV each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def start_sidecars(logdir: str) -> tuple[Sidecar, Sidecar]:
    env = {**os.environ, "SPECKV_MAX_INFLIGHT_BYTES": os.environ.get("SPECKV_MAX_INFLIGHT_BYTES", "1Gi")}
    with ThreadPoolExecutor(2) as ex:  # both sidecars load their predictor at once
        fd, fe = ex.submit(Sidecar, "decoder", env, logdir), ex.submit(Sidecar, "encoder", env, logdir)
        return fd.result(), fe.result()


def run_clients(args: argparse.Namespace, enc: Sidecar, dec: Sidecar, data, stats: Stats) -> tuple[float, int]:
    """Run the client threads for ``args.seconds``; returns (wall seconds, threads still hung)."""
    t0 = time.monotonic()
    stop_at = t0 + args.seconds
    threads = [threading.Thread(target=client_loop, args=(k, enc.address, dec.address, data, stop_at,
                                                          args.stored_fraction, stats, args.seed), daemon=True)
               for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.seconds + 600)
    return time.monotonic() - t0, sum(t.is_alive() for t in threads)


def sidecar_state(s: Sidecar) -> dict[str, Any]:
    """Health and the in-flight gauges and counters of a sidecar after the run."""
    return {"health": s.health(), "inflight_bytes": s.metric("speckv_inflight_bytes"),
            "inflight_transfers": s.metric("speckv_inflight_transfers"),
            "transfers_total": s.metric("speckv_transfers_total"),
            "integrity_failures_total": s.metric("speckv_integrity_failures_total")}


def stop_and_read_log(s: Sidecar, logdir: str) -> dict[str, int]:
    rc = s.stop()
    with open(os.path.join(logdir, f"{s.role}.log")) as f:
        lines = f.read().splitlines()
    return {"exit": rc, "error_lines": sum(1 for line in lines
                                           if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line)}


def memory_context(rss: dict[str, Any]) -> dict[str, Any]:
    """The target's BF16 weight size, the runtime floor, and each sidecar's peak against them."""
    from speckv.predictor.weights import target_weights

    weights = target_weights()
    w = weights.bf16_bytes if weights is not None else 0
    floor = runtime_floor_bytes()
    out: dict[str, Any] = {"target_bf16_mib": round(w / 2**20), "runtime_floor_mib": round(floor / 2**20)}
    for role in ("decoder", "encoder"):
        peak = rss[role]["peak_mib"] * 2**20
        rss[role]["peak_x_weights"] = round(peak / w, 2) if w else None
        rss[role]["above_floor_x_weights"] = round((peak - floor) / w, 2) if w else None
    return out


def build_report(args, lengths, stats: Stats, wall: float, hung: int, rss, after, logs, logdir) -> dict[str, Any]:
    total = sum(stats.completed.values())
    lat_all = [x for v in stats.latency.values() for x in v]
    by_encoding = {e: {"completed": stats.completed[e], "p50_s": round(pct(stats.latency[e], 50), 3),
                       "p99_s": round(pct(stats.latency[e], 99), 3),
                       "submit_p50_s": round(pct(stats.submit_latency[e], 50), 3),
                       "raw_mib_per_s": round(stats.raw_bytes[e] / wall / 2**20, 2),
                       "ratio": round(stats.raw_bytes[e] / stats.wire_bytes[e], 3) if stats.wire_bytes[e] else None}
                   for e in sorted(stats.completed)}
    return {"clients": args.clients, "seconds": round(wall, 1), "stored_fraction": args.stored_fraction,
            "prompt_tokens": lengths, "completed": total, "transfers_per_s": round(total / wall, 2),
            "p50_s": round(pct(lat_all, 50), 3), "p99_s": round(pct(lat_all, 99), 3), "by_encoding": by_encoding,
            "lost": stats.lost, "corrupt": stats.corrupt, "errors": dict(stats.errors), "hung_clients": hung,
            "fallbacks": stats.fallbacks, "rss": rss, "after": after, "sidecar_logs": logs,
            "examples": stats.examples, "logs": logdir}


def print_report(r: dict[str, Any]) -> None:
    print("| clients | seconds | completed | transfers/s | p50 (s) | p99 (s) | lost | corrupt | errors |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    print(f"| {r['clients']} | {r['seconds']:.0f} | {r['completed']} | {r['transfers_per_s']:.2f} | "
          f"{r['p50_s']:.3f} | {r['p99_s']:.3f} | {r['lost']} | {r['corrupt']} | {r['errors'] or 0} |")
    print()
    print("| encoding | completed | p50 (s) | p99 (s) | Submit p50 (s) | raw MiB/s | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for e, x in r["by_encoding"].items():
        print(f"| {e} | {x['completed']} | {x['p50_s']:.3f} | {x['p99_s']:.3f} | {x['submit_p50_s']:.3f} | "
              f"{x['raw_mib_per_s']} | {x['ratio']} |")
    print()
    print("| sidecar | RSS idle (MiB) | RSS peak (MiB) | RSS end (MiB) | peak / weights | (peak - floor) / weights "
          "| health after | in-flight bytes after | in-flight transfers after | error lines in log |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for role in ("decoder", "encoder"):
        a, m = r["after"][role], r["rss"][role]
        print(f"| {role} | {m['idle_mib']} | {m['peak_mib']} | {m['end_mib']} | {m['peak_x_weights']} | "
              f"{m['above_floor_x_weights']} | {a['health']} | {a['inflight_bytes']} | {a['inflight_transfers']} | "
              f"{r['sidecar_logs'][role]['error_lines']} |")
    print(f"target BF16 weights {r['rss']['target_bf16_mib']} MiB; runtime floor (a process importing what a "
          f"sidecar runs on) {r['rss']['runtime_floor_mib']} MiB")
    for ex in r["examples"]:
        print("example:", ex)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_setup = time.perf_counter()
    logdir = tempfile.mkdtemp(prefix="speckv-load-")
    dec, enc = start_sidecars(logdir)
    lengths = [int(t) for t in args.tokens.split(",")]
    data = prompts(lengths)
    idle = {"decoder": dec.rss(), "encoder": enc.rss()}
    print(f"setup {time.perf_counter() - t_setup:.0f} s; sidecars {dec.address} / {enc.address}; logs in {logdir}",
          file=sys.stderr, flush=True)
    stats = Stats()
    wall, hung = run_clients(args, enc, dec, data, stats)
    time.sleep(1.0)  # then: health, and every buffer given back
    after = {s.role: sidecar_state(s) for s in (dec, enc)}
    rss: dict[str, Any] = {s.role: {"idle_mib": round(idle[s.role] / 2**20), "peak_mib": round(s.rss_peak() / 2**20),
                                    "end_mib": round(s.rss() / 2**20)} for s in (dec, enc)}
    rss.update(memory_context(rss))
    logs = {s.role: stop_and_read_log(s, logdir) for s in (dec, enc)}
    report = build_report(args, lengths, stats, wall, hung, rss, after, logs, logdir)
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    bad = stats.lost or stats.corrupt or hung or any(a["health"] != "SERVING" or a["inflight_bytes"]
                                                     for a in after.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
