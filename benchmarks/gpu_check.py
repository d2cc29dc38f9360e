"""GPU check of the fused CUDA coder (coder/cuda.py), for a lent CUDA machine (< 5 minutes,
no model load): the shipped checkpoint's tables and sigma, seeded synthetic KV and mu.

1. Digests: sha256 of the streams of every case (BF16 and FP8 KV, the seed and tuned
   residual models, two geometries) against benchmarks/gpu_check_digests.json, which
   the native CPU coder wrote (``--write-digests``).
2. Identity: device streams == native streams, each decodes bit-exactly on the other.
3. Throughput of the fused path with KV already in device memory, in GB/s of raw KV
   each way (encode: KV -> streams on the host, and with the streams kept in device memory;
   decode: streams on the host -> KV in device memory, and from the streams kept there),
   at streaming granularity (2 layers x 2048 tokens), batched (30 layers), and several
   requests per launch (stacked along the layer axis), next to the device's D2D copy. On a
   device also a sidecar's calls (``--coder cuda``): KV and mu' in host memory, the streams
   to and from there, the calls the native coder's figures on the same machine time.

   On a device also: prompts of other lengths (512 to 3072 tokens) in one call each way
   (``encode_batch`` / ``decode_batch``) against a call a prompt, and 8 callers at once through
   ``QueuedCuda`` against their calls one after another (benchmarks/gpu_batch.py).
4. ``--sweep``: the batched and 4-request cases under each tuning of coder/cuda.py's SWEEP (launch
   and compile knobs: speed, never bytes; every tuning's streams must equal the default's).
Each throughput case also reports its floor: the GB/s at which the device's copy bandwidth moves the
fewest bytes the call must (its inputs read once, its outputs written once).

``--backend native`` runs the same logic on the CPU (tests/benchmarks/test_gpu_check.py).
Usage: python benchmarks/gpu_check.py [--backend cuda|native] [--repeats 5] [--sweep] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from speckv.coder.model import fp8_log2_sigma
from speckv.coder.native import NativeCoder
from speckv.coder.residual import ResidualModel

sys.path.insert(0, str(Path(__file__).parent))
# NOTE: re-exported: cuda_host_cost.py and the tests take them from here
from gpu_batch import MIXED_TOKENS, mixed_requests, queued_streaming  # noqa: E402, F401
from gpu_common import Device, _streams, affine, levels, load_models, stream_digest, synth, timed, typical, typical_fp8  # noqa: E402, F401

DIGESTS = Path(__file__).with_name("gpu_check_digests.json")
# (name, layers, tokens, elems_per_lane, layers_per_chunk): small enough for the CPU test
CASES = (("lanes64", 30, 64, 64, 2), ("partial", 30, 37, 1024, 7))


def run_case(dev: Device, ref: NativeCoder, model: ResidualModel, data: dict, epl: int, lpc: int) -> dict:
    """One case on the device and on the native coder: digest, identity both ways."""
    x, layers = data["x"], data["x"].shape[0]
    counts = [min(lpc, layers - i) for i in range(0, layers, lpc)]
    a, b = affine(model, layers)
    scales = data.get("scales")
    L = levels(model, layers, scales)
    mu_d = dev.prepare_mu(dev.put(data["mu"]), a, b, scales)
    mu_h = ref.prepare_mu(data["mu"], a, b, scales)
    parts = dev.encode(dev.put(x), mu_d, L, counts, epl, model.tables)
    nat = ref.encode(x, mu_h, L, counts, epl, model.tables)
    back = np.empty_like(x)
    ref.decode(mu_h, L, counts, epl, _streams(parts), model.tables, back)  # device stream on the CPU
    out = dev.xp.empty(x.shape, x.dtype)
    dev.decode(mu_d, L, counts, epl, _streams(nat), model.tables, out)  # CPU stream on the device
    return {"digest": stream_digest(parts), "streams_equal": stream_digest(nat) == stream_digest(parts),
            "mu_equal": bool(np.array_equal(dev.get(mu_d), mu_h)), "gpu_to_cpu": bool(np.array_equal(back, x)),
            "cpu_to_gpu": bool(np.array_equal(dev.get(out), x)), "bytes": sum(len(p.bits) + 2 * p.blocks.words.size
                                                                            for p in parts)}


def check_all(dev: Device, models: dict[str, ResidualModel]) -> dict[str, dict]:
    ref = NativeCoder(threads=os.cpu_count() or 1)
    out = {}
    for ci, (name, layers, tokens, epl, lpc) in enumerate(CASES):
        for fp8 in (False, True):
            data = synth(100 * ci + fp8, layers, tokens, fp8)
            for mname, model in models.items():
                out[f"{'fp8' if fp8 else 'bf16'}/{mname}/{name}"] = run_case(dev, ref, model, data, epl, lpc)
    return out


# -- throughput ------------------------------------------------------------------------------------
def floor_gb_s(raw: int, moved: int, copy_gb_s: float | None) -> float | None:
    """GB/s of raw KV when a call moves ``moved`` bytes (read + written) at the device's copy
    bandwidth (``copy_gb_s`` counts each byte copied once: read and written)."""
    return None if not copy_gb_s else raw / (moved / (2 * copy_gb_s * 1e9)) / 1e9


def throughput(dev: Device, model: ResidualModel, layers: int, tokens: int, requests: int, repeats: int,
               epl: int = 1024, lpc: int = 2, fp8: bool = False, copy_gb_s: float | None = None,
               host: bool = True) -> dict:
    """KV of ``requests`` stacked requests in device memory (BF16, or e4m3 codes), coded in one
    call each way; GB/s of the raw KV (2 or 1 bytes a scalar), its floor at ``copy_gb_s``, the
    streams' digest, and on a device the seconds of each kernel in one profiled call each way (the
    rest of a call is the host's); ``host``: also a sidecar's calls, from and to host memory."""
    # NOTE: a streaming call codes 2 middle layers (hybrid:4's first layers are exact, 0 bits)
    n, first = layers * requests, 10 if layers < 30 else 0
    L = levels(model, first + n, None)[first:]
    data = (typical_fp8 if fp8 else typical)(7, L, tokens)
    scales = data.get("scales")
    if scales is not None:
        L = np.ascontiguousarray(fp8_log2_sigma(L, scales.view(np.uint32)[:, :, None, None]), np.int32)
    counts = [min(lpc, n - i) for i in range(0, n, lpc)]
    a, b = (None if v is None else v[first:] for v in affine(model, first + n))
    x, mu = dev.put(data["x"]), dev.prepare_mu(dev.put(data["mu"]), a, b, scales)
    parts = dev.encode(x, mu, L, counts, epl, model.tables)
    out = dev.xp.empty(data["x"].shape, data["x"].dtype)
    enc = lambda: dev.encode(x, mu, L, counts, epl, model.tables)  # noqa: E731
    dec = lambda: dev.decode(mu, L, counts, epl, _streams(parts), model.tables, out)  # noqa: E731
    t_enc, t_dec = timed(dev, enc, repeats), timed(dev, dec, repeats)
    raw, scalars = data["x"].nbytes, data["x"].size
    # the streams left in device memory (a GPUDirect sender's case): the kernels and the host's
    # bookkeeping, without the copy of the streams to the host
    kept = lambda: dev.coder.encode_streams(x, mu, L, counts, epl, model.tables)  # noqa: E731
    t_kept = timed(dev, kept, repeats) if dev.name == "cuda" else None
    t_kept_dec, hosted = None, None
    if dev.name == "cuda":  # ... and decoded from there (decode_streams: no copy to the device)
        s = kept()
        t_kept_dec = timed(dev, lambda: dev.coder.decode_streams(s, mu, L, counts, epl, model.tables, out), repeats)
        hosted = host_calls(dev, model, (data["x"], dev.get(mu), L, counts, epl), parts, repeats) if host else None
    wire = sum(len(p.bits) + 2 * p.blocks.words.size + 4 * p.blocks.states.size for p in parts)
    # the fewest bytes each way: KV, mu (4 bytes a scalar for FP8: mu' / scale as fp32) and L read, streams written
    # (encode), or streams, mu and L read, KV written (decode)
    moved = raw + mu.nbytes + L.nbytes + wire
    rep = {"layers": layers, "tokens": tokens, "requests": requests, "epl": epl, "dtype": "fp8" if fp8 else "bf16",
           "raw_mb": raw / 1e6, "encode_gb_s": raw / t_enc / 1e9, "decode_gb_s": raw / t_dec / 1e9,
           "encode_kept_gb_s": None if t_kept is None else raw / t_kept / 1e9,
           "decode_kept_gb_s": None if t_kept_dec is None else raw / t_kept_dec / 1e9,
           "encode_host_gb_s": None if hosted is None else raw / hosted["encode_s"] / 1e9,
           "decode_host_gb_s": None if hosted is None else raw / hosted["decode_s"] / 1e9,
           "host_correct": None if hosted is None else hosted["correct"],
           "floor_gb_s": floor_gb_s(raw, moved, copy_gb_s), "digest": stream_digest(parts),
           "bits_per_scalar": 8 * wire / scalars, "decode_correct": bool(np.array_equal(dev.get(out), data["x"]))}
    if hasattr(dev.coder, "profiled"):
        for name, fn in (("encode", enc), ("decode", dec)):
            wall, kernels = dev.coder.profiled(fn)
            rep[f"{name}_profile_ms"] = {"wall": 1e3 * wall, **{k: 1e3 * v for k, v in kernels.items()}}
    return rep


def host_calls(dev: Device, model: ResidualModel, args: tuple, parts: list, repeats: int) -> dict:
    """Median seconds of a sidecar's calls each way (``--coder cuda``: KV and mu' in host memory, the
    streams to and from there; the native coder's figures on the same machine are the same calls on
    its cores), and whether they wrote ``parts``' streams and the KV back."""
    x, mu, L, counts, epl = args
    out = np.empty_like(x)
    enc = lambda: dev.coder.encode(x, mu, L, counts, epl, model.tables)  # noqa: E731
    dec = lambda: dev.coder.decode(mu, L, counts, epl, _streams(parts), model.tables, out)  # noqa: E731
    same = stream_digest(enc()) == stream_digest(parts)
    t_enc, t_dec = timed(dev, enc, repeats), timed(dev, dec, repeats)
    return {"encode_s": t_enc, "decode_s": t_dec, "correct": same and bool(np.array_equal(out, x))}


