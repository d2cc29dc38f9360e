"""benchmarks/gpu_check.py on a CPU-only machine: the script's logic (deterministic
inputs, coder arguments, digests, identity bookkeeping) runs with the native coder
standing in for the device, and its digests must equal the committed
benchmarks/gpu_check_digests.json, so a change to the stream bytes (or to the inputs)
cannot slip past the file a GPU machine checks against.
The device path runs too, on the CPU's warp emulator (tests/cuda_emu.py): the CUDA kernels' logic,
not their speed; tests/coder/test_cuda_source.py compiles them with nvcc."""
from __future__ import annotations

import json

import numpy as np
import pytest
from require import missing

from speckv.coder import native


@pytest.fixture(scope="module")
def gpu_check(load_script):
    if not native.available():
        missing("NATIVE", f"the native coder is not built ({native.IMPORT_ERROR})")
    return load_script("gpu_check", "gpu_check")


def test_native_run_matches_committed_digests(gpu_check):
    rep = gpu_check.run("native", repeats=1, speed=False)
    want = json.loads(gpu_check.DIGESTS.read_text())
    assert set(rep["cases"]) == set(want)
    for name, r in rep["cases"].items():
        assert r["digest"] == want[name], name
        assert r["streams_equal"] and r["mu_equal"] and r["gpu_to_cpu"] and r["cpu_to_gpu"], name
    assert rep["digests_match"] and rep["ok"]


def test_inputs_are_deterministic(gpu_check):
    for fp8 in (False, True):
        a, b = gpu_check.synth(5, 2, 9, fp8), gpu_check.synth(5, 2, 9, fp8)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert gpu_check.synth(5, 2, 9, True)["x"].dtype == np.uint8


def test_digest_sees_every_field(gpu_check):
    from speckv.coder.native import EncodedChunk
    from speckv.coder.rans import RansBlocks

    base = RansBlocks(np.full((1, 32), 1 << 16, np.uint32), np.zeros(1, np.uint32), np.zeros(0, np.uint16))
    d0 = gpu_check.stream_digest([EncodedChunk(base, b"\x01")])
    assert d0 != gpu_check.stream_digest([EncodedChunk(base, b"\x02")])
    other = RansBlocks(base.states + 1, base.word_counts, base.words)
    assert d0 != gpu_check.stream_digest([EncodedChunk(other, b"\x01")])


@pytest.mark.parametrize("fp8", [False, True])
def test_throughput_codes_and_decodes_both_dtypes(gpu_check, fp8):
    """The throughput cases run (here on the native coder, no kernel profile): the KV round-trips,
    FP8 KV is one byte a scalar, and shorter lanes cost state bytes."""
    models = gpu_check.load_models()
    dev = gpu_check.Device("native")
    reps = {epl: gpu_check.throughput(dev, models["tuned"], 2, 96, 1, 1, epl, fp8=fp8) for epl in (8, 1024)}
    for r in reps.values():
        assert r["decode_correct"] and r["dtype"] == ("fp8" if fp8 else "bf16") and "encode_profile_ms" not in r
        assert r["raw_mb"] == 2 * 2 * 3 * 96 * 64 * (1 if fp8 else 2) / 1e6 and r["encode_gb_s"] > 0
    assert reps[8]["bits_per_scalar"] > reps[1024]["bits_per_scalar"] + 0.5
    assert {name for name, *_ in gpu_check.THROUGHPUT} >= {"streaming", "batched", "requests4", "batched_fp8"}


def test_cuda_path_on_the_emulated_device(gpu_check, emu_work):
    """The script's device path (CuPy arrays, encode_streams, kernel profiles) on the CPU's warp emulator
    (tests/cuda_emu.py) in place of a GPU: the committed digests, identity with the native coder both
    ways, and one profiled throughput case, so a lent device's minutes are not spent on the script."""
    from cuda_emu import emulated_cupy

    from speckv.coder.cuda import KERNELS, CudaCoder

    dev = gpu_check.Device("native")
    cp = emulated_cupy(emu_work)
    dev.name, dev.xp, dev.coder = "cuda", cp, CudaCoder(cp, empty_pinned=np.empty)
    models = gpu_check.load_models()
    cases = gpu_check.check_all(dev, models)
    want = json.loads(gpu_check.DIGESTS.read_text())
    for name, r in cases.items():
        assert r["digest"] == want[name], name
        assert r["streams_equal"] and r["mu_equal"] and r["gpu_to_cpu"] and r["cpu_to_gpu"], name
    r = gpu_check.throughput(dev, models["tuned"], 2, 96, 1, 1, 64)
    assert r["decode_correct"] and r["encode_kept_gb_s"] > 0 and r["decode_kept_gb_s"] > 0
    assert r["host_correct"] and r["encode_host_gb_s"] > 0 and r["decode_host_gb_s"] > 0  # a sidecar's calls
    ran = set(r["encode_profile_ms"]) | set(r["decode_profile_ms"])
    assert ran == {k for k in KERNELS if not k.endswith("_fp8")} - {"spk_prepare_mu"} | {"wall"}  # BF16 KV


