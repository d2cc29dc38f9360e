"""The host's share of a fused CUDA coder call, measured where no GPU is: coder/cuda.py runs on the
CPU's warp emulator (tests/cuda_emu.py), and each call's time is split into its kernels, the
device-array operations CuPy would queue (allocations, copies, cumsum: numpy here), and the rest,
which is what the host does on any machine (Python, numpy bookkeeping, the streams' host copies).
Each call runs once for real, recording what its kernels leave in small arrays (counts, statuses,
the checks' figures); the figures are of replays, whose kernels only write those back, so that the
host's caches are as a GPU leaves them (an emulated kernel walking megabytes evicts them all).
Also counted: kernel launches and waits (copies to the host, event waits), each a device round trip,
and of those the waits mid-call (a kernel launched after them: the device drains meanwhile unless
work was queued before the wait, as the encoder's rANS pass is before its wait for the bit counts).

NOTE: nothing here is a kernel's time; only the host column is a figure for the device path. Cases: gpu_check.py's
streaming (2 layers x 2048 tokens) and batched (30 layers) BF16 KV, the shipped checkpoint; prompts4: four
prompts of 512 to 3072 tokens (2 layers each), in one call each way against a call a prompt. Also reported:
the largest UNARY section of a chunk, in the serial sweeps spk_decode_sections takes over it.
Usage: python benchmarks/cuda_host_cost.py [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
import cuda_emu  # noqa: E402
import gpu_check as gc  # noqa: E402

from speckv.coder.cuda import CudaCoder, Request  # noqa: E402

WAITS = ("asnumpy", "get", "synchronize")  # calls that wait for the device
SMALL = 1 << 16  # bytes: a kernel's arrays up to this size are recorded for replays


class Meter:
    """Seconds in kernels and in device-array operations, and counts of launches and waits."""

    def __init__(self, cp: Any) -> None:
        self.s: collections.Counter = collections.Counter()
        self.n: collections.Counter = collections.Counter()
        self.keep: list = []
        self.order: list[str] = []
        self.tape: list[list] = []  # per launch of the recorded call: its small arrays after the kernel
        self.replaying = False
        for name in ("asarray", "ascontiguousarray", "empty", "zeros", "cumsum", "asnumpy"):
            setattr(cp, name, self.wrap(getattr(cp, name), "device_ops", name))
        cuda_emu._Kernel.__call__ = self.wrap(self.kernel(cuda_emu._Kernel.__call__), "kernels", "launch")
        cuda_emu.DeviceArray.get = self.wrap(cuda_emu.DeviceArray.get, "device_ops", "get")
        cuda_emu._Event.synchronize = self.wrap(cuda_emu._Event.synchronize, "device_ops", "synchronize")

    def wrap(self, fn: Callable, bucket: str, name: str) -> Callable:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                out = fn(*a, **k)
                self.keep.append(out)  # NOTE: freed after the call: CuPy's pool takes memory back for free
                return out
            finally:
                self.s[bucket] += time.perf_counter() - t0
                kind = name if k.get("blocking", True) else "queued"  # NOTE: an async copy: no wait
                self.n[kind] += 1
                self.order.append(kind)
        return timed

    def kernel(self, launch: Callable) -> Callable:
        """A launch that runs the kernel and records its small arrays (counts, statuses, figures: what
        the host reads), or, replaying, writes back what was recorded and runs nothing.
        NOTE: replays keep the host's caches as a GPU leaves them: an emulated kernel walks megabytes."""
        def run(k: Any, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
            if not self.replaying:
                launch(k, grid, block, args, shared_mem=shared_mem)
                self.tape.append([a.copy() if isinstance(a, np.ndarray) and a.nbytes <= SMALL else None
                                  for a in args])
                return
            for a, r in zip(args, self.tape[self.n["launch"]], strict=True):
                if r is not None:
                    a[...] = r
        return run

    def measure(self, fn: Callable[[], Any], repeats: int) -> dict:
        """One call run for real (recorded), then ``repeats`` replays of it: medians of theirs."""
        self.tape.clear()
        self.replaying = False
        self._run(fn)
        self.replaying = True
        try:
            runs = [self._run(fn) for _ in range(repeats)]
        finally:
            self.replaying = False
        return {k: statistics.median(r[k] for r in runs) for k in runs[0]}

    def _run(self, fn: Callable[[], Any]) -> dict:
        self.s.clear(), self.n.clear(), self.order.clear()
        t0 = time.perf_counter()
        result = fn()
        wall = time.perf_counter() - t0
        del result
        self.keep.clear()
        return {"host_ms": 1e3 * (wall - self.s["kernels"] - self.s["device_ops"]),
                "device_ops_ms": 1e3 * self.s["device_ops"], "launches": self.n["launch"],
                "waits": sum(self.n[w] for w in WAITS), "waits_mid_call": self.mid_call()}

    def mid_call(self) -> int:
        """Waits with a kernel launched after them: the device drains while the host waits, unless it
        was given other work first."""
        last = max((i for i, k in enumerate(self.order) if k == "launch"), default=-1)
        return sum(k in WAITS for k in self.order[:last])


def case(cu: CudaCoder, meter: Meter, layers: int, repeats: int, tokens: int = 2048) -> dict:
    cp, model = cu.cp, gc.load_models()["tuned"]
    first = 10 if layers < 30 else 0
    L = gc.levels(model, first + layers, None)[first:]
    data = gc.typical(7, L, tokens)
    counts = [min(2, layers - i) for i in range(0, layers, 2)]
    a, b = (None if v is None else v[first:] for v in gc.affine(model, first + layers))
    x, mu = cp.asarray(data["x"]), cu.prepare_mu_device(cp.asarray(data["mu"]), a, b, None)
    parts = cu.encode_device(x, mu, L, counts, 1024, model.tables)
    streams, out = gc._streams(parts), cp.empty(data["x"].shape, data["x"].dtype)
    kept = cu.encode_streams(x, mu, L, counts, 1024, model.tables)
    calls = {"encode": lambda: cu.encode_device(x, mu, L, counts, 1024, model.tables),
             "encode_kept": lambda: cu.encode_streams(x, mu, L, counts, 1024, model.tables),
             "decode": lambda: cu.decode_device(mu, L, counts, 1024, streams, model.tables, out),
             "decode_kept": lambda: cu.decode_streams(kept, mu, L, counts, 1024, model.tables, out)}
    rep: dict[str, Any] = {"raw_mb": data["x"].nbytes / 1e6}
    for name, fn in calls.items():
        rep[name] = meter.measure(fn, repeats)
    cu.decode_device(mu, L, counts, 1024, streams, model.tables, out)  # NOTE: for real: replays write no KV
    rep["decode_correct"] = bool(np.array_equal(np.asarray(out), data["x"]))
    # the section pass's serial sweeps: a chunk's UNARY words, model_cta threads taking 4 words a sweep
    lay, g = kept.layout, kept.geometry
    unary = max(8 * int(lay.chunk_len[c]) - int(lay.start[int(g.chunk_b0[c]), 3]) for c in range(len(g.chunk_n)))
    rep["unary_words"], rep["section_sweeps"] = -(-unary // 32), -(-unary // (32 * 4 * cu.tuning.model_cta))
    return rep


def prompts_case(cu: CudaCoder, meter: Meter, repeats: int, tokens: tuple[int, ...] = (512, 1024, 2048, 3072)) -> dict:
    """Prompts of other lengths (2 layers each, a streaming call's worth), the streams kept on the
    device: one call each way (``encode_batch_streams`` / ``decode_streams_batch``) against a call a
    prompt."""
    cp, model = cu.cp, gc.load_models()["tuned"]
    L = gc.levels(model, 12, None)[10:]
    a, b = (None if v is None else v[10:] for v in gc.affine(model, 12))
    data = [gc.typical(31 + i, L, t) for i, t in enumerate(tokens)]
    reqs = [Request(cp.asarray(d["x"]), cu.prepare_mu_device(cp.asarray(d["mu"]), a, b, None), L, [2]) for d in data]
    outs = [Request(cp.empty(d["x"].shape, d["x"].dtype), r.mu, L, [2]) for d, r in zip(data, reqs, strict=True)]
    kept = cu.encode_batch_streams(reqs, 1024, model.tables)
    alone = [cu.encode_streams(r.kv, r.mu, L, [2], 1024, model.tables) for r in reqs]
    calls = {"encode_kept, one call": lambda: cu.encode_batch_streams(reqs, 1024, model.tables),
             "encode_kept, a call a prompt": lambda: [cu.encode_streams(r.kv, r.mu, L, [2], 1024, model.tables)
                                                      for r in reqs],
             "decode_kept, one call": lambda: cu.decode_streams_batch(kept, outs, 1024, model.tables),
             "decode_kept, a call a prompt": lambda: [cu.decode_streams(s, o.mu, L, [2], 1024, model.tables, o.kv)
                                                      for s, o in zip(alone, outs, strict=True)]}
    rep: dict[str, Any] = {"raw_mb": sum(d["x"].nbytes for d in data) / 1e6, "tokens": list(tokens)}
    for name, fn in calls.items():
        rep[name] = meter.measure(fn, repeats)
    cu.decode_streams_batch(kept, outs, 1024, model.tables)  # NOTE: for real: replays write no KV
    rep["decode_correct"] = all(np.array_equal(np.asarray(o.kv), d["x"]) for o, d in zip(outs, data, strict=True))
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        cp = cuda_emu.emulated_cupy(Path(work))
        cu = CudaCoder(cp, empty_pinned=np.empty)
        meter = Meter(cp)
        rep = {name: case(cu, meter, layers, args.repeats) for name, layers in (("streaming", 2), ("batched", 30))}
        rep["prompts4"] = prompts_case(cu, meter, args.repeats)
    if args.json:
        print(json.dumps(rep))
    else:
        print("| case | call | host ms | device-array ops ms (numpy here) | launches | waits | of them mid-call |\n"
              "|---|---|---|---|---|---|---|")
        for name, r in rep.items():
            for call, c in ((k, v) for k, v in r.items() if isinstance(v, dict)):
                print(f"| {name} ({r['raw_mb']:.1f} MB) | {call} | {c['host_ms']:.2f} | {c['device_ops_ms']:.2f} | "
                      f"{c['launches']:.0f} | {c['waits']:.0f} | {c['waits_mid_call']:.0f} |")
        for name in ("streaming", "batched"):
            print(f"{name}: a chunk's UNARY section at most {rep[name]['unary_words']} words, "
                  f"{rep[name]['section_sweeps']} sweep(s) of spk_decode_sections")
    return 0 if all(r["decode_correct"] for r in rep.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
