"""Where the CPU of a loopback transfer goes, per process: stored and warm speckv.

Starts a decoder and an encoder sidecar as separate ``speckv serve`` processes on
loopback (mu cache on, its default size) and two client processes, this script's
``submit`` role (an EncoderClient) and ``fetch`` role (a DecoderClient that takes the
whole KV and checks it bit for bit after its clock stops), so that every process's
CPU is its own. The embedded model prefills the KV once. Per encoding (``stored``;
``speckv``, whose prompt is sent once before the measured runs so that both sidecars'
mu caches hold it: the warm path, no predictor pass) it runs ``--repeats`` transfers
and reports, per process, the mean CPU seconds per transfer (the sidecars': utime + stime
deltas from /proc/<pid>/stat over all the repeats together, so its 10 ms tick is spread
over them, every thread counted, ended ones too; the clients': their own process_time
around their call) and raw MB per CPU-second, and the median wall time (Submit start ->
last layer fetched; meaningful only on a quiet machine). ``--perf``: one more transfer per encoding with ``perf record``
sampling each of the four processes; samples are grouped by function (hashing, crc,
copies, protobuf, grpc, coding, numpy, python, kernel) and scaled to the process's mean
CPU seconds per transfer. ``--pin``: e2e.py's layout, encoder and submit client on
core 0, decoder and fetch client on core 1.

Usage: .venv/bin/python benchmarks/loopback_profile.py [--tokens 2048] [--repeats 3] [--perf] [--pin] [--local] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer_bench import DEFAULT_TEXT, start  # noqa: E402

PROCS = ("encoder", "decoder", "submit", "fetch")
CORES = {"encoder": 0, "submit": 0, "decoder": 1, "fetch": 1}  # --pin: e2e.py's two nodes
TIMEOUT = 600.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads, live and exited), from /proc/<pid>/stat
    (clock ticks: 10 ms)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # NOTE: comm may hold spaces and ')'
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the client processes ---------------------------------------------------------

def reply(**kw: Any) -> None:
    print("@@ " + json.dumps(kw), flush=True)


def worker(role: str, address: str, kv_path: str, ids_path: str, model_id: str, local: str = "") -> None:
    """One client, driven by JSON lines on stdin; replies ``@@ {json}`` lines (``local``: its
    sidecar's local socket, or "")."""
    from speckv.client.client import DecoderClient, EncoderClient

    kv, ids = np.load(kv_path), np.load(ids_path)
    sock = local or None
    client = EncoderClient(address, timeout=TIMEOUT, local_socket=sock) if role == "submit" else \
        DecoderClient(address, timeout=TIMEOUT, local_socket=sock)
    reply(ready=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        c0, t0 = time.process_time(), time.monotonic()
        if role == "submit":
            r = client.submit(cmd["rid"], kv, ids, cmd["decoder"], model_id, encoding=cmd["encoding"])
            reply(cpu=time.process_time() - c0, t0=t0, raw=r.raw_bytes, wire=r.wire_bytes,
                  predictor_s=r.predictor_seconds, encode_s=r.encode_seconds, stored_chunks=r.stored_chunks)
        else:
            reply(ack=True)  # NOTE: the parent starts the submit only after this line
            got = client.fetch(cmd["rid"], wait=TIMEOUT)
            reply(cpu=time.process_time() - c0, done=time.monotonic())
            sys.stdin.readline()  # "check": compared once the parent's clocks stopped
            reply(ok=bool(np.array_equal(got, kv)))


class Child:
    """A client process and its JSON-lines conversation."""

    def __init__(self, role: str, argv: list[str], core: int | None) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=None if core is None else lambda: os.sched_setaffinity(0, {core}))
        self.role = role
        self.ask(None)

    def ask(self, cmd: dict[str, Any] | None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if cmd is not None:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return dict(json.loads(line[3:]))
        raise RuntimeError(f"{self.role} client exited with {self.proc.wait()}")

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# -- perf: samples grouped by function ------------------------------------------

GROUPS = (  # first match wins: (group, pattern over "dso sym")
    ("hashing", r"blake2|XXH|xxh|sha256|SHA256|sha2_|_hashlib|xxhash"),
    ("crc", r"crc32"),
    ("copies", r"memmove|memcpy|memset|__memcpy|clear_page|copy_page|exc_page_fault|do_anonymous_page|"
               r"handle_mm_fault|__handle_mm_fault|page_fault|_raw_spin_unlock_irqrestore|free_pages|"
               r"release_pages|unmap|zap_|__alloc_pages|get_page_from_freelist|rmqueue|mmap|munmap|madvise"),
    ("protobuf", r"_message\.|upb|protobuf"),
    ("grpc", r"cygrpc"),
    ("coding", r"speckv|_native|spk_"),
    ("numpy", r"_multiarray|numpy"),
    ("kernel net", r"\[kernel\.kallsyms\] .*(tcp|skb|sock|sys_sendmsg|sys_recvmsg|ip_|net_|copy_user|"
                   r"_copy_to_iter|_copy_from_iter|rep_movs|loopback|epoll|__x64_sys_(send|recv|write|read))"),
    ("python", r"libpython|python3"),
    ("kernel other", r"\[kernel\.kallsyms\]"),
)


def perf_start(pid: int, out: Path, graph: bool = False) -> subprocess.Popen:
    return subprocess.Popen(["perf", "record", "-q", "-F", "4999", *(["-g"] if graph else []), "-p", str(pid),
                             "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def perf_groups(data: Path) -> dict[str, float]:
    """Fractions of a perf.data's samples per function group."""
    text = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "-g", "none",
                           "--stdio", "--percent-limit", "0"], capture_output=True, text=True).stdout
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"\s*([0-9.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)", line)
        if not m:
            continue
        key = f"{m.group(2)} {m.group(3)}"
        group = next((g for g, pat in GROUPS if re.search(pat, key)), "other")
        out[group] = out.get(group, 0.0) + float(m.group(1)) / 100
    return out


# -- transfers ----------------------------------------------------------------------

class Rig:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        from speckv.predictor.calibrate import read_text
        from speckv.predictor.target import load_target

        target = load_target()
        ids = target.tokenize(read_text(args.text, chars=args.tokens * 32), args.tokens)
        from speckv.kv import bf16_bits

        np.save(tmp / "kv.npy", bf16_bits(target.kv(ids)))
        np.save(tmp / "ids.npy", np.asarray(ids, np.int64))
        self.tokens, self.tmp, self.n, self.graph = int(len(ids)), tmp, 0, args.perf_g
        core = (lambda role: CORES[role]) if args.pin else (lambda role: None)
        env = {"SPECKV_MAX_INFLIGHT_BYTES": "1Gi"}  # NOTE: the mu cache keeps its default size
        env.update(kv.split("=", 1) for kv in args.sidecar_env)
        sock = {r: str(tmp / f"{r}.sock") if args.local else "" for r in ("encoder", "decoder")}
        (self.dec, dport), (self.enc, eport) = (
            start(r, {**env, "SPECKV_LOCAL_SOCKET": sock[r]} if args.local else env, core(r))
            for r in ("decoder", "encoder"))
        self.decoder = f"127.0.0.1:{dport}"
        me = [sys.executable, __file__, "--role"]
        files = [str(tmp / "kv.npy"), str(tmp / "ids.npy"), target.name]
        self.submit = Child("submit", [*me, "submit", f"127.0.0.1:{eport}", *files, sock["encoder"]], core("submit"))
        self.fetch = Child("fetch", [*me, "fetch", self.decoder, *files, sock["decoder"]], core("fetch"))

    def pids(self) -> dict[str, int]:
        return {"encoder": self.enc.pid, "decoder": self.dec.pid, "submit": self.submit.proc.pid,
                "fetch": self.fetch.proc.pid}

    def transfer(self, encoding: str, perf: bool = False) -> dict[str, Any]:
        self.n += 1
        rid = f"{encoding}-{self.n}"
        sidecars = {"encoder": self.enc.pid, "decoder": self.dec.pid}
        perfs = ({k: perf_start(pid, self.tmp / f"{rid}-{k}.data", self.graph) for k, pid in self.pids().items()}
                 if perf else {})
        if perf:
            time.sleep(1.0)  # perf attached
        before = {k: cpu_seconds(pid) for k, pid in sidecars.items()}
        self.fetch.ask({"rid": rid})
        s = self.submit.ask({"rid": rid, "encoding": encoding, "decoder": self.decoder})
        f = self.fetch.ask(None)
        time.sleep(0.05)  # the sidecars' last bookkeeping after the fetch returned
        cpu = {k: cpu_seconds(pid) - before[k] for k, pid in sidecars.items()}
        cpu.update(submit=s["cpu"], fetch=f["cpu"])
        for p in perfs.values():
            p.send_signal(signal.SIGINT)
            p.wait(timeout=60)
        ok = self.fetch.ask({"check": True})["ok"]  # NOTE: after the clocks and perf stopped
        out = {"cpu": cpu, "wall_s": f["done"] - s["t0"], "raw": s["raw"], "wire": s["wire"], "ok": ok,
               "predictor_s": s["predictor_s"], "encode_s": s["encode_s"], "stored_chunks": s["stored_chunks"]}
        if perf:
            out["groups"] = {k: perf_groups(self.tmp / f"{rid}-{k}.data") for k in perfs}  # fractions
        return out

    def repeats(self, encoding: str, n: int) -> list[dict[str, Any]]:
        """``n`` transfers; each one's ``cpu`` of the sidecars is the mean over all of them."""
        sidecars = {"encoder": self.enc.pid, "decoder": self.dec.pid}
        before = {k: cpu_seconds(pid) for k, pid in sidecars.items()}
        runs = [self.transfer(encoding) for _ in range(n)]
        for k, pid in sidecars.items():
            mean = (cpu_seconds(pid) - before[k]) / n
            for r in runs:
                r["cpu"][k] = mean
        return runs

    def stop(self) -> None:
        for c in (self.submit, self.fetch):
            c.stop()
        for p in (self.enc, self.dec):
            p.terminate()
            p.wait(timeout=30)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    raw = runs[0]["raw"]
    cpu = {k: statistics.mean(r["cpu"][k] for r in runs) for k in PROCS}
    return {"lossless": all(r["ok"] for r in runs), "raw_bytes": raw, "wire_bytes": runs[0]["wire"],
            "cpu_s": cpu, "raw_MB_per_cpu_s": {k: raw / 1e6 / v if v else None for k, v in cpu.items()},
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "raw_MBps_wall": raw / 1e6 / statistics.median(r["wall_s"] for r in runs),
            "predictor_s": max(r["predictor_s"] for r in runs), "stored_chunks": runs[0]["stored_chunks"],
            "repeats": len(runs)}


def measure(rig: Rig, args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"tokens": rig.tokens, "pinned": args.pin, "local": args.local,
                              "load_before": os.getloadavg()[0]}
    for encoding in args.encodings:
        rig.transfer(encoding)  # warm-up: channels, lazy imports; speckv: both mu caches now hold the prompt
        key = "speckv_warm" if encoding == "speckv" else encoding
        report[key] = summarize(rig.repeats(encoding, args.repeats))
        if args.perf:
            groups = rig.transfer(encoding, perf=True)["groups"]
            report[key]["perf_groups_cpu_s"] = {k: {g: fr * report[key]["cpu_s"][k] for g, fr in fs.items()}
                                                for k, fs in groups.items()}
    report["load_after"] = os.getloadavg()[0]
    return report


def table(rep: dict[str, Any]) -> str:
    first = rep.get("stored") or rep["speckv_warm"]
    out = [f"{rep['tokens']} tokens, {first['raw_bytes'] / 1e6:.1f} MB raw BF16 KV, "
           f"CPU: mean of {first['repeats']}, wall: median; pinned: {rep['pinned']}; "
           f"local sockets: {rep.get('local')}; "
           f"load {rep['load_before']:.2f} -> {rep['load_after']:.2f}",
           "path | " + " | ".join(f"{p} CPU s (MB/CPU-s)" for p in PROCS) + " | wall s (MB/s) | lossless"]
    for key in (k for k in ("stored", "speckv_warm") if k in rep):
        r = rep[key]
        cells = [f"{r['cpu_s'][p]:.3f} ({r['raw_MB_per_cpu_s'][p] or 0:.0f})" for p in PROCS]
        out.append(" | ".join([key, *cells, f"{r['wall_s']:.3f} ({r['raw_MBps_wall']:.1f})", str(r["lossless"])]))
    for key in (k for k in ("stored", "speckv_warm") if k in rep):
        for p, groups in rep[key].get("perf_groups_cpu_s", {}).items():
            top = sorted(groups.items(), key=lambda kv: -kv[1])
            out.append(f"perf {key} {p}: " + ", ".join(f"{g} {s:.3f}" for g, s in top if s >= 0.001))
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--role":
        worker(*sys.argv[2:8])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--perf", action="store_true", help="perf record each process during one more transfer")
    ap.add_argument("--local", action="store_true", help="clients on both sidecars' local sockets: the KV "
                    "handed to the encoder and fetched from the decoder as memfds")
    ap.add_argument("--pin", action="store_true", help="e2e.py's layout: encoder + submit on core 0, the rest core 1")
    ap.add_argument("--sidecar-env", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of both sidecars, e.g. SPECKV_MESSAGE_BYTES=3Mi (repeatable)")
    ap.add_argument("--perf-g", action="store_true", help="--perf with call graphs (perf record -g)")
    ap.add_argument("--encodings", default="stored,speckv", help="comma-separated: stored, speckv")
    ap.add_argument("--keep", metavar="DIR", help="write perf data (and the KV) to DIR and keep them")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.encodings = [e for e in args.encodings.split(",") if e]
    args.perf = args.perf or args.perf_g
    with tempfile.TemporaryDirectory(prefix="speckv-prof-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        rig = Rig(args, work)
        try:
            rep = measure(rig, args)
        finally:
            rig.stop()
    print(json.dumps(rep) if args.json else table(rep))


if __name__ == "__main__":
    main()
