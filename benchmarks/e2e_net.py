"""Helpers of benchmarks/e2e.py: two network namespaces joined by a shaped veth pair,
a plain-TCP calibration of each shaped link, and the child processes run inside them.

Namespaces are ``spk-<pid>-a`` (prefill node, 10.77.0.1) and ``spk-<pid>-b`` (decode
node, 10.77.0.2); ``sweep_stale`` deletes those of dead pids. Every child is started
with PR_SET_PDEATHSIG=SIGKILL, so it dies with the harness even when the harness is
SIGKILLed, and carries ``SPECKV_E2E_RUN=<harness pid>`` in its environment (tests
look for leftovers by it).

Run as a script, it is the calibration's two ends: ``e2e_net.py sink`` (prints its
port, then ``{"bytes", "seconds"}`` from first byte to EOF) and
``e2e_net.py source HOST PORT NBYTES``.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

PREFIX = "spk-"
ADDR = {"a": "10.77.0.1", "b": "10.77.0.2"}
DEV = {"a": "spk0", "b": "spk1"}
RUN_ENV = "SPECKV_E2E_RUN"
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}


def rate_bits(link: str) -> float:
    """``25mbit`` -> 25e6 bits/s. NOTE: tc's ``mbps`` means megaBYTES; only *bit units are taken."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit|bit)", link.strip().lower())
    if not m:
        raise ValueError(f"link rate must look like 25mbit / 1gbit, not {link!r}")
    return float(m.group(1)) * UNITS[m.group(2)]


def preflight() -> str | None:
    """Why this machine cannot run the harness, or None."""
    if os.geteuid() != 0:
        return "e2e.py needs root (network namespaces and tc); run it as root"
    missing = [t for t in ("ip", "tc", "taskset") if shutil.which(t) is None]
    if missing:
        return f"e2e.py needs {' and '.join(missing)} (iproute2 / util-linux), not found on PATH"
    return None


def sh(*argv: str, check: bool = True, timeout: float = 30) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")
    return res.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ns_pids(ns: str) -> list[int]:
    return [int(p) for p in sh("ip", "netns", "pids", ns, check=False).split()]


def delete_ns(ns: str) -> None:
    """Kill what still runs in ``ns`` (only this harness starts processes there) and delete it."""
    for pid in ns_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sh("ip", "netns", "del", ns, check=False)


def sweep_stale() -> list[str]:
    """Delete ``spk-<pid>-*`` namespaces whose harness pid is dead; returns their names."""
    gone = []
    for line in sh("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(r"spk-(\d+)-[ab]", name)
        if m and not _alive(int(m.group(1))):
            delete_ns(name)
            gone.append(name)
    return gone


class Net:
    """The two namespaces and their veth pair; ``shape`` sets both ends' egress."""

    def __init__(self, pid: int) -> None:
        self.ns = {k: f"{PREFIX}{pid}-{k}" for k in ("a", "b")}

    def up(self) -> None:
        a, b = self.ns["a"], self.ns["b"]
        for ns in (a, b):
            sh("ip", "netns", "add", ns)
        # NOTE: created inside a, its peer directly inside b: no name ever lives in the root namespace
        sh("ip", "-n", a, "link", "add", DEV["a"], "type", "veth", "peer", "name", DEV["b"], "netns", b)
        for k, ns in self.ns.items():
            sh("ip", "-n", ns, "addr", "add", f"{ADDR[k]}/24", "dev", DEV[k])
            sh("ip", "-n", ns, "link", "set", DEV[k], "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")  # NOTE: a new namespace's lo is down

    def shape(self, link: str, rtt_ms: float) -> bool:
        """netem delay rtt/2 at the root, tbf (rate, burst, latency) as its child, on both ends.
        Returns False when this kernel has no netem (then tbf alone: the veth's own RTT)."""
        bps = rate_bits(link) / 8
        # NOTE: veth hands tbf 64 KiB GSO packets; a burst below that makes tbf segment or drop
        tbf = ["tbf", "rate", link, "burst", str(int(max(128 * 1024, bps * 0.002))), "latency", "50ms"]
        netem = True
        for k, ns in self.ns.items():
            self.unshape_one(ns, DEV[k])
            q = ["tc", "-n", ns, "qdisc", "add", "dev", DEV[k]]
            try:
                sh(*q, "root", "handle", "1:", "netem", "delay", f"{rtt_ms / 2}ms", "limit", "100000")
                sh(*q, "parent", "1:1", "handle", "10:", *tbf)
            except RuntimeError as e:
                # NOTE: minimal VM kernels (e.g. Firecracker's) build tbf but not sch_netem
                if "unknown" not in str(e):
                    raise
                netem = False
                self.unshape_one(ns, DEV[k])
                sh(*q, "root", "handle", "1:", *tbf)
        return netem

    @staticmethod
    def unshape_one(ns: str, dev: str) -> None:
        sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)

    def unshape(self) -> None:
        for k, ns in self.ns.items():
            self.unshape_one(ns, DEV[k])

    def down(self) -> None:
        for ns in self.ns.values():
            delete_ns(ns)


