"""GPU check of the CuPy rANS kernels, for a CUDA machine (one call, < 10 minutes).

1. Round trips with byte-equal streams: numpy (CPU) vs CUDA encode of the same
   input must give identical streams, and each decodes bit-exactly on the other
   backend: adversarial BF16 and FP8 tensors (NaN, Inf, subnormals, signed zeros,
   extremes, random mu) and, when torch + the embedded model are installed, a
   real KV of the embedded model.
2. Throughput of the rANS kernels on device-resident data (CUDA events, warm-up,
   median of repeats, >= --gb GB of raw BF16 KV rotated among --inputs inputs),
   next to the device's measured copy bandwidth. Ops are drawn from the real
   coding tables; every decode is checked against the symbols that were coded.
   NOTE: this times the rANS kernels; the probability model's symbolisation runs
   in numpy on the host in this version.

Usage: python benchmarks/gpu_check.py [--gb 1.0] [--inputs 4] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from speckv.coder.codec import Codec, CodecConfig, Fp8KV
from speckv.coder.rans import LANES
from speckv.coder.rans_kernels import CudaKernels, cuda_available
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.store import default_checkpoint_dir

BF16_SPECIAL = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1,
                         0x3F80, 0xBF80, 0x0080, 0x4049, 0x1234, 0xC2F7], np.uint16)


DEVICE_CODER = "cuda"  # tests/benchmarks/test_gpu_check.py runs this script's logic with "host"


def codecs(ck, epl: int = 1024, lpc: int = 2) -> tuple[Codec, Codec]:
    cfg = dict(elems_per_lane=epl, layers_per_chunk=lpc)
    return (Codec.from_checkpoint(ck, CodecConfig(coder="numpy", **cfg)),
            Codec.from_checkpoint(ck, CodecConfig(coder=DEVICE_CODER, **cfg)))


def _equal(a, b) -> bool:
    if isinstance(a, Fp8KV):
        return np.array_equal(a.codes, b.codes) and np.array_equal(a.scales.view(np.uint32), b.scales.view(np.uint32))
    return np.array_equal(a, b)


def round_trip(cpu: Codec, gpu: Codec, kv, ids, mu) -> dict:
    t0 = time.perf_counter()
    rc, rg = list(cpu.encode(kv, ids, mu)), list(gpu.encode(kv, ids, mu))
    same = rc == rg
    ok_gc = _equal(gpu.decode(rc, ids, mu), kv)  # CPU stream on the GPU
    ok_cg = _equal(cpu.decode(rg, ids, mu), kv)  # GPU stream on the CPU
    return {"streams_equal": same, "cpu_to_gpu": ok_gc, "gpu_to_cpu": ok_cg,
            "bytes": sum(map(len, rc)), "s": round(time.perf_counter() - t0, 2)}


def adversarial(ck, rng) -> dict:
    L, _, H, D = ck.calib.sigma_log2_q.shape
    T = 64
    shape = (L, 2, H, T, D)
    out = {}
    cpu, gpu = codecs(ck, epl=64, lpc=3)
    x = rng.choice(BF16_SPECIAL, shape).astype(np.uint16)
    x.reshape(-1)[::5] = rng.integers(0, 1 << 16, x.size // 5 + (x.size % 5 > 0), dtype=np.uint16)
    mu = rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    mu.reshape(-1)[::3] = x.reshape(-1)[::3]
    ids = np.arange(T, dtype=np.int64)
    out["bf16_adversarial"] = round_trip(cpu, gpu, x, ids, mu)
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes.reshape(-1)[:256] = np.arange(256, dtype=np.uint8)
    scales = rng.uniform(1e-3, 4, (L, 2)).astype(np.float32)
    scales[0, 0] = 0.0  # degenerate scale: mu becomes inf/NaN, escapes
    out["fp8_adversarial"] = round_trip(cpu, gpu, Fp8KV(codes, scales), ids, mu)
    return out


def real_kv(ck, tokens: int) -> dict:
    try:
        from speckv.cli.demo import DEMO_PROMPT
        from speckv.predictor.calibrate import read_text
        from speckv.predictor.predict import Predictor
        from speckv.predictor.target import load_target
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"torch/transformers not importable: {e}"}
    try:
        target = load_target()
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"embedded model unavailable: {e}"}
    pred = Predictor.from_checkpoint(ck, target)
    try:
        text = read_text("../shared/corpus/tinyshakespeare.txt", chars=tokens * 32)
    except OSError:
        text = (DEMO_PROMPT + "\n") * 16
    ids = target.tokenize(text, tokens)
    kv, mu = target.kv(ids), pred.mu(ids)
    cpu, gpu = codecs(ck)
    from speckv.predictor.fp8 import kv_to_fp8

    q, s = kv_to_fp8(kv)
    return {"tokens": int(len(ids)), "bf16": round_trip(cpu, gpu, kv, ids, mu),
            "fp8": round_trip(cpu, gpu, Fp8KV(q.numpy(), s.numpy()), ids, mu)}


def timed(cp, fn, repeats: int) -> float:
    """Median seconds of fn() over repeats, CUDA events (perf_counter when ``cp`` is
    numpy, for the CPU test of this script), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if cp is np:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return statistics.median(times)


