"""Run ``speckv bench`` for BF16 and FP8 KV and write one JSON report.

Usage: .venv/bin/python benchmarks/coder_bench.py [--tokens 2048] [--out bench.json]
The defaults match the issue's acceptance run: tinyshakespeare (if
../shared/corpus is present), 2048 tokens, the default pinned predictor.
"""

from __future__ import annotations

import argparse
import json

from speckv.cli.bench import print_report, run_bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text", default=None)
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args()
    reports = {}
    for dtype in ("bf16", "fp8"):
        reports[dtype] = run_bench(args.text, args.tokens, dtype)
        print_report(reports[dtype])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    main()
