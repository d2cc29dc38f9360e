"""Fuzzing of the speckv parsers, codec and sidecars: the command line of the
``fuzzing`` package beside this file (its docstring lists the targets and what
each must satisfy).

Usage::

    .venv/bin/python benchmarks/fuzz.py [--per-target 10000] [--jobs 2] [--seed 0] [--targets a,b] [--json out.json]
    .venv/bin/python benchmarks/fuzz.py --replay TARGET:INDEX

Exit status 1 if anything was found.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzzing.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