def copy_bandwidth(cp, nbytes: int, repeats: int) -> float:
    src = cp.ones(nbytes // 4, cp.uint32)
    dst = cp.empty_like(src)
    t = timed(cp, lambda: dst.__setitem__(slice(None), src), repeats)
    return nbytes / t / 1e9  # bytes copied per second (each read once and written once)


def throughput(ck, gb: float, inputs: int, repeats: int, steps: int = 1024, cp=None, k=None) -> dict:
    """``cp``/``k``: the array module and kernels (CuPy + CudaKernels unless given)."""
    if cp is None:
        import cupy as cp
    k = k or CudaKernels.load()
    g = ck.tables.gauss
    t_dev = k._device_tables(g)
    size = t_dev["size"]
    n_tables = int(size.size)
    ops_per_input = int(gb * 1e9 / 2 / inputs)  # 2 raw bytes (one BF16 scalar) per op
    nb = max(1, ops_per_input // (steps * LANES))
    ops = nb * steps * LANES
    rs = cp.random.RandomState(7)
    data = []
    for _ in range(inputs):
        t = rs.randint(0, n_tables - 1, (nb, steps, LANES)).astype(cp.int32)  # real tables
        j = cp.floor(rs.random_sample((nb, steps, LANES)) * size[t]).astype(cp.int32)
        idx = t_dev["offset"][t] + j
        start = t_dev["cum"][idx].astype(cp.uint32)
        freq = t_dev["freq"][idx].astype(cp.uint32)
        data.append((t, j, start, freq))
    state = {"i": 0}

    def enc():
        _, _, s, f = data[state["i"] % inputs]
        state["i"] += 1
        return k.encode_device(s, f)

    t_enc = timed(cp, enc, repeats)
    coded = [k.encode_device(s, f) for (_, _, s, f) in data]
    ok = True
    for (t, j, _, _), (st, cn, w) in zip(data, coded, strict=True):
        ok &= bool((k.decode_device(st, cn, w, t, steps, g).astype(np.int32) == j).all())
    state["i"] = 0

    def dec():
        i = state["i"] % inputs
        state["i"] += 1
        st, cn, w = coded[i]
        return k.decode_device(st, cn, w, data[i][0], steps, g)

    t_dec = timed(cp, dec, repeats)
    raw = 2 * ops
    wire = statistics.mean(int(w.size) * 2 + int(st.size) * 4 + int(cn.size) * 4 for st, cn, w in coded)
    return {"ops_per_input": ops, "raw_gb_per_input": raw / 1e9, "inputs": inputs, "decode_correct": ok,
            "encode_gb_s": raw / t_enc / 1e9, "decode_gb_s": raw / t_dec / 1e9,
            "bits_per_op": 8 * wire / ops}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="raw GB of KV rotated through per timing")
    ap.add_argument("--inputs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--real-tokens", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not cuda_available():
        print("gpu_check: no CUDA device or CuPy (pip install 'speckv[cuda]')", file=sys.stderr)
        return 2
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(0)
    ck = load_checkpoint(default_checkpoint_dir())
    rep = {"device": props["name"].decode(), "cupy": cp.__version__,
           "cuda_runtime": cp.cuda.runtime.runtimeGetVersion()}
    rep["round_trips"] = adversarial(ck, np.random.default_rng(0))
    rep["real_kv"] = real_kv(ck, args.real_tokens)
    rep["copy_gb_s"] = copy_bandwidth(cp, 1 << 30, args.repeats)
    rep["throughput"] = throughput(ck, args.gb, args.inputs, args.repeats)
    tp = rep["throughput"]
    ok = all(v.get("streams_equal") and v.get("cpu_to_gpu") and v.get("gpu_to_cpu")
             for v in rep["round_trips"].values()) and tp["decode_correct"]
    rep["ok"] = ok
    if args.json:
        print(json.dumps(rep))
    else:
        print(f"device {rep['device']}, CuPy {rep['cupy']}, CUDA runtime {rep['cuda_runtime']}")
        for name, r in {**rep["round_trips"], **{f"real_{k}": v for k, v in rep["real_kv"].items()
                                                 if isinstance(v, dict)}}.items():
            print(f"{name:18s} streams equal {r['streams_equal']}, CPU->GPU {r['cpu_to_gpu']}, "
                  f"GPU->CPU {r['gpu_to_cpu']} ({r['bytes']} B)")
        if "skipped" in rep["real_kv"]:
            print(f"real KV: skipped ({rep['real_kv']['skipped']})")
        print("| figure | GB/s | vs copy |\n|---|---|---|")
        print(f"| device copy (D2D) | {rep['copy_gb_s']:.1f} | 1.00 |")
        for key, name in (("encode_gb_s", "rANS encode"), ("decode_gb_s", "rANS decode")):
            print(f"| {name} | {tp[key]:.1f} | {tp[key] / rep['copy_gb_s']:.3f} |")
        print(f"{tp['inputs']} inputs x {tp['raw_gb_per_input']:.2f} GB raw, {tp['bits_per_op']:.2f} bits/op, "
              f"decode correct {tp['decode_correct']}; overall ok {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
