"""Where a whole-stream encode leaves a core idle: ``perf sched record`` of N encodes, each
CPU's idle intervals set against what the codec's threads were doing (README "Measured
figures", session 34; coder/kernels/spk_pool.h, "Held cores").

The child process encodes 2048 tokens of Tiny Shakespeare (the shipped checkpoint, native coder,
mu given) ``--runs`` times, logging on CLOCK_MONOTONIC when each rANS pass, each prepare step
(the lookahead helper) and each chunk's record and pack ran; perf logs every context switch on
the same clock. Printed: per encode its wall time, the core time idle, and how much of that
fell inside rANS passes (and in pieces over 0.1 ms: a core idle while the other queued two
threads); then the idle time by what the main thread was doing.

``--no-hold`` runs the codec with its helper holding no core (the behaviour before session 34).
Needs root and ``perf`` (linux-tools). Usage:
  .venv/bin/python benchmarks/research/idle_cores.py [--runs 20] [--dtype bf16|fp8] [--no-hold]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PIECE_S = 1e-4  # an idle piece this long inside a pass is a queued thread, not a pass's tail


def child(args: argparse.Namespace, out: Path) -> None:
    from speckv.cli.bench import load_text
    from speckv.coder import container as ct
    from speckv.coder.codec import Codec, CodecConfig, Fp8KV
    from speckv.predictor.fp8 import kv_to_fp8
    from speckv.predictor.session import Session

    sess = Session.open()
    ids = sess.target.tokenize(load_text(None)[0], args.tokens)
    pre = sess.prefill(ids)
    kv = pre.kv
    if args.dtype == "fp8":
        q, scale = kv_to_fp8(pre.kv)
        kv = Fp8KV(q.numpy(), scale.numpy())
    codec = Codec.from_predictor(sess.predictor, CodecConfig(coder="native", threads=2))
    if args.no_hold:
        helper = codec._helper_backend  # noqa: SLF001 -- the experiment's one switch
        codec._helper_backend = lambda: helper()[:2] + (None,)  # type: ignore[method-assign]  # noqa: SLF001
    events: list[tuple[str, int, float, float]] = []

    def logged(owner: object, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a: object, **k: object) -> object:
            t0 = time.monotonic()
            try:
                return fn(*a, **k)
            finally:
                events.append((label, threading.get_native_id(), t0, time.monotonic()))
        setattr(owner, name, wrapper)

    logged(Codec, "_prepare", "prepare")
    logged(type(codec.backend), "encode", "rans")
    logged(Codec, "_chunk_record", "record")
    logged(ct, "pack_chunk", "pack")
    want = list(codec.encode(kv, ids, pre.mu))
    events.clear()
    runs = []
    for _ in range(args.runs):
        t0 = time.monotonic()
        assert list(codec.encode(kv, ids, pre.mu)) == want  # the same bytes every run
        runs.append((t0, time.monotonic()))
    out.write_text(json.dumps({"events": events, "runs": runs, "main": threading.get_native_id()}))


def idle_intervals(data: Path) -> list[tuple[float, float]]:
    """Every CPU's idle (swapper) intervals, on CLOCK_MONOTONIC."""
    text = subprocess.run(["perf", "script", "-i", str(data), "-F", "cpu,time,event,trace"],
                          capture_output=True, text=True, check=True).stdout
    since: dict[int, float] = {}
    idle = []
    for line in text.splitlines():
        m = re.match(r"\s*\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch:\s+(.*)", line)
        if not m:
            continue
        cpu, t, trace = int(m[1]), float(m[2]), m[3]
        if re.search(r"next_pid=0\b", trace):
            since[cpu] = t
        elif re.search(r"prev_pid=0\b", trace) and cpu in since:
            idle.append((since.pop(cpu), t))
    return idle


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def report(log: dict, idle: list[tuple[float, float]]) -> None:
    passes = [(a, b) for label, _, a, b in log["events"] if label == "rans"]
    main = sorted((e for e in log["events"] if e[1] == log["main"]), key=lambda e: e[2])
    by_state: collections.Counter[str] = collections.Counter()
    walls = []
    for k, run in enumerate(log["runs"]):
        spans = [(max(x, run[0]), min(y, run[1])) for x, y in idle if overlap((x, y), run) > 0]
        inside = [overlap(s, p) for s in spans for p in passes]
        walls.append(run[1] - run[0])
        print(f"encode {k:2d}: wall {walls[-1] * 1e3:6.1f} ms, idle {sum(b - a for a, b in spans) * 1e3:5.1f} "
              f"core-ms, in rANS passes {sum(inside) * 1e3:5.1f} (pieces over 0.1 ms: "
              f"{sum(x for x in inside if x > PIECE_S) * 1e3:5.1f})")
        for a, b in spans:  # what the main thread was doing, 50 us at a time
            t = a
            while t < b:
                mid = min(b, t + 5e-5)
                state = next((e[0] for e in main if e[2] <= (t + mid) / 2 < e[3]), "other")
                by_state[state] += mid - t
                t = mid
    n = len(log["runs"])
    print(f"median wall {statistics.median(walls) * 1e3:.1f} ms; idle core-ms an encode by the main thread's step:")
    for state, s in by_state.most_common():
        print(f"  {state:8s} {s / n * 1e3:6.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--no-hold", action="store_true", help="the helper holds no core (before session 34)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args, args.child)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        log, data = Path(tmp) / "events.json", Path(tmp) / "sched.data"
        cmd = [sys.executable, __file__, "--child", str(log), "--runs", str(args.runs), "--tokens", str(args.tokens),
               "--dtype", args.dtype] + (["--no-hold"] if args.no_hold else [])
        subprocess.run(["perf", "sched", "record", "-k", "CLOCK_MONOTONIC", "-o", str(data), "--", *cmd],
                       check=True, capture_output=True, timeout=600)
        report(json.loads(log.read_text()), idle_intervals(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
