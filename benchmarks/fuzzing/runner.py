"""Running the targets: the tally of outcomes and findings, worker processes (each
with its own sidecars), the report table and the command line.

Input ``i`` of target ``t`` is generated from ``random.Random(f"{seed}:{t}:{i}")``:
``--replay t:i`` runs it alone.
"""

from __future__ import annotations

import logging
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from .coder_env import CoderEnv
from .coder_targets import CODER_TARGETS
from .findings import Finding, describe
from .server_env import ServerEnv
from .server_targets import SERVER_TARGETS

TARGETS: dict[str, Callable[[Any, random.Random], str]] = {**CODER_TARGETS, **SERVER_TARGETS}
USAGE = """Fuzzing of the speckv parsers, codec and sidecars (benchmarks/fuzzing).

Usage::

    .venv/bin/python benchmarks/fuzz.py [--per-target 10000] [--jobs 2] [--seed 0] [--targets a,b] [--json out.json]
    .venv/bin/python benchmarks/fuzz.py --replay TARGET:INDEX

Exit status 1 if anything was found."""


def input_rng(seed: int, name: str, i: int) -> random.Random:
    """The generator of input ``i`` of target ``name``."""
    return random.Random(f"{seed}:{name}:{i}")


@dataclass
class Tally:
    """What the inputs of one target gave."""

    target: str
    inputs: int = 0
    seconds: float = 0.0
    outcomes: Counter = field(default_factory=Counter)
    findings: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    signatures: Counter = field(default_factory=Counter)
    health: dict[str, Any] = field(default_factory=dict)

    @property
    def crashes(self) -> int:
        return sum(n for k, n in self.findings.items() if k != "hang")

    @property
    def hangs(self) -> int:
        return self.findings["hang"]

    def add_finding(self, f: Finding, replay: str) -> None:
        self.findings[f.kind] += 1
        self.signatures[f"{f.kind}: {f.detail[:90]}"] += 1
        self.outcomes[f"<{f.kind}>"] += 1
        ex = self.examples.setdefault(f.kind, [])
        if len(ex) < 5:
            ex.append(f"--replay {replay}  {f.detail[:300]}")

    def as_state(self) -> dict[str, Any]:
        """Plain data (for the worker processes)."""
        return {"target": self.target, "inputs": self.inputs, "seconds": self.seconds,
                "outcomes": dict(self.outcomes), "findings": dict(self.findings), "examples": self.examples,
                "signatures": dict(self.signatures), "health": self.health}

    @classmethod
    def merge(cls, states: list[dict[str, Any]]) -> "Tally":
        """One target's tally over the jobs' ``as_state()``s (health kept per job)."""
        t = cls(states[0]["target"])
        jobs = []
        for k, st in enumerate(states):
            t.inputs += st["inputs"]
            t.seconds += st["seconds"]
            t.outcomes.update(st["outcomes"])
            t.findings.update(st["findings"])
            t.signatures.update(st["signatures"])
            for kind, ex in st["examples"].items():
                t.examples.setdefault(kind, []).extend(ex)
            if st["health"]:
                jobs.append({"job": k, **st["health"]})
        if jobs:
            t.health = {"jobs": jobs}
        return t

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "inputs": self.inputs, "seconds": round(self.seconds, 2),
                "outcomes": dict(self.outcomes.most_common()), "findings": dict(self.findings),
                "crashes": self.crashes, "hangs": self.hangs,
                "finding_signatures": dict(self.signatures.most_common(10)), "examples": self.examples,
                "health_after": self.health}


def run_one(name: str, env: Any, rng: random.Random) -> str:
    """One input of target ``name``: its outcome, or Finding (an exception of the harness
    itself, or a client-side surprise, is a crash too)."""
    try:
        return TARGETS[name](env, rng)
    except Finding:
        raise
    except Exception as e:
        raise Finding("crash", f"harness: {describe(e)}") from e


def health_after(env: ServerEnv) -> dict[str, Any]:
    """The sidecars after a target: health, budgets drained, what is left, errors logged."""
    h: dict[str, Any] = {"health": env.healthy()}
    try:
        env.check_drained(30)
        h["budgets_drained"] = True
    except Finding as f:
        h["budgets_drained"] = False
        h["leak"] = f.detail
    h["budget_used"] = env.used()
    h["live_transfers"] = env.live()
    h["encoder_channels"] = len(env.service("encoder")._channels)
    h["errors_logged_total"] = env.errors.total
    return h


