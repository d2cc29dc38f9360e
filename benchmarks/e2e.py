"""End-to-end harness: does speckv deliver a verified KV to the decode engine sooner than raw?

Emulates two nodes on this machine: network namespaces ``spk-<pid>-a`` (prefill node,
10.77.0.1: the prefill engine and a real ``speckv serve encoder``, all pinned to core 0
with ``taskset -c 0``) and ``spk-<pid>-b`` (decode node, 10.77.0.2: ``speckv serve
decoder`` and the fetching engine, pinned to core 1 with ``taskset -c 1``), joined by a
veth pair whose two egresses are shaped with netem (delay rtt/2) over tbf (rate). Each
link is first calibrated by a plain TCP transfer a -> b (its goodput, MB/s). The engines
are benchmarks/e2e_engine.py: the prefill engine streams the header at prefill start and
every layer as the target's forward pass produces it; the fetching engine pulls layers
with FetchKV and checks their hash (XXH3-128) against the prefill's (``lossless``).

Rows, per link: ``stored`` (raw BF16 stream), ``speckv`` (the shipped checkpoint's rung)
and ``recompute`` (the decode node runs the prefill itself; nothing moves).
  total_s          prefill start on the prefill node -> whole KV verified by the decode engine
  after_prefill_s  total_s minus that row's own prefill duration (what the user waits beyond it)
  first_layer_s    prefill start -> first layer in the decode engine's hands
  decode_node_cpu_s  utime+stime deltas (/proc/<pid>/stat) of the decoder sidecar + fetch engine
  critical_path_s  the cost model below at the link's calibrated goodput (stored and speckv rows)

Cost model (a lower bound; per-chunk costs from this run): each node has one core, and each stage
handles the chunks in order. Chunk k costs, on the prefill node's core, P_k (the engine's layers
of chunk k and their hand-off to the encoder: the same link's stored row's layer times, where no
predictor runs beside them), M_k (the predictor's mu of those layers: the decoder's per-chunk mu
times on its own core, scaled to its predictor_seconds; 0 for stored) and E_k (encode seconds / n:
the row's, or the loopback transfer's whose mu both sides had cached, whichever is less); on the
link B_k / goodput (chunk k's record bytes); on the decode node's core M_k again (the decoder's own
predictor) and D_k (decode seconds / n, as E). NOTE: the row's encode seconds are wall time beside
the engine and the predictor on one core, so they count those stages' time again; the loopback
figure keeps the sum a bound. The engine and the encoder's predictor share core 0, so their work
adds up; the link and the other node overlap with it:
  c_k = sum_{j<=k} (P_j + M_j + E_j)              chunk k coded, at the earliest
  w_k = max(c_k, w_{k-1}) + B_k / goodput          on the decode node
  d_k = max(w_k, d_{k-1}, sum_{j<=k} M_j + sum_{j<k} D_j) + D_k
critical_path_s = d_{n-1}. It leaves out RPCs, RTTs, hashing and the fetch engine's work.
even_path_s: the earlier, looser model (stages spread evenly over n equal chunks, the engine and
the encoder's predictor overlapping): with A = max(P, mu), P this row's prefill, mu = max(both
sides' predictor seconds), W = wire_bytes / goodput: max(A, E, W, D) + (A + E + W + D -
max(A, E, W, D)) / n. NOTE: a rung whose first layers are exact computes them at a prefill's cost
and sends them nearly free, so its chunks are neither even in cost nor in bytes; that model put a
25 Mbit/s row's bound ~0.5 s under what any schedule on one shared core can reach (RESULTS.md).
paced_path_s: the same pipeline fed at the pace the chunks' inputs really came (the encoder's
per-chunk timings, SubmitResponse.chunk_timings: chunk k's inputs exist at r_k, once its layers
are in and both sides' mu of them exist, however busy the sender was), each stage FIFO:
e_k = max(r_k, e_{k-1}) + E/n, w_k = max(e_k, w_{k-1}) + bytes_k / goodput, d_k = max(w_k,
d_{k-1}) + D/n; paced_path_s = d_{n-1}. Against total_s it is what the transport and coding add
beyond their inputs; against critical_path_s, what the order in which core 0 ran the engine and
the predictor cost (the engine runs ahead of the predictor there, taking the core's time first).
break_even_mbit: per encoding, the per-chunk costs are the medians over its rows and an offset
(median of total_s - critical_path_s: RPCs, RTTs, hashing) is added; the nominal rate where
the speckv and stored models cross (goodput = nominal x the median calibration ratio),
found on a log grid from 1 Mbit/s to 1 Tbit/s and bisected; null when they never cross.

NOTE: a kernel without sch_netem (minimal VM kernels) gets tbf alone: the report says
``rtt_emulated: false``; each calibration's ``tcp_connect_ms`` bounds the RTT there was.

loopback: the same veth with its qdiscs removed (unshaped, in-kernel), the prefilled KV
submitted whole; raw MB/s = raw bytes / (Submit start -> verified at the fetch engine), the median
of ``--loopback-repeats`` transfers (each one's in ``<key>_raw_MBps_runs``); ``<key>_lossless``: all of
them; ``<key>_mu_cached``: every transfer of the warm prompt found both caches hit, any cold one did.
``speckv``: a prompt whose mu both sidecars have cached (--mu-cache-bytes; the service's own
throughput), ``speckv_cold``: a new prompt (both predictors' passes included).
``--local-handoff`` adds ``stored_local`` and ``speckv_local``: the same, with the KV handed
to the encoder and fetched from the decoder as sealed memfds over their local sockets.
Prompts: every other transfer uses a prompt no transfer used before (the first token
shifted, e2e_engine.variant), so no row is helped by a sidecar's mu cache.

``--engine eager``: both engines compute the KV with eager attention instead of the sidecars' own
SDPA (another engine's kernels, as in ``speckv bench --engine``); ``--engine bf16``: transformers'
plain BF16 model (BF16 GEMMs through oneDNN: AMX on CPUs with it, where this engine's prefill is
several times faster than the FP32 target's; its KV differs from the sidecars' too); ``--predictor DIR``: both
sidecars serve that checkpoint (the default rung is chosen with these two).

Usage (root): .venv/bin/python benchmarks/e2e.py --links 25mbit,100mbit,1gbit --rtt-ms 1 --tokens 2048 [--json]
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_model import break_even, chunk_costs, critical_path, even_path, paced_path  # noqa: E402
from e2e_net import ADDR, Child, Net, calibrate, cpu_seconds, preflight, rate_bits, sweep_stale  # noqa: E402

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "corpus" / "tinyshakespeare.txt"
ENGINE = str(Path(__file__).resolve().parent / "e2e_engine.py")
ENGINES = ("sdpa", "eager", "bf16")  # speckv.predictor.engines.STREAM_ENGINES (this process never loads torch)
ROW_TIMEOUT = 600.0


def rung_name(predictor: str | None = None) -> str:
    """The rung of ``predictor`` (a checkpoint directory; None: the shipped one)."""
    from speckv.predictor.ladder import manifest_rung
    from speckv.predictor.store import MANIFEST, default_checkpoint_dir

    path = Path(predictor) if predictor else default_checkpoint_dir()
    return manifest_rung(json.loads((path / MANIFEST).read_text())).name


class Bench:
    """The four long-lived children and the transfers they run."""

    def __init__(self, args: argparse.Namespace, net: Net, logdir: Path) -> None:
        self.args, self.net, self.logdir = args, net, logdir
        self.children: list[Child] = []
        self.ids = itertools.count()

    def child(self, node: str, argv: list[str], name: str, env: dict[str, str] | None = None) -> Child:
        c = Child(self.net.ns[node], 0 if node == "a" else 1, argv, self.logdir / f"{name}.log", env)
        self.children.append(c)
        return c

    def start(self) -> bool | None:
        serve = [sys.executable, "-m", "speckv.cli.main", "serve"]
        env = {"SPECKV_MAX_INFLIGHT_BYTES": "1Gi"}
        if self.args.predictor:  # NOTE: both sidecars, or the decoder refuses the encoder's pin
            env["SPECKV_PREDICTOR"] = str(Path(self.args.predictor).resolve())
        dsock = ["--local-socket", str(self.logdir / "decoder.sock")] if self.args.local_handoff else []
        dec = self.child("b", [*serve, "decoder", "--listen", "0.0.0.0:0", "--metrics-port", "0", *dsock], "decoder",
                         env)
        sock = ["--local-socket", str(self.logdir / "encoder.sock")] if self.args.local_handoff else []
        enc = self.child("a", [*serve, "encoder", "--listen", "127.0.0.1:0", "--metrics-port", "-1", *sock],
                         "encoder", env)
        m = dec.wait_line(r"listening on port (\d+), metrics on port (\d+)", 300)
        dport, mport = m.group(1), m.group(2)
        eport = enc.wait_line(r"listening on port (\d+)", 300).group(1)
        common = ["--tokens", str(self.args.tokens), "--text", self.args.text, "--engine", self.args.engine]
        self.prefill = self.child("a", [sys.executable, ENGINE, "prefill", "--encoder", f"127.0.0.1:{eport}",
                                        "--decoder", f"{ADDR['b']}:{dport}", *common, *sock], "prefill-engine")
        self.fetch = self.child("b", [sys.executable, ENGINE, "fetch", "--decoder", f"127.0.0.1:{dport}",
                                      "--metrics-port", mport, *common, *dsock], "fetch-engine")
        self.decoder = dec
        ready = self.prefill.ask(None, 600)
        self.tokens = ready["tokens"]
        self.fetch.ask(None, 600)
        return ready["hook_matches_target_kv"]

    def decode_cpu(self) -> float:
        return sum(cpu_seconds(c.proc.pid) for c in (self.decoder, self.fetch))

    def transfer(self, link: str, encoding: str, stream: bool = True, variant: int | None = None,
                 local: bool = False) -> dict[str, Any]:
        """One transfer; ``variant`` None: a prompt no transfer used before (cold mu caches)."""
        n = next(self.ids)
        rid = f"{link}-{encoding}-{n}"
        v = n + 1 if variant is None else variant
        expect = str(self.logdir / f"{rid}.kvhash")
        cpu0 = self.decode_cpu()
        self.fetch.ask({"op": "fetch", "rid": rid, "expect": expect, "local": local}, 60)  # FetchKV is waiting
        p = self.prefill.ask({"rid": rid, "encoding": encoding, "stream": stream, "expect": expect, "variant": v,
                              "local": local}, ROW_TIMEOUT)
        f = self.fetch.ask(None, ROW_TIMEOUT)
        return {"p": p, "f": f, "cpu": self.decode_cpu() - cpu0, "expect": expect, "variant": v}

    def recompute(self, expect: str, variant: int) -> dict[str, Any]:
        cpu0 = self.decode_cpu()
        f = self.fetch.ask({"op": "recompute", "rid": "-", "expect": expect, "variant": variant}, ROW_TIMEOUT)
        return {"f": f, "cpu": self.decode_cpu() - cpu0}

    def stop(self) -> None:
        for c in reversed(self.children):
            c.stop()
        self.children.clear()


def transfer_row(link: str, encoding: str, rung: str | None, t: dict[str, Any], goodput: float,
                 alone: dict[str, Any] | None = None) -> dict[str, Any]:
    p, f = t["p"], t["f"]
    st = {"prefill_s": p["prefill_s"], "encode_s": p["encode_s"], "decode_s": f.get("decoder_decode_s", 0.0),
          "mu_s": max(p["predictor_s"], f.get("decoder_predictor_s", 0.0)) if encoding == "speckv" else 0.0,
          "chunks": float(p["chunks"]), "wire_bytes": float(p["wire_bytes"]),
          # where the encoder's time went beyond coding: waiting for mu (its own predictor or
          # the decoder's per-chunk check), and inside writes (the link's flow control)
          "encoder_mu_wait_s": p["mu_wait_s"], "wire_wait_s": p["wire_wait_s"],
          "decoder_mu_wait_s": f.get("decoder_mu_wait_s", 0.0)}
    total = f["done"] - p["t0"]
    costs = chunk_costs(t, encoding == "speckv", alone)
    return {"link": link, "encoding": encoding, "rung": rung, "total_s": total,
            "after_prefill_s": total - p["prefill_s"], "first_layer_s": f["first"] - p["t0"],
            "decode_node_cpu_s": t["cpu"], "critical_path_s": critical_path(costs, goodput),
            "even_path_s": even_path(st, goodput), "costs": costs,
            "paced_path_s": paced_path(p.get("timeline", []), st, goodput), "timeline": p.get("timeline", []),
            "lossless": bool(f["lossless"]) and p["encoding"] == encoding and not p["fallback"],
            "stored_chunks": p["stored_chunks"],
            "wire_bytes": p["wire_bytes"], "raw_bytes": p["raw_bytes"], "stages": st}


def recompute_row(link: str, t: dict[str, Any]) -> dict[str, Any]:
    f = t["f"]
    total = f["done"] - f["t0"]
    return {"link": link, "encoding": "recompute", "rung": None, "total_s": total,
            "after_prefill_s": total - f["prefill_s"], "first_layer_s": f["first"] - f["t0"],
            "decode_node_cpu_s": t["cpu"], "critical_path_s": None, "lossless": bool(f["lossless"]),
            "wire_bytes": 0, "raw_bytes": 0, "stages": {"prefill_s": f["prefill_s"]}}


def measure(bench: Bench, net: Net, args: argparse.Namespace) -> dict[str, Any]:
    rung = rung_name(args.predictor)
    net.unshape()
    for enc in ("stored", "speckv"):  # warm-up: channels, lazy imports, first coder calls; mu of prompt 0
        bench.transfer("warmup", enc, stream=False, variant=0)
    loopback: dict[str, Any] = {}
    alone: dict[str, Any] = {}
    # speckv: prompt 0 again, its mu cached on both sides (the service alone); speckv_cold: a new prompt
    runs = [("stored", "stored", 0, False), ("speckv", "speckv", 0, False)]
    if args.local_handoff:  # the same, the KV handed to the encoder as a sealed memfd (--local-socket)
        bench.transfer("warmup", "stored", stream=False, variant=0, local=True)
        runs += [("stored_local", "stored", 0, True), ("speckv_local", "speckv", 0, True)]
    runs.append(("speckv_cold", "speckv", None, False))  # NOTE: last: its new prompts' mu may evict prompt 0's
    for key, enc, v, local in runs:  # NOTE: each figure the median of --loopback-repeats transfers
        ts = [bench.transfer("loopback", enc, stream=False, variant=v, local=local)
              for _ in range(args.loopback_repeats)]
        rates = [t["p"]["raw_bytes"] / (t["f"]["done"] - t["p"]["t0"]) / 1e6 for t in ts]
        loopback[f"{key}_raw_MBps"] = statistics.median(rates)
        loopback[f"{key}_raw_MBps_runs"] = rates
        loopback[f"{key}_lossless"] = all(bool(t["f"]["lossless"]) for t in ts)
        if key == "speckv":  # the coder alone on each core: the cost model's encode and decode
            alone = {"encode_s": statistics.median(t["p"]["encode_s"] for t in ts),
                     "decode_s": statistics.median(t["f"].get("decoder_decode_s", 0.0) for t in ts)}
        if enc == "speckv":  # no predictor pass on either side <=> both caches hit
            cached = [t["p"]["predictor_s"] == 0 and t["f"].get("decoder_predictor_s", 0) == 0 for t in ts]
            loopback[f"{key}_mu_cached"] = all(cached) if v == 0 else any(cached)
    rows: list[dict[str, Any]] = []
    cal: dict[str, dict[str, float]] = {}
    for link in [] if args.loopback_only else args.links:
        netem = net.shape(link, args.rtt_ms)
        if not netem:
            print(f"e2e: WARNING: no sch_netem in this kernel: {link} shaped by tbf alone, "
                  f"--rtt-ms {args.rtt_ms} not emulated", file=sys.stderr, flush=True)
        cal[link] = {**calibrate(net, link, bench.logdir), "netem_delay": netem}
        goodput = cal[link]["measured_MBps"] * 1e6
        stored = bench.transfer(link, "stored")
        rows.append(transfer_row(link, "stored", None, stored, goodput, alone))
        rows.append(transfer_row(link, "speckv", rung, bench.transfer(link, "speckv"), goodput,
                                 alone | {"P": rows[-1]["costs"]["P"]}))  # the engine beside no predictor
        rows.append(recompute_row(link, bench.recompute(stored["expect"], stored["variant"])))
        print(f"e2e: {link} done", file=sys.stderr, flush=True)
    return {"rows": rows, "loopback": loopback, "break_even_mbit": break_even(rows, cal) if rows else None,
            "calibration": cal,
            "rtt_emulated": all(c["netem_delay"] for c in cal.values())}


def table(rep: dict[str, Any]) -> str:
    cols = ("link", "encoding", "rung", "total s", "after prefill s", "first layer s", "decode-node CPU s",
            "critical path s", "paced path s", "wire MB", "lossless")
    out = [f"{rep['tokens']} tokens, rtt {rep['rtt_ms']} ms; {rep['layout']}", " | ".join(cols)]
    for r in rep["rows"]:
        cp, pp = ("-" if r.get(k) is None else f"{r[k]:.2f}" for k in ("critical_path_s", "paced_path_s"))
        out.append(" | ".join([r["link"], r["encoding"], str(r["rung"] or "-"), f"{r['total_s']:.2f}",
                               f"{r['after_prefill_s']:.2f}", f"{r['first_layer_s']:.2f}",
                               f"{r['decode_node_cpu_s']:.2f}", cp, pp, f"{r['wire_bytes'] / 1e6:.2f}",
                               str(r["lossless"])]))
    for r in rep["rows"]:
        if r["encoding"] == "speckv":
            st = r["stages"]
            out.append(f"stages {r['link']} speckv: even path {r['even_path_s']:.2f} s, prefill {st['prefill_s']:.2f}"
                       f" s, mu {st['mu_s']:.2f}, "
                       f"encode {st['encode_s']:.2f}, decode {st['decode_s']:.2f}, encoder waits for mu "
                       f"{st['encoder_mu_wait_s']:.2f} and in writes {st['wire_wait_s']:.2f}, decoder waits "
                       f"for mu {st['decoder_mu_wait_s']:.2f}; {r['stored_chunks']} chunks stored")
    for link, c in rep["calibration"].items():
        out.append(f"calibration {link}: nominal {c['nominal_MBps']:.2f} MB/s, "
                   f"TCP gives {c['measured_MBps']:.2f} MB/s, "
                   f"TCP connect {c['tcp_connect_ms']:.2f} ms" + ("" if c["netem_delay"] else " (no netem)"))
    lb = rep["loopback"]
    out.append(f"loopback raw MB/s: stored {lb['stored_raw_MBps']:.1f}, speckv {lb['speckv_raw_MBps']:.1f} "
               f"(mu cached on both sides), speckv cold {lb['speckv_cold_raw_MBps']:.1f} (both predictors run)")
    out.append(f"break-even: {rep['break_even_mbit']} Mbit/s (speckv faster below it)")
    return "\n".join(out)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", default="25mbit,100mbit,1gbit", help="comma-separated tc rates, e.g. 25mbit,1gbit")
    ap.add_argument("--rtt-ms", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--timeout", type=int, default=3600, help="whole-run limit, seconds")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep-logs", action="store_true", help="keep the children's logs after a clean run")
    ap.add_argument("--local-handoff", action="store_true",
                    help="loopback block: also hand the KV to the encoder and fetch it from the decoder as sealed "
                         "memfds over their local sockets (*_local keys)")
    ap.add_argument("--loopback-only", action="store_true", help="the loopback block alone, no shaped links")
    ap.add_argument("--loopback-repeats", type=int, default=3, help="transfers per loopback figure (their median)")
    ap.add_argument("--predictor", default=None, help="both sidecars' checkpoint directory (default: the shipped one)")
    ap.add_argument("--engine", choices=ENGINES, default="sdpa",
                    help="how both engines compute the KV: sdpa (the sidecars' own kernels), eager attention or bf16 "
                         "(another engine's kernels: most KV scalars differ from the sidecars' in their last bits)")
    args = ap.parse_args(argv)
    if args.loopback_repeats < 1:
        ap.error("--loopback-repeats must be at least 1")
    args.links = [s.strip() for s in args.links.split(",") if s.strip()]
    for link in args.links:
        rate_bits(link)  # ValueError early
    return args


def _raise(sig: int, _frame: Any) -> None:
    # NOTE: SIGTERM/SIGINT/SIGALRM become exceptions, so every finally below runs
    raise SystemExit(128 + sig) if sig != signal.SIGALRM else TimeoutError("e2e.py ran past --timeout")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if (why := preflight()) is not None:
        print(why, file=sys.stderr)
        return 2
    sweep_stale()
    net = Net(os.getpid())
    logdir = Path(tempfile.mkdtemp(prefix="speckv-e2e-"))
    bench = Bench(args, net, logdir)

    def cleanup() -> None:
        bench.stop()
        net.down()

    atexit.register(cleanup)
    old = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)}
    signal.alarm(args.timeout)
    try:
        net.up()
        matches = bench.start()
        rep = measure(bench, net, args)
    finally:
        signal.alarm(0)
        cleanup()
        for s, h in old.items():
            signal.signal(s, h)
        atexit.unregister(cleanup)
    rep = {**rep, "tokens": bench.tokens, "rtt_ms": args.rtt_ms, "hook_matches_target_kv": matches,
           "engine": args.engine,
           "layout": "prefill node = ns a on core 0 (taskset -c 0), decode node = ns b on core 1 (taskset -c 1)",
           "logs": str(logdir)}
    lb = rep["loopback"]
    ok = matches and all(r["lossless"] for r in rep["rows"]) and \
        all(v for k, v in lb.items() if k.endswith("_lossless"))
    if ok and not args.keep_logs:  # NOTE: a failed or interrupted run keeps them (errors name its files)
        shutil.rmtree(logdir, ignore_errors=True)
        rep["logs"] = None
    print(json.dumps(rep) if args.json else table(rep))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