def test_host_calls_check_what_they_time(gpu_check, emu_work, monkeypatch):
    """A sidecar's calls (host arrays in and out) are timed only as checked: a decode whose copy to the
    host loses the KV, or an encode writing other streams, reads as not correct (and fails ``ok``)."""
    from cuda_emu import emulated_cupy

    from speckv.coder.cuda import CudaCoder

    dev = gpu_check.Device("native")
    cp = emulated_cupy(emu_work)
    dev.name, dev.xp, dev.coder = "cuda", cp, CudaCoder(cp, empty_pinned=np.empty)
    model = gpu_check.load_models()["tuned"]
    L = gpu_check.levels(model, 2, None)
    data = gpu_check.typical(3, L, 40)
    args = (data["x"], data["mu"], L, [2], 64)
    parts = dev.coder.encode(*args, model.tables)
    assert gpu_check.host_calls(dev, model, args, parts, 1)["correct"]
    other = dev.coder.encode(data["x"] ^ np.uint16(1), *args[1:], model.tables)
    assert not gpu_check.host_calls(dev, model, args, other, 1)["correct"]
    monkeypatch.setattr(dev.coder, "copy_out", lambda d, out: out.fill(0))
    assert not gpu_check.host_calls(dev, model, args, parts, 1)["correct"]


def test_sweep_times_each_tuning_and_compares_its_streams(gpu_check, emu_work, monkeypatch):
    """``--sweep`` on the emulated device: every tuning of the sweep builds its own kernels (its -D
    flags), codes each case losslessly with the defaults' streams, and reports figures and a floor."""
    from cuda_emu import emulated_cupy

    from speckv.coder import cuda, cuda_tuning

    tunings = (cuda_tuning.Tuning(), cuda_tuning.Tuning(rans_warps=2, model_cta=96, ahead=5, word_window=True))
    monkeypatch.setattr(cuda_tuning, "SWEEP", tunings)
    built = []

    def make(t):
        dev = gpu_check.Device("native")
        cp = emulated_cupy(emu_work)
        dev.name, dev.xp, dev.coder = "cuda", cp, cuda.CudaCoder(cp, empty_pinned=np.empty, tuning=t)
        built.append(dev.coder.tuning)
        return dev

    rows = gpu_check.sweep(gpu_check.load_models(), 1, 100.0, (("one", 2, 40, 1), ("two", 2, 40, 2)), make)
    assert built == list(tunings) and [r["tuning"]["ahead"] for r in rows] == [8, 5]
    for r in rows:
        assert r["same_streams"] and set(r["cases"]) == {"one", "two"}
        for t in r["cases"].values():
            assert t["decode_correct"] and 0 < t["encode_gb_s"] and t["floor_gb_s"] > 0
    one = rows[0]["cases"]["one"]
    # the floor: 2 x 100 GB/s over KV, mu, L and the streams
    moved = 2 * one["raw_mb"] * 1e6 + 2 * 2 * 3 * 64 * 4 + one["bits_per_scalar"] / 8 * one["raw_mb"] * 1e6 / 2
    assert abs(one["floor_gb_s"] - one["raw_mb"] * 1e6 / (moved / 200e9) / 1e9) < 1e-6 * one["floor_gb_s"]


