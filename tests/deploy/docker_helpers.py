"""Reading the Dockerfiles without a Docker engine: instructions, stages, and the build
context that their COPY instructions take from the repository."""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "docker").glob("Dockerfile*"))
CPU_LOCK = REPO / "docker" / "cpu.lock.txt"
DEMO_LOCK = REPO / "docker" / "demo.lock.txt"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments): comment lines dropped (as Docker does, inside continuations too,
    and a comment's trailing backslash continues nothing), then continuation lines joined."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@dataclass
class Stage:
    name: str
    base: str  # an image reference or an earlier stage's name
    body: list[tuple[str, str]] = field(default_factory=list)

    def args(self, kind: str) -> list[str]:
        return [a for i, a in self.body if i == kind]


def stages(path: Path) -> list[Stage]:
    """The build stages in file order; each FROM must name its stage (FROM base AS name)."""
    out: list[Stage] = []
    for kind, args in instructions(path):
        if kind == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+([\w.-]+)", args, re.IGNORECASE)
            assert m, f"unnamed stage in {path.name}: FROM {args}"
            out.append(Stage(m.group(2), m.group(1)))
        elif out:
            out[-1].body.append((kind, args))
    return out


def stage(path: Path, name: str) -> Stage:
    (found,) = [s for s in stages(path) if s.name == name]
    return found


def context_copies(path: Path) -> list[str]:
    """Every source path that a COPY takes from the build context (not --from a stage)."""
    out = []
    for kind, args in instructions(path):
        if kind == "COPY" and not args.startswith("--from="):
            out += [a for a in args.split()[:-1] if not a.startswith("--")]
    return out


def copy_context(path: Path, dest: Path) -> Path:
    """Exactly the files the Dockerfile COPYs from the context, laid out as in the image."""
    for item in context_copies(path):
        src = REPO / item.rstrip("/")
        target = dest / item.rstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy(src, target)
    return dest
