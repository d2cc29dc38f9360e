"""How the encoder's fine sigma steps (coder/adapt.py, issue 17) were chosen: the chooser under four
policies, on 2048 tokens of tinyshakespeare, rungs built as benchmarks/engines.py builds them.

Policies (each the real codec, every stream decoded bit for bit):
  old          the coarse search alone (``FINE_STEP = 0``: a step of 0 never saves)
  grid         the old chooser, then every group's shift + each of -4, -2, 2, 4, 6, 8 (1/8 octaves)
  grid-margin  the same, a candidate taken only where it saves more than ``adapt.FINE_MARGIN``
  shipped      ``adapt.choose_shifts`` as it is: +-2, then 2, 3, 4 steps the same way where one paid

Prints, per rung and policy, FP8 bits an element of the fp8cache engine stand-in's codes (plain mu)
and BF16 bits a scalar of the sidecars' own KV (RESULTS.md, "Quarter-octave sigma steps").

Usage: .venv/bin/python benchmarks/research/fine_sigma_steps.py [--rungs fp8 w8a8 w8a8x:4]  # ~5 min
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # engines.py, ladder.py
import engines as bench_engines  # noqa: E402
from ladder import CachingTarget  # noqa: E402

from speckv.coder import adapt, plan  # noqa: E402

GRID = (-4, -2, 2, 4, 6, 8)
POLICIES = ("old", "grid", "grid-margin", "shipped")


def grid_chooser(margin: tuple[int, int]):
    """The old chooser, then each group's shift + every GRID step, priced on its sample."""
    coarse = adapt.choose_shifts

    def choose(fx, fm, tab, x, mu, log2_sigma, backend=None, base=None):
        out = coarse(fx, fm, tab, x, mu, log2_sigma, backend, base)
        if x.size == 0:
            return out
        tok = adapt.sample_tokens(x.shape[3])
        xs = x[:, :, :, tok].reshape(-1, len(range(*tok.indices(x.shape[3]))), x.shape[4])
        ms = mu[:, :, :, tok].reshape(xs.shape)
        lg = np.asarray(log2_sigma, np.int64).reshape(-1, x.shape[4])
        cur = out.reshape(-1).astype(np.int64)
        s = adapt.Sample(fx, fm, tab, xs, ms, lg, backend)
        cost, _ = adapt._group_costs(fx, fm, tab, xs, ms, lg, cur, backend)  # noqa: SLF001
        best, _ = s.consider(cur, cost, [np.clip(cur + d, -adapt.SHIFT_MAX, adapt.SHIFT_MAX) for d in GRID], margin)
        return best.reshape(out.shape).astype(np.int8)

    return choose


def set_policy(policy: str, shipped_step: int) -> None:
    adapt.FINE_STEP = shipped_step if policy == "shipped" else 0
    chooser = adapt.choose_shifts if policy in ("old", "shipped") else \
        grid_chooser(adapt.FINE_MARGIN if policy == "grid-margin" else (0, 1))
    plan.choose_shifts = chooser  # NOTE: plan.py calls it by this name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rungs", nargs="+", default=["fp8", "w8a8", "w8a8x:4"])
    args = ap.parse_args(argv)
    from speckv.coder.codec import Codec, CodecConfig
    from speckv.predictor.calibrate import read_text
    from speckv.predictor.engines import fp8_cache_attention, fp8_cache_kv
    from speckv.predictor.predict import Predictor
    from speckv.predictor.target import load_target

    build = argparse.Namespace(calib=bench_engines.CORPUS / "wikitext2-valid.txt", calib_tokens=4096)
    target = load_target()
    ids = target.tokenize(read_text(bench_engines.CORPUS / "tinyshakespeare.txt", chars=2048 * 16), 2048)
    same = target.kv(ids)
    fa = fp8_cache_attention(same)
    engine_kv = fp8_cache_kv(target, ids, fa)  # the fp8cache stand-in's KV, coded at its static scales
    shipped_step = adapt.FINE_STEP
    print("| rung | policy | fp8cache FP8 | same-kernel BF16 |\n|---|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for rung in args.rungs:
            ck = bench_engines.checkpoint(rung, target, CachingTarget(target), Path(tmp), build)
            pred = Predictor.from_checkpoint(ck, target)
            mu = pred.mu(ids)
            codec = Codec.from_checkpoint(ck, CodecConfig())
            for policy in POLICIES:
                set_policy(policy, shipped_step)
                bits = [bench_engines.coded_bits(codec, engine_kv, ids, mu, "fp8", fp8_cache=fa),
                        bench_engines.coded_bits(codec, same, ids, mu, "bf16")]
                print(f"| {rung} | {policy} | {bits[0]:.4f} | {bits[1]:.4f} |", flush=True)
    set_policy("shipped", shipped_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
