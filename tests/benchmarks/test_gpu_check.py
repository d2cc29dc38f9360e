"""benchmarks/gpu_check.py on a CPU-only machine: the script's logic (round trips,
byte-equality bookkeeping, the throughput loop with its correctness check) runs
with the kernels' host build standing in for the CUDA device and numpy for CuPy.
NOTE: this is the GPU substitute the guide allows (no GPU here): it checks the
script, not the CUDA code, which tests/coder/test_rans_kernels.py compiles with
nvcc and whose logic it checks through the host build."""
from __future__ import annotations

import numpy as np
import pytest

from speckv.coder.rans_kernels import HostKernels
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.store import default_checkpoint_dir


@pytest.fixture(scope="module")
def gpu_check(load_script):
    mod = load_script("gpu_check", "gpu_check")
    mod.DEVICE_CODER = "host"
    return mod


@pytest.fixture(scope="module")
def ck():
    return load_checkpoint(default_checkpoint_dir())


def test_adversarial_round_trips_are_byte_equal(gpu_check, ck):
    rep = gpu_check.adversarial(ck, np.random.default_rng(0))
    assert set(rep) == {"bf16_adversarial", "fp8_adversarial"}
    for r in rep.values():
        assert r["streams_equal"] and r["cpu_to_gpu"] and r["gpu_to_cpu"] and r["bytes"] > 0


def test_round_trip_reports_a_difference(gpu_check, ck):
    """The bookkeeping can fail: a device codec with another block geometry writes other bytes."""
    cpu, dev = gpu_check.codecs(ck, epl=64, lpc=3)
    other, _ = gpu_check.codecs(ck, epl=32, lpc=3)
    x = np.random.default_rng(1).integers(0, 1 << 16, (30, 2, 3, 4, 64), dtype=np.uint16)
    r = gpu_check.round_trip(other, dev, x, np.arange(4), x)
    assert r["streams_equal"] is False and r["cpu_to_gpu"] and r["gpu_to_cpu"]


def test_throughput_loop_checks_its_decodes(gpu_check, ck):
    rep = gpu_check.throughput(ck, gb=0.004, inputs=2, repeats=1, steps=64, cp=np, k=HostKernels.load())
    assert rep["decode_correct"] is True
    assert rep["inputs"] == 2 and rep["ops_per_input"] % (64 * 32) == 0
    assert rep["encode_gb_s"] > 0 and rep["decode_gb_s"] > 0 and 0 < rep["bits_per_op"] < 16