_LIBC = ctypes.CDLL(None, use_errno=True)  # NOTE: loaded here: no dlopen between fork and exec


def _pdeathsig() -> None:
    """In the child before exec: die with the harness (survives ``ip netns exec`` and taskset's exec)."""
    _LIBC.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class Child:
    """A process in a namespace, pinned to one core; its stdout lines are read into a queue."""

    def __init__(self, ns: str, core: int, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log.open("w")
        self.name = " ".join(argv[-8:]) if len(argv) > 8 else " ".join(argv)
        full = ["ip", "netns", "exec", ns, "taskset", "-c", str(core), *argv]
        e = {**os.environ, RUN_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(full, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=e, preexec_fn=_pdeathsig)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_line(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {pattern!r} from {self.name} in {timeout} s (log {self.log.name})") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited with {self.proc.wait()} (log {self.log.name})")
            if m := re.search(pattern, line):
                return m

    def ask(self, cmd: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        """Send one JSON command (None: just read) and return the next ``@@ {json}`` reply."""
        if cmd is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        reply: dict[str, Any] = json.loads(self.wait_line(r"^@@ (.*)$", timeout).group(1))
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']} (log {self.log.name})")
        return reply

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # NOTE: comm may hold spaces and ')'
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def calibrate(net: Net, link: str, logdir: Path, seconds: float = 1.5) -> dict[str, float]:
    """One plain TCP transfer a -> b through the shaped link: the goodput it really gives
    (and how long its connect took: an upper bound of the RTT, socket setup included)."""
    nominal = rate_bits(link) / 8
    nbytes = int(max(2e6, nominal * seconds))
    me = str(Path(__file__).resolve())
    sink = Child(net.ns["b"], 1, [sys.executable, me, "sink"], logdir / f"calib-sink-{link}.log")
    try:
        port = sink.wait_line(r"^(\d+)$", 30).group(1)
        src = Child(net.ns["a"], 0, [sys.executable, me, "source", ADDR["b"], port, str(nbytes)],
                    logdir / f"calib-source-{link}.log")
        got = json.loads(sink.wait_line(r"^(\{.*\})$", 120).group(1))
        rtt = json.loads(src.wait_line(r"^(\{.*\})$", 30).group(1))["connect_s"]
        src.proc.wait(timeout=30)
        src.stop()
    finally:
        sink.stop()
    measured = got["bytes"] / got["seconds"]
    return {"nominal_MBps": nominal / 1e6, "measured_MBps": measured / 1e6,
            "ratio": measured / nominal, "bytes": nbytes, "tcp_connect_ms": rtt * 1e3}


def _sink() -> None:
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen(1)
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept()
    first = c.recv(1 << 20)
    t0, n = time.monotonic(), 0  # NOTE: timed from the first byte: no connect or slow-start wait
    while b := c.recv(1 << 20):
        n += len(b)
    print(json.dumps({"bytes": n, "seconds": time.monotonic() - t0, "first": len(first)}), flush=True)


def _source(host: str, port: int, nbytes: int) -> None:
    buf = b"\0" * (1 << 20)
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=60) as s:
        print(json.dumps({"connect_s": time.monotonic() - t0}), flush=True)  # >= one RTT (SYN, SYN-ACK)
        while nbytes > 0:
            s.sendall(buf[:nbytes])
            nbytes -= len(buf)


def _main(argv: list[str]) -> None:
    if argv[0] == "sink":
        _sink()
    else:
        _source(argv[1], int(argv[2]), int(argv[3]))


if __name__ == "__main__":
    _main(sys.argv[1:])