def run_target(name: str, env: Any, n: int, seed: int, start: int = 0, progress: bool = True) -> Tally:
    """Inputs ``start .. start + n - 1`` of target ``name`` against ``env``."""
    tally = Tally(name)
    server = isinstance(env, ServerEnv)
    t0 = last = time.perf_counter()
    for i in range(start, start + n):
        try:
            tally.outcomes[run_one(name, env, input_rng(seed, name, i))] += 1
        except Finding as f:
            logged = env.errors.take() if server else []  # what the sidecars logged belongs to this input
            if logged:
                f.detail += f" [sidecar logged {len(logged)} error(s), first: {logged[0][:200]}]"
            tally.add_finding(f, f"{name}:{i}")
            if server:
                env.reset()  # so one finding is not counted again on the next inputs
        tally.inputs += 1
        if progress and time.perf_counter() - last > 10:
            last = time.perf_counter()
            print(f"  {name}: {tally.inputs}/{n} inputs, {last - t0:.0f} s, findings {dict(tally.findings)}",
                  file=sys.stderr, flush=True)
    tally.seconds = time.perf_counter() - t0
    if server:
        tally.health = health_after(env)
        if any(v != "SERVING" for v in tally.health["health"].values()) or not tally.health["budgets_drained"]:
            tally.findings["unhealthy"] += 1
    return tally


def table(tallies: list[Tally]) -> str:
    """A markdown table: inputs, time, rate, findings and top outcomes per target."""
    rows = ["| target | inputs | time (s) | inputs/s | crashes | hangs | outcomes (top 6) |",
            "|---|---:|---:|---:|---:|---:|---|"]
    for t in tallies:
        top = ", ".join(f"{k} {v}" for k, v in t.outcomes.most_common(6))
        rows.append(f"| {t.target} | {t.inputs} | {t.seconds:.1f} | {t.inputs / max(t.seconds, 1e-9):.0f} | "
                    f"{t.crashes} | {t.hangs} | {top} |")
    return "\n".join(rows)


def setup(names: list[str], seed: int) -> tuple[CoderEnv | None, ServerEnv | None]:
    """The environments the targets ``names`` need (the shipped checkpoint; the
    embedded model for the sidecars)."""
    from speckv.coder.codec import Codec, CodecConfig
    from speckv.predictor.checkpoint import load_checkpoint
    from speckv.predictor.store import default_checkpoint_dir

    ck = load_checkpoint(default_checkpoint_dir())
    coder_env = server_env = None
    if any(t in CODER_TARGETS for t in names):
        codec = Codec.from_checkpoint(  # every residual model; streams use the default (model 2)
            ck, CodecConfig(elems_per_lane=16, layers_per_chunk=10, threads=1, coder="numpy"))
        coder_env = CoderEnv(codec, seed)
    if any(t in SERVER_TARGETS for t in names):
        from speckv.predictor.predict import Predictor
        from speckv.predictor.target import load_target

        target = load_target()
        server_env = ServerEnv(Predictor.from_checkpoint(ck, target), target, seed)
    return coder_env, server_env


def quiet() -> None:
    """ERROR records reach the error tap; stderr shows only CRITICAL ones."""
    logging.basicConfig(level=logging.ERROR)
    for h in logging.getLogger().handlers:
        h.setLevel(logging.CRITICAL)
    logging.getLogger().setLevel(logging.ERROR)
    warnings.simplefilter("ignore", RuntimeWarning)  # NaN/Inf arithmetic on purpose


def worker(names: list[str], per_target: int, seed: int, job: int, jobs: int) -> list[dict]:
    """Inputs ``[job * n / jobs, (job + 1) * n / jobs)`` of every target, in this process."""
    quiet()
    t0 = time.perf_counter()
    coder_env, server_env = setup(names, seed)
    print(f"[job {job}] setup {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    lo, hi = job * per_target // jobs, (job + 1) * per_target // jobs
    out = []
    try:
        for name in names:
            env = coder_env if name in CODER_TARGETS else server_env
            print(f"[job {job}] {name}: inputs {lo}..{hi - 1}", file=sys.stderr, flush=True)
            out.append(run_target(name, env, hi - lo, seed, start=lo).as_state())
    finally:
        if server_env is not None:
            server_env.close()
    return out