def test_device_check_names_tests_that_exist():
    """benchmarks/device_check.sh's sanitize step names test ids (a lent device's minutes are few):
    each must collect here, where the device half is collected and skipped."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    text = (root / "benchmarks" / "device_check.sh").read_text()
    prefix = dict(re.findall(r"(\w)='(tests/[^']+)'", re.search(r"local (t=.+)", text).group(1)))
    ids = [prefix[v] + m for v, m in re.findall(r'"\$\{(\w)\}(\w+\[[^\]]+\])"', text)]
    assert len(ids) == 6
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and f"{len(ids)} tests collected" in out.stdout, out.stdout + out.stderr


def test_mixed_prompts_in_one_call(gpu_check, emu_work):
    """Prompts of other lengths (here 5, 40 and 1 tokens): on the emulated device in one launch a pass
    (``encode_batch``), each prompt's streams as its own call's, all decoded bit for bit; on the native
    coder, a call a prompt both ways."""
    from cuda_emu import emulated_cupy

    from speckv.coder.cuda import CudaCoder

    model = gpu_check.load_models()["tuned"]
    emu = gpu_check.Device("native")
    cp = emulated_cupy(emu_work)
    emu.name, emu.xp, emu.coder = "cuda", cp, CudaCoder(cp, empty_pinned=np.empty)
    for dev in (gpu_check.Device("native"), emu):
        r = gpu_check.mixed_requests(dev, model, 1, tokens=(5, 40, 1), layers=3, epl=16)
        assert r["same_streams_as_alone"] and r["decode_correct"], dev.name
        assert r["raw_mb"] == 3 * 2 * 3 * 46 * 64 * 2 / 1e6 and r["encode_gb_s"] > 0 and r["decode_gb_s"] > 0


def test_queued_callers_share_launches(gpu_check, emu_work):
    """Concurrent callers through QueuedCuda on the emulated device: every call's streams as the coder's
    own and its KV back; the figures of both ways."""
    from cuda_emu import emulated_cupy

    from speckv.coder.cuda import CudaCoder

    dev = gpu_check.Device("native")
    cp = emulated_cupy(emu_work)
    dev.name, dev.xp, dev.coder = "cuda", cp, CudaCoder(cp, empty_pinned=np.empty)
    r = gpu_check.queued_streaming(dev, gpu_check.load_models()["tuned"], 1, callers=3, tokens=24)
    assert r["same_streams"] and r["decode_correct"] and 1 <= r["launches_first_round"] <= 6
    assert r["raw_mb"] == 3 * 2 * 2 * 3 * 24 * 64 * 2 / 1e6 and r["queued_gb_s"] > 0 and r["serial_gb_s"] > 0


def test_report_prints_every_figure(gpu_check, monkeypatch, capsys):
    """main()'s table of a device run (its report made up here): a misspelt key would cost a lent
    device's run its summary."""
    tp = {"encode_gb_s": 1.0, "encode_kept_gb_s": 2.0, "encode_host_gb_s": 0.5, "decode_gb_s": 3.0,
          "decode_kept_gb_s": None, "decode_host_gb_s": 0.25, "floor_gb_s": 9.0, "raw_mb": 3.1, "bits_per_scalar": 5.4,
          "encode_profile_ms": {"wall": 1.0}}
    rep = {"cases": {}, "digests_match": True, "ok": True, "copy_gb_s": 1800.0, "throughput": {"streaming": tp},
           "mixed": {"tokens": [512, 1024], "raw_mb": 10.0, "encode_gb_s": 1.0, "decode_gb_s": 2.0,
                     "one_call_a_prompt_encode_gb_s": 0.5, "one_call_a_prompt_decode_gb_s": 0.4,
                     "same_streams_as_alone": True},
           "queued": {"callers": 8, "raw_mb": 25.2, "queued_gb_s": 3.0, "serial_gb_s": 1.0, "calls_a_launch": 4.0,
                      "same_streams": True},
           "sweep": [{"tuning": {"ahead": 8}, "cases": {"batched": tp}, "same_streams": True}]}
    monkeypatch.setattr(gpu_check, "run", lambda *a, **k: rep)
    monkeypatch.setattr("sys.argv", ["gpu_check.py", "--backend", "native"])
    assert gpu_check.main() == 0
    out = capsys.readouterr().out
    for want in ("| streaming (3.1 MB) | 1.00 | 2.00 | 0.50 | 3.00 | - | 0.25 | 9.00 | 5.40 |",
                 "| ahead=8 | batched | 1.00 | 2.00 | 3.00 | - | 9.00 | True |", "a call a prompt 0.50 / 0.40",
                 "queued 3.00 GB/s (4.0 calls a launch), one after another 1.00", "| ahead=8 | batched |",
                 "overall ok True"):
        assert want in out, out
