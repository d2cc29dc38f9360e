#!/usr/bin/env python3
"""Regenerate the Python gRPC stubs of the speckv API from ``proto/speckv/v1/*.proto``.

Usage (from the repository root, with the project venv)::

    .venv/bin/python proto/generate.py              # writes proto/gen (committed)
    .venv/bin/python proto/generate.py --out DIR    # writes DIR instead

It runs ``python -m grpc_tools.protoc -Iproto --python_out=OUT
--grpc_python_out=OUT --pyi_out=OUT proto/speckv/v1/*.proto`` and then makes
the output a relocatable Python package:

* protoc writes cross-file imports as absolute ``from speckv.v1 import
  common_pb2``; they are rewritten to ``from . import common_pb2``, so
  ``OUT/speckv/v1`` works under any package name;
* ``OUT/speckv/v1/__init__.py`` is written; ``OUT/speckv`` gets no
  ``__init__.py`` (a namespace directory), so it never shadows the project's
  own ``speckv`` package.

How to import the stubs: the proto package is ``speckv.v1``, which lives
inside the project's ``speckv`` Python package. Either map it when packaging
(pyproject ``package-dir``: ``"speckv.v1" = "proto/gen/speckv/v1"``, then
``from speckv.v1 import decoder_pb2``), or put ``proto/gen`` on ``sys.path``
and extend the ``speckv`` package path (``speckv.__path__`` must include
``proto/gen/speckv``, as ``pkgutil.extend_path`` does). ``tests/test_proto.py``
does the latter.

The output is deterministic for a given grpcio-tools version (the stubs embed
it); ``tests/test_proto.py`` regenerates into a temporary directory and
compares byte for byte with the committed ``proto/gen``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
DEFAULT_OUT = PROTO_ROOT / "gen"
PACKAGE_DIR = Path("speckv") / "v1"
# The committed stubs were generated with this grpcio-tools version; another
# version writes other version checks into the stubs.
GRPCIO_TOOLS_VERSION = "1.85.1"
GENERATED_GLOBS = ("*_pb2.py", "*_pb2_grpc.py", "*_pb2.pyi")
INIT_TEXT = '''"""Generated gRPC/protobuf stubs of the speckv API, package speckv.v1.

Do not edit: regenerate with ``python proto/generate.py``.
"""
'''
_ABSOLUTE_IMPORT = re.compile(r"^from speckv\.v1 import (\w+_pb2)\b", re.MULTILINE)


def proto_files() -> list[str]:
    """The .proto files of the API, relative to ``proto/``, sorted."""
    return sorted(p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def grpcio_tools_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def generate(out: Path) -> list[Path]:
    """Generate the stubs into ``out``; returns the files written, sorted."""
    out = Path(out).resolve()
    pkg = out / PACKAGE_DIR
    pkg.mkdir(parents=True, exist_ok=True)
    for pattern in GENERATED_GLOBS:  # no stale stubs of removed .proto files
        for stale in pkg.glob(pattern):
            stale.unlink()
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc", "-I.",
        f"--python_out={out}", f"--grpc_python_out={out}", f"--pyi_out={out}",
        *proto_files(),
    ]
    subprocess.run(cmd, cwd=PROTO_ROOT, check=True)
    written = []
    for pattern in GENERATED_GLOBS:
        for path in pkg.glob(pattern):
            text = path.read_text(encoding="utf-8")
            fixed = _ABSOLUTE_IMPORT.sub(r"from . import \1", text)
            if fixed != text:
                path.write_text(fixed, encoding="utf-8")
            written.append(path)
    init = pkg / "__init__.py"
    init.write_text(INIT_TEXT, encoding="utf-8")
    written.append(init)
    return sorted(written)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output root (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    installed = grpcio_tools_version()
    if installed != GRPCIO_TOOLS_VERSION:
        print(f"warning: grpcio-tools {installed} installed; committed stubs use {GRPCIO_TOOLS_VERSION}",
              file=sys.stderr)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
