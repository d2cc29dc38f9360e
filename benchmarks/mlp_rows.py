"""The W8A8 pass's MLP chunk length (``w8a8_pass.MLP_ROWS``): pass time and peak memory per setting.

Loads the shipped checkpoint as a sidecar does, takes ``--tokens`` tokens of Tiny Shakespeare
and, alternately for ``--repeats`` rounds, runs one ``Predictor.stream`` pass per ``--rows``
value. Reported per value: the median pass seconds, the ratio to the largest value's, and the
pass's peak RSS above the RSS before it (VmHWM reset through /proc/self/clear_refs, the heap
trimmed first). Every setting's layers are compared bit for bit with the first's; exit status 1
if any differs.

    .venv/bin/python benchmarks/mlp_rows.py --tokens 2048 --rows 512 1024 4096 --repeats 3 --json

NOTE: the process's first pass pays one-time costs (thread pools, library pages); a 64-token
pass runs before any timing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from typing import Any

import numpy as np
from predictor_batch import prompts  # benchmarks/ (the script's own folder)


def _status_mib(field: str) -> float:
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


def one_pass(pred: Any, ids: np.ndarray) -> tuple[float, float, list[bytes]]:
    """(seconds, peak MiB above the start, each layer's bytes) of one stream pass."""
    from speckv.heap import release_free

    release_free()
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    start, layers = _status_mib("VmRSS"), []
    t0 = time.perf_counter()
    pred.stream(ids, lambda _i, b: layers.append(b.tobytes()))
    return time.perf_counter() - t0, _status_mib("VmHWM") - start, layers


def measure(tokens: int, rows: list[int], repeats: int) -> dict[str, Any]:
    from speckv.predictor import w8a8_pass
    from speckv.predictor.checkpoint import load_checkpoint
    from speckv.predictor.predict import Predictor
    from speckv.predictor.store import default_checkpoint_dir
    from speckv.predictor.weights import derivation_source

    pred = Predictor.from_checkpoint(load_checkpoint(default_checkpoint_dir()), derivation_source())
    ids = prompts(1, tokens, seed=0)[0][:tokens]
    pred.stream(ids[:64], lambda _i, _b: None)
    times: dict[int, list[float]] = {r: [] for r in rows}
    peaks: dict[int, list[float]] = {r: [] for r in rows}
    want, equal = None, True
    for _ in range(repeats):
        for r in rows:
            w8a8_pass.MLP_ROWS = r
            sec, peak, layers = one_pass(pred, ids)
            times[r].append(sec)
            peaks[r].append(peak)
            want = layers if want is None else want
            equal &= layers == want
    base = statistics.median(times[max(rows)])
    out = [{"rows": r, "pass_s": statistics.median(times[r]), "vs_largest": statistics.median(times[r]) / base,
            "peak_above_start_mib": statistics.median(peaks[r])} for r in rows]
    return {"tokens": len(ids), "repeats": repeats, "rows": out, "bits_equal": equal}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = measure(args.tokens, args.rows, args.repeats)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for row in res["rows"]:
            print(f"MLP_ROWS {row['rows']:5d}: {row['pass_s']:.2f} s ({row['vs_largest']:.2f}x), "
                  f"peak +{row['peak_above_start_mib']:.0f} MiB")
        print(f"{res['tokens']} tokens, bits equal: {res['bits_equal']}")
    return 0 if res["bits_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
