"""The fused CUDA coder (coder/kernels/spk_fused.cu, coder/cuda.py, coder/cuda_host.py).

Without a GPU: every .cu compiles with nvcc for sm_90 (with --fmad=false and -ftz=true,
as NVRTC builds it through CuPy) and spills no registers; the host-side bookkeeping (geometry, decoder
lookup tables, section layout) is checked in numpy; importing the codec never
imports CuPy. test_cuda_kernels.py runs CudaCoder against NativeCoder byte for byte, on a
device where there is one and on the CPU's warp emulator everywhere.
NOTE: the NVRTC path itself cannot be checked without CuPy (no libnvrtc here)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from require import missing

from speckv.coder import native
from speckv.coder.cuda import source_dir
from speckv.coder.cuda_host import BUCKET_SHIFT, BUCKETS, Geometry, decode_tables, encode_layout
from speckv.coder.cuda_tuning import SWEEP, Tuning


def _nvcc(path, defines=()):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        missing("NVCC", "nvcc not found (the CUDA toolkit is not installed on this machine)")
    # NOTE: -ftz=true as CuPy builds it (it appends that flag to coder/cuda.py's options)
    cmd = [nvcc, "-arch=sm_90", "-Xptxas", "-v", "-std=c++17", "--fmad=false", "-ftz=true", f"-I{source_dir()}",
           *defines, "-c", str(path), "-o", "/dev/null"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


# every .cu as it is; spk_fused.cu also under each tuning gpu_check --sweep times
BUILDS = [(p, ()) for p in sorted(source_dir().glob("*.cu"))] + [
    (source_dir() / "spk_fused.cu", t.defines()) for t in SWEEP[1:] if t.defines() != Tuning().defines()]


@pytest.mark.parametrize("path,defines", BUILDS, ids=lambda v: v.name if isinstance(v, Path) else " ".join(v))
def test_nvcc_compiles_for_sm90_without_spills(path, defines, capsys):
    proc = _nvcc(path, defines)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    assert spills and all(s == ("0", "0") for s in spills), out
    funcs = re.findall(r"Compiling entry function '(\w+)'", out)
    regs = re.findall(r"Used (\d+) registers", out)
    with capsys.disabled():
        regs_of = ", ".join(f"{f} {r} regs" for f, r in zip(funcs, regs, strict=True))
        print(f"\n{path.name} {' '.join(defines)}: {regs_of}, 0 spills")


def test_device_code_has_no_flushing_float32_arithmetic(tmp_path):
    """CuPy builds with -ftz=true, under which float32 arithmetic and compares flush subnormals
    (a lent H200 showed it): spk_model.cuh's float operations run in float64 from the bits instead.
    The PTX keeps only float32 instructions whose flushing changes no result there: ``abs`` +
    ``setp.le`` (isnan), ``min`` before a truncation, conversions of integers and to float32 from
    float64 at normal magnitudes (spk_narrow)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        missing("NVCC", "nvcc not found (the CUDA toolkit is not installed on this machine)")
    ptx = tmp_path / "fused.ptx"
    for path in sorted(source_dir().glob("*.cu")):
        subprocess.run([nvcc, "-arch=sm_90", "-std=c++17", "--fmad=false", "-ftz=true", f"-I{source_dir()}", "-ptx",
                        str(path), "-o", str(ptx)], check=True, timeout=600)
        ops = set(re.findall(r"\b((?:add|sub|mul|div|fma|rcp|sqrt|setp\.\w+)\.[\w.]*f32)\b", ptx.read_text()))
        assert ops <= {"setp.le.ftz.f32"}, (path.name, sorted(ops))


def test_codec_import_never_imports_cupy():
    code = "import sys, speckv.coder.codec, speckv.coder.cuda; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_geometry_blocks_tile_chunks():
    g = Geometry.of(3, 5, 7, 2, [1, 2])  # chunks of 210 and 420 elements, 64 per block
    assert list(g.chunk_blocks) == [4, 7] and list(g.chunk_b0) == [0, 4]
    assert list(g.block_n[:4]) == [64, 64, 64, 18] and g.block_e0[4] == 210 and g.block_n[-1] == 420 - 6 * 64
    assert Geometry.of(3, 0, 7, 2, [1, 2]).n_blocks == 0


