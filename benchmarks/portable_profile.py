"""The portable rung, in detail: how close its mu is to the target's KV (against the FP8 copy's,
layer by layer) and where its time goes (cProfile of one forward, by native stage and torch op).

Weights come from the embedded target (no calibration: mu does not depend on it). Prints one JSON
object: ``rel_error`` per layer ``{"portable": [K, V], "fp8": [K, V]}`` (||mu - kv|| / ||kv||) at
``--error-tokens``, and ``profile`` (seconds by function, the top ``--top``) of one forward at
``--tokens``, with the total.

Usage: python benchmarks/portable_profile.py [--tokens 2048] [--error-tokens 256] [--top 8]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

TEXT = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "tinyshakespeare.txt"


def rel_errors(mu, kv) -> list[list[float]]:  # type: ignore[no-untyped-def]
    d = (mu.double() - kv.double())
    return [[round(float(d[i, j].norm() / kv[i, j].double().norm()), 4) for j in (0, 1)] for i in range(kv.shape[0])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--error-tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--text", default=str(TEXT))
    a = ap.parse_args()
    from speckv.predictor.ladder import Rung
    from speckv.predictor.portable import build_portable_model, portable_kv
    from speckv.predictor.predict import build_model, predictor_kv, rung_state
    from speckv.predictor.target import load_target

    target = load_target()
    text = Path(a.text).read_text(encoding="utf-8", errors="replace")
    model = build_portable_model(target.config, rung_state(target.state, Rung("portable"), target.config))
    fp8 = build_model(target.config, rung_state(target.state, Rung("fp8")), Rung("fp8"))
    ids = target.tokenize(text, a.error_tokens)
    kv = target.kv(ids)
    errors = {"portable": rel_errors(portable_kv(model, ids), kv), "fp8": rel_errors(predictor_kv(fp8, ids), kv)}
    ids = target.tokenize(text, a.tokens)
    portable_kv(model, ids[:64])  # warm-up
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(portable_kv, model, ids)
    total = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(((v[2], f"{Path(k[0]).name}:{k[2]}") for k, v in stats.items()), reverse=True)[: a.top]
    print(json.dumps({"tokens": int(len(ids)), "error_tokens": a.error_tokens, "total_s": round(total, 3),
                      "profile": {name: round(s, 3) for s, name in rows}, "rel_error": errors}))


if __name__ == "__main__":
    main()