# (name, layers, tokens, requests, elems_per_lane, fp8): streaming, batched and several requests at
# the shipped geometry; then other lane lengths (more, shorter blocks: more warps, more state bytes)
# and FP8 KV
THROUGHPUT = (("streaming", 2, 2048, 1, 1024, False), ("batched", 30, 2048, 1, 1024, False),
              ("requests4", 30, 2048, 4, 1024, False), ("batched_epl64", 30, 2048, 1, 64, False),
              ("batched_epl256", 30, 2048, 1, 256, False), ("batched_epl4096", 30, 2048, 1, 4096, False),
              ("streaming_epl256", 2, 2048, 1, 256, False), ("batched_fp8", 30, 2048, 1, 1024, True))


# (name, layers, tokens, requests): the cases each tuning runs
SWEEP_CASES = (("batched", 30, 2048, 1), ("requests4", 30, 2048, 4))


def sweep(models: dict[str, ResidualModel], repeats: int, copy_gb_s: float | None,
          cases: tuple = SWEEP_CASES, make: Callable[[Any], Device] = lambda t: Device("cuda", t)) -> list[dict]:
    """Each tuning of coder/cuda.py's SWEEP: its cases' figures (as ``throughput``'s), and whether its
    streams equal the first tuning's (the defaults) byte for byte."""
    from speckv.coder.cuda_tuning import SWEEP

    rows: list[dict] = []
    for t in SWEEP:
        dev = make(t)
        figures = {name: throughput(dev, models["tuned"], layers, tokens, req, repeats, copy_gb_s=copy_gb_s, host=False)
                   for name, layers, tokens, req in cases}
        same = all(f["digest"] == rows[0]["cases"][n]["digest"] for n, f in figures.items()) if rows else True
        rows.append({"tuning": dataclasses.asdict(t), "cases": figures, "same_streams": same})
    return rows