def test_geometry_batches_requests_of_other_lengths():
    """Requests one after another (5, 0 and 3 tokens): a request without tokens has chunks without blocks,
    whose sections are empty."""
    g = Geometry.batch(3, 7, 2, [(5, [1, 2]), (0, [1]), (3, [2])])
    assert list(g.req_e0) == [0, 630, 630] and list(g.chunk_n) == [210, 420, 0, 252]
    assert list(g.chunk_blocks) == [4, 7, 0, 4] and list(g.chunk_req) == [0, 0, 1, 2]
    assert list(g.block_req) == [0] * 11 + [2] * 4 and g.block_e0[11] == 630 and g.block_n[-1] == 252 - 3 * 64
    assert g.by_request("abcd") == [["a", "b"], ["c"], ["d"]]
    assert g.same_layout(Geometry.batch(3, 7, 2, [(5, [1, 2]), (0, [1]), (3, [2])]))
    assert not g.same_layout(Geometry.batch(3, 7, 2, [(5, [1, 2]), (3, [2]), (0, [1])]))
    lay = encode_layout(np.full((15, 4), 8, np.uint64), g)  # a byte a block a section
    assert list(lay.chunk_len) == [16, 28, 0, 16] and list(lay.chunk_byte) == [0, 16, 44, 44]
    with pytest.raises(ValueError, match="bad geometry"):
        Geometry.batch(3, 7, 2, [])


def test_decode_tables_find_every_slot(ckpt):
    flat = native.FlatTables.of(ckpt.seed_tables)
    cum_pad, bucket = decode_tables(flat)
    rng = np.random.default_rng(0)
    for t in rng.choice(len(flat.offset), 40, replace=False):
        o, n = int(flat.offset[t]), int(flat.size[t])
        row = cum_pad[o + t:o + t + n + 1]
        assert np.array_equal(row[:n], flat.cum[o:o + n]) and row[n] == 1 << 15
        q = np.arange(BUCKETS) << BUCKET_SHIFT
        assert np.array_equal(bucket[t * BUCKETS:(t + 1) * BUCKETS], np.searchsorted(row[:n], q, "right") - 1)


def test_encode_layout_sections_are_byte_padded_and_aligned():
    g = Geometry.of(1, 1, 32, 1, [1, 1])  # 64 elements: 2 blocks per chunk
    counts = np.array([[3, 7, 16, 5], [9, 0, 0, 4], [1, 2, 3, 4], [0, 0, 0, 0]], np.uint64)
    lay = encode_layout(counts, g)
    assert list(lay.chunk_len) == [2 + 1 + 2 + 2, 1 + 1 + 1 + 1]
    assert list(lay.chunk_byte) == [0, 8]
    assert lay.start[1].tolist() == [3, 16 + 7, 24 + 16, 40 + 5] and lay.start[0].tolist() == [0, 16, 24, 40]


def test_host_launches_the_ctas_the_kernels_are_built_for():
    """coder/cuda.py launches Tuning.model_cta threads a CTA where spk_device.cuh sizes its shared arrays
    and launch bounds by SPK_MODEL_CTA: the two must agree (more threads fail the launch and overrun the
    per-warp shared arrays), by default and through the -D a tuning passes; likewise the lane passes'
    warps and SPK_MAX_CTA."""
    from speckv.coder import cuda

    text = (source_dir() / "spk_device.cuh").read_text()
    m = re.search(r"#define SPK_MODEL_CTA (\d+)", text)
    assert m and int(m.group(1)) == Tuning().model_cta
    m = re.search(r"#define SPK_MAX_CTA (\d+)", text)
    assert m and int(m.group(1)) == 32 * 8
    with pytest.raises(ValueError):
        Tuning(rans_warps=9)
    assert "-DSPK_MODEL_CTA=512" in Tuning(model_cta=512).defines()
    src = cuda.source()
    for k in cuda.CTA_KERNELS:
        assert re.search(rf"__launch_bounds__\(SPK_MODEL_CTA\) {k}\b", src) or re.search(
            rf"__launch_bounds__\(SPK_MODEL_CTA\) {k.rsplit('_', 1)[0]}_##name", src), k
