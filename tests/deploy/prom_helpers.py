"""Helpers of the deploy tests that need Prometheus: find its binaries, run a
throw-away server (temp config and TSDB, loopback port, no systemd), query it,
and pick apart the Grafana dashboard's PromQL (template variables, metric
names, label matchers, ``by`` and ``on`` clauses, the labels a legend shows).

Every wait is bounded: a broken Prometheus shows up as a failure with the tail
of its log, never as a hang.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from require import missing

# Grafana's global variables the dashboard may use besides its own templating variables.
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}

# $name, ${name}, ${name:format}, [[name]], [[name:format]]
VAR_RE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)(?::[^\]]*)?\]\]")
# the sidecars' own families and the gRPC server families (server/grpc_metrics.py)
METRIC_RE = re.compile(r"\b((?:speckv|grpc_server)_[a-zA-Z0-9_]+)\b")
# such a metric and its selector (the dashboard writes every selector as metric{...})
SELECTOR_RE = re.compile(r"\b((?:speckv|grpc_server)_[a-zA-Z0-9_]+)(\s*\{([^}]*)\})?")
MATCHER_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
BY_RE = re.compile(r"\bby\s*\(([^)]*)\)")
ON_RE = re.compile(r"\bon\s*\(([^)]*)\)")
LEGEND_RE = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def binary(name: str) -> str:
    """Path of a Prometheus binary (``prometheus``, ``promtool``): on PATH, else /usr/bin
    (Debian's package). Missing: fail when $SPECKV_REQUIRE_PROMTOOL is set, else skip."""
    exe = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if exe is None:
        missing("PROMTOOL", f"{name} not found on PATH or in /usr/bin (install the Debian package 'prometheus')")
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``pred`` until it returns something truthy (returned); AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
        time.sleep(interval)


# -- the dashboard's expressions ---------------------------------------------

def variables_in(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in VAR_RE.finditer(text)}


def substitute(text: str, values: dict[str, str]) -> str:
    """Replace every Grafana variable reference; KeyError for one without a value."""
    return VAR_RE.sub(lambda m: values[next(g for g in m.groups() if g)], text)


def metric_names(expr: str) -> set[str]:
    return set(METRIC_RE.findall(expr))


def selectors(expr: str) -> Iterator[tuple[str, dict[str, tuple[str, str]] | None]]:
    """``(metric, {label: (op, value)})`` of every speckv metric in ``expr`` (None: no braces)."""
    for m in SELECTOR_RE.finditer(expr):
        body = m.group(3)
        yield m.group(1), (None if m.group(2) is None else
                           {lab: (op, val) for lab, op, val in MATCHER_RE.findall(body)})


def by_labels(expr: str) -> set[str]:
    return {lab.strip() for m in BY_RE.finditer(expr) for lab in m.group(1).split(",") if lab.strip()}


def on_labels(expr: str) -> set[str]:
    """The labels of every vector match's ``on (...)``: join keys, aggregated away outside the join."""
    return {lab.strip() for m in ON_RE.finditer(expr) for lab in m.group(1).split(",") if lab.strip()}


def legend_labels(legend: str) -> set[str]:
    """The labels a Grafana legendFormat shows (``{{role}} {{outcome}}``)."""
    return set(LEGEND_RE.findall(legend))


def exposition_names(text: str) -> tuple[set[str], set[str]]:
    """From a /metrics text: (the metric families declared by ``# TYPE``, every series name a
    query may use: counters and gauges as declared, histograms as _bucket, _sum, _count)."""
    families, names = set(), set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[:2] == ["#", "TYPE"]:
            name, kind = parts[2], parts[3]
            if name.endswith("_created"):  # prometheus_client's creation-time gauges, not ours to chart
                continue
            families.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            else:
                names.add(name)
    return families, names


def finite(value: str) -> bool:
    return math.isfinite(float(value))


# -- a throw-away Prometheus ---------------------------------------------------

class Prometheus:
    """``prometheus`` scraping ``targets`` (host:port) every second, with ``labels`` on
    every series, TSDB and log under ``workdir``; a context manager that always stops it."""

    def __init__(self, workdir: Path, targets: list[str], labels: dict[str, str],
                 scrape_interval: str = "1s") -> None:
        self.workdir = Path(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = self.workdir / "prometheus.yml"
        # JSON is YAML: no yaml dependency for writing the config
        self.config.write_text(json.dumps({
            "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval,
                       "evaluation_interval": scrape_interval},
            "scrape_configs": [{"job_name": "speckv", "metrics_path": "/metrics",
                                "static_configs": [{"targets": targets, "labels": labels}]}],
        }, indent=2))
        self.log_path = self.workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> "Prometheus":
        exe = binary("prometheus")
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [exe, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=info"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir)
        try:
            wait_until(self._ready, timeout, f"Prometheus {self.url}/-/ready", interval=0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP API ---------------------------------------------------------------
    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; the ``data`` of a success, AssertionError (with Prometheus's
        error) otherwise."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400/422 carry a JSON error body
            body = json.load(e)
        assert body.get("status") == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query's vector (scalars and matrices are refused: a panel wants a vector)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def label_values(self, label: str, match: str) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": match})

    def series_labels(self, metric: str) -> set[str]:
        """Every label name carried by some series of ``metric``."""
        return {k for s in self.api("series", **{"match[]": metric}) for k in s}
