"""The import graph of the speckv package: no cycles, and imports run downward only.

Every import counts, wherever it sits: module level, inside a function, or under
``if TYPE_CHECKING`` (a cycle hidden behind a function-level import is still a cycle).
The layers, bottom to top (README, "Layout")::

    vocabulary  speckv.{errors,kv,digests,status,wire,paths}, speckv.v1 (generated stubs)
    coder       speckv.coder      the integer coder (numpy; no torch at import)
    predictor   speckv.predictor  target model, checkpoint, calibration (torch)
    server      speckv.server     the sidecars
    cli         speckv.cli        commands, demo, bench (may import anything)

and beside them ``speckv.client`` (the SDK and engine adapters), which imports the
vocabulary alone, and which only the cli imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"vocabulary": 0, "coder": 1, "predictor": 2, "server": 3, "cli": 4}
HEAVY = ("torch", "transformers", "cupy")


def package_dirs() -> dict[str, Path]:
    """speckv subpackages -> their folders, from pyproject's package-dir (generated stubs left out)."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {pkg: REPO / d for pkg, d in cfg.items() if pkg != "speckv.v1"}


def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    dirs = package_dirs()
    for pkg, d in dirs.items():
        for f in sorted(d.glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The speckv modules ``name`` imports anywhere in its source."""
    is_pkg = path.stem == "__init__"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # speckv.coder.codec.Codec -> speckv.coder.codec
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) >= 2 and parts[1] in ("coder", "predictor", "server", "cli", "client"):
        return parts[1]
    return "vocabulary"


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, dsts in sorted(g.items()):
        ls = layer(src)
        for dst in sorted(dsts):
            ld = layer(dst)
            if ld == "client":
                ok = ls in ("client", "cli")
            elif ls == "client":
                ok = ld == "vocabulary"
            else:
                ok = LAYERS[ld] <= LAYERS[ls]
            if not ok:
                bad.append(f"{src} ({ls}) imports {dst} ({ld})")
    return bad


def test_the_graph_covers_every_layer():
    g = graph()
    assert {layer(m) for m in g} == set(LAYERS) | {"client"}
    assert len(g) > 40
    # the parser sees function-level and relative imports (the checks below rely on it)
    assert "speckv.coder.container" in g["speckv.coder.codec"]
    assert "speckv.predictor.portable" in g["speckv.predictor.check"]  # inside main()


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_imports_run_downward_only():
    assert violations(graph()) == []


def test_the_checks_can_fail():
    """A cycle and an upward import, planted in a copy of the real graph, are both found."""
    g = graph()
    g["speckv.coder.rans"] = g["speckv.coder.rans"] | {"speckv.coder.codec"}
    g["speckv.client.client"] = g["speckv.client.client"] | {"speckv.server.app"}
    g["speckv.coder.tables"] = g["speckv.coder.tables"] | {"speckv.predictor.store"}
    assert any("speckv.coder.rans" in c and "speckv.coder.codec" in c for c in cycles(g))
    v = violations(g)
    assert "speckv.client.client (client) imports speckv.server.app (server)" in v
    assert "speckv.coder.tables (coder) imports speckv.predictor.store (predictor)" in v


@pytest.mark.parametrize("module", ["speckv", "speckv.client.client", "speckv.client.pd", "speckv.wire",
                                    "speckv.status", "speckv.coder.codec", "speckv.coder.backends",
                                    "speckv.coder.native"])
def test_light_modules_never_import_torch_transformers_or_cupy(module):
    code = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ""
