"""``speckv bench``'s memory figures: each sidecar's peak RSS on the bench's transfer.

Each role runs in a fresh interpreter (``speckv.server.memprobe``), so its peak is
a sidecar's alone: the decoder decodes the bench's stream and checks its digest;
the encoder codes the bench's KV, and this process decodes that stream and
compares it with the KV, bit for bit. Figures are in MiB, beside the target's BF16
weight size and the runtime floor (what importing torch, transformers' Llama code,
grpc and the sidecar costs a process before any model).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Any, Callable

import numpy as np

MIB = 1 << 20


def _probe(role: str, args: list[str], predictor: str | None, pin: str | None, target: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "speckv.server.memprobe", "--role", role, *args, "--target", str(target)]
    cmd += ["--predictor", predictor] if predictor else []
    cmd += ["--pin", pin] if pin else []
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"the {role} memory probe failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _save_kv(tmp: str, kv: Any) -> list[str]:
    """The KV as the encoder probe reads it: BF16 bit patterns, or FP8 codes and scales."""
    from speckv.coder.codec import Fp8KV, bf16_bits

    if isinstance(kv, Fp8KV):
        np.save(f"{tmp}/kv.npy", kv.codes)
        np.save(f"{tmp}/scales.npy", kv.scales)
        return ["--kv", f"{tmp}/kv.npy", "--scales", f"{tmp}/scales.npy"]
    np.save(f"{tmp}/kv.npy", bf16_bits(kv))
    return ["--kv", f"{tmp}/kv.npy"]


def sidecar_memory(ids: np.ndarray, kv: Any, records: list[bytes], back: Any, codec: Any, mu: Any,
                   predictor: str | None, pin: str | None, target: str,
                   equal: Callable[[Any, Any], bool]) -> dict[str, Any]:
    """Both sidecars' peaks on this transfer (module docstring); raises if either probe's bytes
    are not this process's (``equal(decoded, kv)``: bench's own bit-for-bit comparison)."""
    from speckv.predictor.weights import target_weights
    from speckv.server.memory import peak_rss_bytes
    from speckv.server.memprobe import decoded_sha256, read_records, write_records

    with tempfile.TemporaryDirectory(prefix="speckv-memprobe-") as tmp:
        np.save(f"{tmp}/ids.npy", np.asarray(ids, np.int64))
        write_records(f"{tmp}/stream.bin", records)
        dec = _probe("decoder", ["--ids", f"{tmp}/ids.npy", "--stream", f"{tmp}/stream.bin",
                                 "--expect", decoded_sha256(back)], predictor, pin, target)
        enc = _probe("encoder", ["--ids", f"{tmp}/ids.npy", *_save_kv(tmp, kv), "--out", f"{tmp}/enc.bin"],
                     predictor, pin, target)
        enc["lossless"] = equal(codec.decode(read_records(f"{tmp}/enc.bin"), ids, mu), kv)
    if not (dec["lossless"] and enc["lossless"]):
        raise RuntimeError(f"a memory probe's bytes differ from this process's (decoder {dec['lossless']}, "
                           f"encoder {enc['lossless']})")
    weights = target_weights(target)
    w = weights.bf16_bytes if weights is not None else 0
    out: dict[str, Any] = {"runtime_floor_mib": dec["runtime_floor_bytes"] / MIB, "target_bf16_mib": w / MIB,
                           "bench_peak_mib": peak_rss_bytes() / MIB}
    for role, m in (("decoder", dec), ("encoder", enc)):
        out |= {f"{role}_peak_mib": m["peak_bytes"] / MIB, f"{role}_loaded_peak_mib": m["loaded_peak_bytes"] / MIB,
                f"{role}_peak_x_weights": m["peak_bytes"] / w if w else None,
                f"{role}_above_floor_x_weights": (m["peak_bytes"] - m["runtime_floor_bytes"]) / w if w else None,
                f"{role}_lossless": m["lossless"]}
    return out