def copy_bandwidth(dev: Device, nbytes: int, repeats: int) -> float:
    src = dev.xp.ones(nbytes // 4, dev.xp.uint32)
    dst = dev.xp.empty_like(src)
    return nbytes / timed(dev, lambda: dst.__setitem__(slice(None), src), repeats) / 1e9


def run(backend: str, repeats: int, speed: bool, tuned: bool = False) -> dict:
    dev, models = Device(backend), load_models()
    rep: dict[str, Any] = {"backend": backend, "cases": check_all(dev, models)}
    want = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    rep["digests_match"] = bool(want) and all(want.get(k) == v["digest"] for k, v in rep["cases"].items())
    if speed or tuned:
        rep["copy_gb_s"] = copy_bandwidth(dev, 1 << 28 if backend == "cuda" else 1 << 24, repeats)
    if speed:
        rep["throughput"] = {name: throughput(dev, models["tuned"], layers, tokens, req, repeats, epl, fp8=fp8,
                                              copy_gb_s=rep["copy_gb_s"])
                             for name, layers, tokens, req, epl, fp8 in THROUGHPUT}
        if backend == "cuda":  # NOTE: the native coder has no batch: a call a prompt either way
            rep["mixed"] = mixed_requests(dev, models["tuned"], repeats)
            rep["queued"] = queued_streaming(dev, models["tuned"], repeats)
    if tuned:
        rep["sweep"] = sweep(models, repeats, rep["copy_gb_s"])
    checks = [v[k] for v in rep["cases"].values() for k in ("streams_equal", "mu_equal", "gpu_to_cpu", "cpu_to_gpu")]
    checks += [t[k] for t in rep.get("throughput", {}).values() for k in ("decode_correct", "host_correct")
               if t[k] is not None]
    checks += [rep[c][k] for c, ks in (("mixed", ("same_streams_as_alone", "decode_correct")),
                                       ("queued", ("same_streams", "decode_correct"))) if c in rep for k in ks]
    for r in rep.get("sweep", []):
        checks += [r["same_streams"]] + [f["decode_correct"] for f in r["cases"].values()]
    rep["ok"] = all(checks) and rep["digests_match"]
    return rep


def _row(t: dict, host: bool = True) -> str:
    """encode | kept | (from the host) | decode | kept | (to the host) | floor cells of a throughput case"""
    cell = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    keys = ("encode_gb_s", "encode_kept_gb_s", "encode_host_gb_s", "decode_gb_s", "decode_kept_gb_s",
            "decode_host_gb_s", "floor_gb_s")
    return " | ".join(cell(t.get(k)) for k in keys if host or "_host_" not in k)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "native"), default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-speed", action="store_true", help="skip the throughput figures")
    ap.add_argument("--sweep", action="store_true", help="time coder/cuda.py's SWEEP of tunings (device only)")
    ap.add_argument("--write-digests", action="store_true", help="record the native coder's digests")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.write_digests:
        cases = check_all(Device("native"), load_models())
        DIGESTS.write_text(json.dumps({k: v["digest"] for k, v in cases.items()}, indent=1, sort_keys=True) + "\n")
        return 0
    if args.backend == "cuda":
        from speckv.coder.backends import cuda_available

        if not cuda_available():
            print("gpu_check: no CUDA device or CuPy (pip install 'speckv[cuda]')", file=sys.stderr)
            return 2
    if args.sweep and args.backend != "cuda":
        ap.error("--sweep tunes the CUDA kernels: --backend cuda")
    rep = run(args.backend, args.repeats, not args.no_speed, args.sweep)
    if args.json:
        print(json.dumps(rep))
        return 0 if rep["ok"] else 1
    for name, r in rep["cases"].items():
        print(f"{name:22s} digest {r['digest'][:12]} streams equal {r['streams_equal']}, mu {r['mu_equal']}, "
              f"GPU->CPU {r['gpu_to_cpu']}, CPU->GPU {r['cpu_to_gpu']} ({r['bytes']} B)")
    print(f"digests match {DIGESTS.name}: {rep['digests_match']}")
    if "throughput" in rep:
        print(f"| figure | encode GB/s | encode, streams kept on the device | encode from host memory | decode GB/s | "
              f"decode, from streams on the device | decode to host memory | floor GB/s | bits/scalar |\n"
              f"|---|---|---|---|---|---|---|---|---|\n"
              f"| D2D copy | {rep['copy_gb_s']:.1f} | | | {rep['copy_gb_s']:.1f} | | | | |")
        for name, t in rep["throughput"].items():
            print(f"| {name} ({t['raw_mb']:.1f} MB) | {_row(t)} | {t['bits_per_scalar']:.2f} |")
        for name, t in rep["throughput"].items():
            for way in ("encode", "decode"):
                if f"{way}_profile_ms" in t:
                    print(f"{name} {way} ms: " + ", ".join(f"{k} {v:.2f}" for k, v in t[f"{way}_profile_ms"].items()))
    if "mixed" in rep:
        m = rep["mixed"]
        print(f"prompts of {m['tokens']} tokens ({m['raw_mb']:.1f} MB): one call each way {m['encode_gb_s']:.2f} / "
              f"{m['decode_gb_s']:.2f} GB/s, a call a prompt {m['one_call_a_prompt_encode_gb_s']:.2f} / "
              f"{m['one_call_a_prompt_decode_gb_s']:.2f}; streams as alone {m['same_streams_as_alone']}")
    if "queued" in rep:
        qd = rep["queued"]
        print(f"{qd['callers']} callers at once, a streaming call each way ({qd['raw_mb']:.1f} MB): queued "
              f"{qd['queued_gb_s']:.2f} GB/s ({qd['calls_a_launch']:.1f} calls a launch), one after another "
              f"{qd['serial_gb_s']:.2f}; streams as the coder's {qd['same_streams']}")
    if "sweep" in rep:
        print("| tuning | case | encode GB/s | kept | decode GB/s | kept | floor GB/s | streams as the defaults' |\n"
              "|---|---|---|---|---|---|---|---|")
        for r in rep["sweep"]:
            knobs = " ".join(f"{k}={v}" for k, v in r["tuning"].items())
            for name, t in r["cases"].items():
                print(f"| {knobs} | {name} | {_row(t, host=False)} | {r['same_streams']} |")
    print(f"overall ok {rep['ok']}")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
