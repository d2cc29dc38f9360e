"""The shipped predictor on a GPU, for a lent CUDA machine (a few minutes): what does mu cost there
against the target's prefill on the same device, is it the same bits run to run, how close is it
to the CPU's mu, and what does the codec make of the GPU target's KV with the GPU's mu?

Loads the embedded target and the shipped checkpoint, tokenises ``--tokens`` tokens of ``--text``,
computes the target KV and mu on the CPU once, then on ``--device``: the target prefill and mu
(median of ``--repeats`` after one warm-up each), mu twice for determinism, the fraction of mu
scalars equal to the CPU's, and the codec's bits/scalar and losslessness for three pairs (GPU KV
with GPU mu, GPU KV with CPU mu, CPU KV with GPU mu), with ``--coder`` (cuda: the fused kernels,
whose bytes must equal the native coder's on the same input). ``--device cpu`` runs the same
logic here (a smoke run: tests/benchmarks/test_gpu_predictor.py). Prints one JSON object.

Usage: python benchmarks/gpu_predictor.py [--device cuda] [--tokens 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

import gpu_portable  # NOTE: a sibling script (benchmarks/ is on sys.path when one of them runs)

TEXT = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "tinyshakespeare.txt"


def timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> tuple[Any, float]:
    """(the last result, median seconds of ``repeats`` synchronised calls after one warm-up)."""
    fn()
    sync()
    return gpu_portable.timed(fn, repeats, sync)


def same_fraction(a: Any, b: Any) -> float:
    """Fraction of BF16 scalars whose bits agree."""
    import torch

    return float((a.cpu().view(torch.int16) == b.cpu().view(torch.int16)).double().mean())


def code(pred: Any, kv: Any, ids: Any, mu: Any, coder: str) -> dict[str, Any]:
    """bits/scalar and losslessness of ``kv`` coded under ``mu``; for ``cuda``, also whether its
    records are the native coder's bytes."""
    import numpy as np

    from speckv.coder.codec import Codec, CodecConfig, bf16_bits

    kv, mu = kv.cpu(), mu.cpu()
    codec = Codec.from_predictor(pred, CodecConfig(coder=coder))
    list(codec.encode(kv, ids, mu))  # NOTE: untimed: the CUDA coder compiles its kernels on first use
    t0 = time.perf_counter()
    records = list(codec.encode(kv, ids, mu))
    enc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    lossless = bool(np.array_equal(codec.decode(records, ids, mu), bf16_bits(kv)))
    dec_s = time.perf_counter() - t0
    out = {"bits_per_scalar": round(8 * sum(len(r) for r in records) / kv.numel(), 4), "lossless": lossless,
           "encode_s": round(enc_s, 3), "decode_s": round(dec_s, 3)}
    if coder != "native":
        nat = list(Codec.from_predictor(pred, CodecConfig(coder="native")).encode(kv, ids, mu))
        out["bytes_equal_native"] = nat == records
    return out


def variants(pred: Any, target: Any, ids: Any, device: str, repeats: int, sync: Callable[[], None]) -> dict:
    """Seconds of two neighbours on the device: the shipped w8a8i rung with its int8 attention on
    the host's kernel (each layer's q/k/v to the CPU and back: ``w8a8_pass.HOST_INT8_ON_DEVICE``; on
    the CPU that is the rung as shipped), and the target's prefill as an engine runs it there (BF16
    linears, not ``target.py``'s FP32-accumulated ones)."""
    import torch

    from speckv.predictor import w8a8_pass
    from speckv.predictor.target import extract_kv, load_hf, target_dir

    out: dict[str, Any] = {}
    if getattr(pred.model, "int_attention", False):
        w8a8_pass.HOST_INT8_ON_DEVICE = True
        try:
            mu, out["host_int8_attention_s"] = timed(lambda: pred.mu(ids), repeats, sync)
            out["host_int8_attention_deterministic"] = bool(torch.equal(mu.view(torch.int16),
                                                                        pred.mu(ids).view(torch.int16)))
        finally:
            w8a8_pass.HOST_INT8_ON_DEVICE = False
    engine = load_hf(target_dir(target.spec))[0].to(device)
    _, out["engine_bf16_s"] = timed(lambda: extract_kv(engine, ids), repeats, sync)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--coder", default="cuda", choices=("cuda", "native"))
    a = ap.parse_args()
    import torch

    from speckv.predictor.checkpoint import load_checkpoint
    from speckv.predictor.predict import Predictor
    from speckv.predictor.store import default_checkpoint_dir
    from speckv.predictor.target import load_target

    target = load_target()
    ck = load_checkpoint(default_checkpoint_dir())
    ids = target.tokenize(Path(a.text).read_text(encoding="utf-8", errors="replace"), a.tokens)
    cpu_pred = Predictor.from_checkpoint(ck, target)
    t0 = time.perf_counter()
    cpu_kv = target.kv(ids)
    cpu_target_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    cpu_mu = cpu_pred.mu(ids)
    cpu_mu_s = time.perf_counter() - t0
    on_gpu = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    pred = Predictor.from_checkpoint(ck, target).to(a.device)
    target.model.to(a.device)
    kv, target_s = timed(lambda: target.kv(ids), a.repeats, sync)
    mu, mu_s = timed(lambda: pred.mu(ids), a.repeats, sync)
    again = pred.mu(ids)
    print(json.dumps({**variants(pred, target, ids, a.device, a.repeats, sync),
        "device": a.device, "name": torch.cuda.get_device_name() if on_gpu else "cpu", "rung": ck.rung.name,
        "tokens": int(len(ids)), "torch": torch.__version__, "target_s": round(target_s, 4),
        "predictor_s": round(mu_s, 4), "predictor_cost": round(mu_s / target_s, 3),
        "cpu_target_s": round(cpu_target_s, 3), "cpu_predictor_s": round(cpu_mu_s, 3),
        "mu_deterministic": bool(torch.equal(mu.view(torch.int16), again.view(torch.int16))),
        "mu_equal_cpu_fraction": round(same_fraction(mu, cpu_mu), 6),
        "kv_equal_cpu_fraction": round(same_fraction(kv, cpu_kv), 6),
        "gpu_kv_gpu_mu": code(pred, kv, ids, mu, a.coder), "gpu_kv_cpu_mu": code(pred, kv, ids, cpu_mu, "native"),
        "cpu_kv_gpu_mu": code(pred, cpu_kv, ids, mu, "native"), "cpu_kv_cpu_mu": code(pred, cpu_kv, ids, cpu_mu,
                                                                                       "native")}))


if __name__ == "__main__":
    main()
