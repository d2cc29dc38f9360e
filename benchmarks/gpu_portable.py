"""The portable rung on a GPU, for a lent CUDA machine (a few minutes): is mu the CPU's bits, and
what does it cost there against the target prefill and the FP8 copy?

Builds the portable rung's weights from the embedded target (no calibration needed for mu), runs
mu of ``--tokens`` tokens of ``--text`` on the CPU and on ``--device``, compares the sha256 of the
BF16 bits, and times each (median of ``--repeats``) next to the target prefill and the FP8 copy on
the same device. ``--device cpu`` runs the same logic here (a smoke run; the digests then agree
trivially). Prints one JSON object.

Usage: python benchmarks/gpu_portable.py [--device cuda] [--tokens 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

TEXT = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "tinyshakespeare.txt"


def timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> tuple[Any, float]:
    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--text", default=str(TEXT))
    a = ap.parse_args()
    import torch

    from speckv.predictor.check import mu_digest
    from speckv.predictor.ladder import Rung
    from speckv.predictor.portable import build_portable_model, portable_kv
    from speckv.predictor.predict import build_model, predictor_kv, rung_state
    from speckv.predictor.target import load_target

    target = load_target()
    ids = target.tokenize(Path(a.text).read_text(encoding="utf-8", errors="replace"), a.tokens)
    model = build_portable_model(target.config, rung_state(target.state, Rung("portable"), target.config))
    cpu_mu, cpu_s = timed(lambda: portable_kv(model, ids), 1, lambda: None)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    if a.device.startswith("cuda"):
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    model.to(a.device)
    dev_mu, dev_s = timed(lambda: portable_kv(model, ids), a.repeats, sync)
    fp8 = build_model(target.config, rung_state(target.state, Rung("fp8")), Rung("fp8")).to(a.device)
    _, fp8_s = timed(lambda: predictor_kv(fp8, ids), a.repeats, sync)
    target.model.to(a.device)
    _, target_s = timed(lambda: target.kv(ids), a.repeats, sync)
    print(json.dumps({
        "device": a.device, "name": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "tokens": int(len(ids)), "cpu_mu_sha256": mu_digest(cpu_mu), "device_mu_sha256": mu_digest(dev_mu),
        "agree": mu_digest(cpu_mu) == mu_digest(dev_mu), "cpu_portable_s": round(cpu_s, 3),
        "portable_s": round(dev_s, 4), "fp8_copy_s": round(fp8_s, 4), "target_s": round(target_s, 4),
        "portable_cost": round(dev_s / target_s, 3), "fp8_copy_cost": round(fp8_s / target_s, 3)}))


if __name__ == "__main__":
    main()
