"""Loading the scripts under benchmarks/ (not a package) as modules for their tests."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str, module: str | None = None) -> ModuleType:
    """benchmarks/<name>.py as a fresh module (its folder on sys.path for sibling imports)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(module or f"speckv_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def load_script() -> Callable[..., ModuleType]:
    """``load_script(name)``: benchmarks/<name>.py as a module."""
    return _load
