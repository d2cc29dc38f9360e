"""The command line: run every target's inputs over worker processes and report,
or replay one input."""

from __future__ import annotations

import argparse
import json
import time

from .findings import Finding
from .runner import CODER_TARGETS, TARGETS, USAGE, Tally, input_rng, quiet, setup, table, worker


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-target", type=int, default=10_000, help="inputs per target (default 10000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes, each with its own sidecars; "
                    "every target's inputs are split between them (default 2)")
    ap.add_argument("--replay", default=None, help="TARGET:INDEX: run that one input and print its outcome")
    ap.add_argument("--json", default=None, help="write the full report (outcomes, examples) to this file")
    return ap


def replay(name: str, index: int, seed: int) -> int:
    """Run input ``index`` of target ``name`` alone and print its outcome or finding."""
    coder_env, server_env = setup([name], seed)
    env = coder_env if name in CODER_TARGETS else server_env
    try:
        print(TARGETS[name](env, input_rng(seed, name, index)))
        return 0
    except Finding as f:
        print(f"FINDING {f}")
        return 1
    finally:
        if server_env is not None:
            server_env.close()


def run_all(names: list[str], per_target: int, seed: int, jobs: int) -> list[Tally]:
    """Every target's inputs split over ``jobs`` worker processes (spawned)."""
    if jobs == 1:
        results = [worker(names, per_target, seed, 0, 1)]
    else:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(jobs) as pool:
            results = pool.starmap(worker, [(names, per_target, seed, j, jobs) for j in range(jobs)])
    return [Tally.merge([r[k] for r in results]) for k in range(len(names))]


def report(tallies: list[Tally], seconds: float, jobs: int, seed: int) -> None:
    print(table(tallies))
    print(f"\ntotal {sum(t.inputs for t in tallies)} inputs in {seconds:.0f} s wall ({jobs} jobs, seed {seed}); "
          f"time (s) above is the sum over the jobs")
    for t in tallies:
        for h in t.health.get("jobs", []):
            print(f"{t.target} after (job {h['job']}): {json.dumps({k: v for k, v in h.items() if k != 'job'})}")
        for sig, n in t.signatures.most_common(8):
            print(f"{t.target}: {n} x {sig}")
        for kind, ex in t.examples.items():
            print(f"{t.target}: first {kind}: {ex[0]}")


def main(argv: list[str] | None = None) -> int:
    """The command line; exit status 1 if anything was found."""
    ap = parser()
    args = ap.parse_args(argv)
    quiet()
    names = [args.replay.split(":")[0]] if args.replay else [t for t in args.targets.split(",") if t]
    unknown = [t for t in names if t not in TARGETS]
    if unknown:
        ap.error(f"unknown targets {unknown}; known: {list(TARGETS)}")
    if args.replay:
        return replay(names[0], int(args.replay.split(":")[1]), args.seed)
    t0 = time.perf_counter()
    jobs = max(1, min(args.jobs, args.per_target))
    tallies = run_all(names, args.per_target, args.seed, jobs)
    total = time.perf_counter() - t0
    report(tallies, total, jobs, args.seed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "per_target": args.per_target, "jobs": jobs, "seconds": round(total, 1),
                       "targets": [t.as_dict() for t in tallies]}, f, indent=1)
    return 1 if any(t.findings for t in tallies) else 0
