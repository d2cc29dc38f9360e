"""Shared by the GPU checks (benchmarks/gpu_check.py, gpu_batch.py, cuda_host_cost.py): deterministic
inputs (seeded synthetic KV and mu in numpy: any machine makes the same bytes; the shipped
checkpoint's residual models, their sigma levels and mu corrections), the device a check codes on
(the native coder standing in on a CPU), stream digests and timing."""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from typing import Any, Callable

import numpy as np

from speckv.coder.model import E4M3_F32, fp8_log2_sigma
from speckv.coder.native import EncodedChunk, NativeCoder
from speckv.coder.residual import ResidualModel, f32_to_bf16, models_of
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.store import default_checkpoint_dir

HEADS, DIM = 3, 64  # the shipped checkpoint's KV geometry (checked in load_models)
SPECIAL_BF16 = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1],
                        np.uint16)


def bf16(f: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns, nearest even (the residual model's own rounding)."""
    return f32_to_bf16(np.asarray(f, np.float32))


def e4m3(f: np.ndarray) -> np.ndarray:
    """Nearest e4m3fn code of each finite float32 (saturating at 448)."""
    pos = E4M3_F32[:127]  # codes 0..126: ascending non-negative values (0x7F is NaN)
    a = np.minimum(np.abs(f), pos[-1])
    i = np.clip(np.searchsorted(pos, a), 1, 126)
    i -= (a - pos[i - 1]) <= (pos[i] - a)
    return (i | (np.signbit(f) << 7)).astype(np.uint8)


def synth(seed: int, layers: int, tokens: int, fp8: bool) -> dict[str, np.ndarray]:
    """KV near mu (Gaussian residuals per channel) with special values mixed in."""
    rng = np.random.default_rng(seed)
    shape = (layers, 2, HEADS, tokens, DIM)
    scale = np.exp(rng.normal(0, 1.5, (layers, 2, HEADS, 1, DIM))).astype(np.float32)
    mu_f = (rng.standard_normal(shape, np.float32) * scale).astype(np.float32)
    x_f = mu_f + (rng.standard_normal(shape, np.float32) * 0.1 * scale).astype(np.float32)
    mu = bf16(mu_f)
    mu.reshape(-1)[::1009] = rng.choice(SPECIAL_BF16, mu.reshape(-1)[::1009].size)
    if not fp8:
        x = bf16(x_f)
        x.reshape(-1)[::997] = rng.choice(SPECIAL_BF16, x.reshape(-1)[::997].size)
        return {"x": x, "mu": mu}
    scales = (np.abs(x_f).max(axis=(2, 3, 4)) / 448).astype(np.float32)
    scales[0, 0] = 0.0  # degenerate: mu / scale is inf or NaN, every element escapes
    x = e4m3(x_f / np.maximum(scales, 1e-30)[:, :, None, None, None])
    x.reshape(-1)[::991] = 0x7F  # NaN codes
    return {"x": x, "mu": mu, "scales": scales}


def typical(seed: int, L: np.ndarray, tokens: int) -> dict[str, np.ndarray]:
    """KV as the checkpoint expects it: x - mu Gaussian with each channel's calibrated
    sigma ``L`` (about 5.6 bits/scalar, like real KV), for throughput; ``synth`` is the hard case."""
    rng = np.random.default_rng(seed)
    shape = (L.shape[0], 2, HEADS, tokens, DIM)
    sigma = np.exp2(L / 8.0)[:, :, :, None, :].astype(np.float32)
    mu_f = rng.standard_normal(shape, np.float32)
    x_f = mu_f + rng.standard_normal(shape, np.float32) * sigma
    return {"x": bf16(x_f), "mu": bf16(mu_f)}


def load_models() -> dict[str, ResidualModel]:
    ms = models_of(load_checkpoint(default_checkpoint_dir()))
    names = {1: "seed", 2: "tuned"}
    assert all(m.log2_sigma.shape[2:] == (HEADS, DIM) for m in ms.values())
    return {names[k]: m for k, m in sorted(ms.items())}


def levels(model: ResidualModel, layers: int, scales: np.ndarray | None) -> np.ndarray:
    """L per channel for ``layers`` layers (tiled: stacked requests repeat the model's)."""
    lg = np.resize(model.log2_sigma, (layers,) + model.log2_sigma.shape[1:])
    if scales is not None:
        lg = fp8_log2_sigma(lg, scales.view(np.uint32)[:, :, None, None])
    return np.ascontiguousarray(lg, np.int32)


def affine(model: ResidualModel, layers: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The model's mu correction for ``layers`` layers, with identity-scale channels whose shifts are
    subnormal or -0 mixed in (a device compare once flushed a subnormal shift to 0: spk_affine_bf16)."""
    if model.mu_scale is None or model.mu_shift is None:
        return None, None
    shape = (layers,) + model.mu_scale.shape[1:]
    a, b = np.resize(model.mu_scale, shape).astype(np.float32), np.resize(model.mu_shift, shape).astype(np.float32)
    a[..., :3] = 1.0
    b[..., 0], b[..., 1], b[..., 2] = np.float32(1e-40), np.float32(-3e-39), np.float32(-0.0)
    return a, b


def typical_fp8(seed: int, L: np.ndarray, tokens: int) -> dict[str, np.ndarray]:
    """``typical`` KV as e4m3 codes with one scale per (layer, kv), as an FP8 cache holds it."""
    data = typical(seed, L, tokens)
    x_f = data["x"].astype(np.uint32) << 16
    x_f = x_f.view(np.float32)
    scales = (np.abs(x_f).max(axis=(2, 3, 4)) / 448).astype(np.float32)
    return {"x": e4m3(x_f / scales[:, :, None, None, None]), "mu": data["mu"], "scales": scales}


# -- backends: the device one takes arrays in its memory; native stands in on a CPU ---------------
class Device:
    def __init__(self, backend: str, tuning: Any = None) -> None:
        self.name = backend
        if backend == "cuda":
            import cupy as cp
            import cupyx

            from speckv.coder.cuda import CudaCoder

            self.xp = cp
            self.coder = CudaCoder.load() if tuning is None else CudaCoder(cp, cupyx.empty_pinned, tuning)
        else:
            self.xp, self.coder = np, NativeCoder(threads=os.cpu_count() or 1)

    def put(self, a: np.ndarray | None) -> Any:
        return None if a is None else self.xp.asarray(a)

    def prepare_mu(self, mu: Any, a: Any, b: Any, scales: Any) -> Any:
        fn = self.coder.prepare_mu_device if self.name == "cuda" else self.coder.prepare_mu
        return fn(mu, a, b, scales)

    def encode(self, *args: Any) -> list[EncodedChunk]:
        return (self.coder.encode_device if self.name == "cuda" else self.coder.encode)(*args)

    def decode(self, *args: Any) -> None:
        (self.coder.decode_device if self.name == "cuda" else self.coder.decode)(*args)

    def get(self, a: Any) -> np.ndarray:
        return a.get() if self.name == "cuda" else a

    def sync(self) -> None:
        if self.name == "cuda":
            self.xp.cuda.Device().synchronize()


def stream_digest(parts: list[EncodedChunk]) -> str:
    h = hashlib.sha256()
    for p in parts:
        for a in (p.blocks.states, p.blocks.word_counts, p.blocks.words):
            h.update(np.ascontiguousarray(a).tobytes())
        h.update(p.bits)
    return h.hexdigest()


def _streams(parts: list[EncodedChunk]) -> list:
    return [(p.blocks, p.bits) for p in parts]


def timed(dev: Device, fn: Callable[[], Any], repeats: int) -> float:
    """Median wall seconds of fn() (synchronised), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        dev.sync()
        t0 = time.perf_counter()
        fn()
        dev.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
