"""Other engines' KV: the target's KV as engine configurations other than the sidecars' own compute it.

A serving engine never runs the sidecars' exact kernels: its attention, GEMMs, precision,
thread count, CPU kernel path and batch shape all round differently, so most of its KV
scalars differ from the sidecar's recomputation in their last bits. ``speckv bench
--engine NAME`` and benchmarks/engines.py code the KV of one of these stand-ins while the
sidecars' predictor stays as shipped; a codec is judged by the worst of them.

Engines (``ENGINES``; all take the same weights and prompt, and give
``(layers, 2, kv_heads, tokens, head_dim)`` BF16):

- ``sdpa``: the sidecars' own computation (``Target.kv``): same-kernel KV;
- ``eager``: eager attention instead of SDPA (NOTE: mild: layer 0's K/V do not depend on attention);
- ``fp32``: the whole model in FP32 (weights upcast), the cache rounded to BF16 at the end;
- ``bf16``: transformers' plain BF16 model (BF16 GEMMs through oneDNN, no FP32-accumulating linears);
- ``threads1``: the sidecars' computation on 1 thread instead of ``target.COMPUTE_THREADS``;
- ``avx2``: the sidecars' computation in a child process with ``ATEN_CPU_CAPABILITY=avx2``
  and ``ONEDNN_MAX_CPU_ISA=AVX2`` (another CPU kernel path: vectorised ops and oneDNN);
- ``batch2``: a right-padded batch of two (the prompt beside a shorter one, with an attention
  mask), as an engine batches requests; the prompt's row is returned;
- ``fp8cache``: an FP8 KV cache that attention reads, as vLLM's with ``kv_cache_dtype=fp8``:
  each layer's K and V are rounded to e4m3 (static per (layer, kv) scales: ``fp8_cache_attention``
  the sidecars' own KV) before attention, so every later layer's K/V derive from FP8-rounded
  ones; the returned KV holds the rounded values (meant for ``--dtype fp8``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from speckv.kv import Fp8Attention, Fp8KV

from . import target as tgt

if TYPE_CHECKING:  # pragma: no cover
    import torch

SAME = "sdpa"  # the sidecars' own kernels
ENGINES = (SAME, "eager", "fp32", "bf16", "threads1", "avx2", "batch2", "fp8cache")
ATTENTION_ENGINES = (SAME, "eager")  # a transformers attention implementation each
STREAM_ENGINES = (*ATTENTION_ENGINES, "bf16")  # engines whose forward pass benchmarks/e2e.py streams layer by layer
CHILD_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}  # the ``avx2`` engine
CHILD_TIMEOUT_S = 1800.0


class EngineError(RuntimeError):
    """An engine stand-in could not compute the KV (its child process failed)."""


def stream_model(target: tgt.Target, engine: str) -> Any:
    """The model whose forward pass (``target.extract_kv``, hooked) is engine ``engine`` of
    ``STREAM_ENGINES``: the target's own model with that attention, or ``bf16``'s plain model."""
    if engine not in STREAM_ENGINES:
        raise ValueError(f"engine must be one of {STREAM_ENGINES}, not {engine!r}")
    if engine == "bf16":
        import torch

        return plain_model(target, torch.bfloat16)
    target.model.set_attn_implementation(engine)  # NOTE: sdpa is the sidecars' own (target.py)
    return target.model


def engine_kv(target: tgt.Target, ids: np.ndarray, engine: str) -> "torch.Tensor | None":
    """The target's KV of ``ids`` as ``engine`` computes it; None for ``sdpa`` (the sidecars'
    own: the caller has it already)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, not {engine!r}")
    return None if engine == SAME else _RUNNERS[engine](target, np.asarray(ids, np.int64))


def _attention(name: str) -> Callable[[tgt.Target, np.ndarray], "torch.Tensor"]:
    def run(target: tgt.Target, ids: np.ndarray) -> "torch.Tensor":
        model = target.model
        old = model.config._attn_implementation
        model.set_attn_implementation(name)
        try:
            return target.kv(ids)
        finally:
            model.set_attn_implementation(old)
    return run


def plain_model(target: tgt.Target, dtype: "torch.dtype") -> Any:
    """transformers' own model of the target's config in ``dtype``: nn.Linear GEMMs, SDPA."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = type(target.config).from_dict(target.config.to_dict())
    cfg._attn_implementation = SAME
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in target.state.items()}, strict=False)
    assert all(p.dtype == dtype for p in model.parameters())
    return model.eval().requires_grad_(False) if isinstance(model, torch.nn.Module) else model


def _plain(dtype_name: str) -> Callable[[tgt.Target, np.ndarray], "torch.Tensor"]:
    def run(target: tgt.Target, ids: np.ndarray) -> "torch.Tensor":
        import torch

        return tgt.extract_kv(plain_model(target, getattr(torch, dtype_name)), ids)
    return run


def _threads1(target: tgt.Target, ids: np.ndarray) -> "torch.Tensor":
    old = tgt.COMPUTE_THREADS
    tgt.COMPUTE_THREADS = 1  # NOTE: deterministic_torch reads it at each forward
    try:
        return target.kv(ids)
    finally:
        tgt.COMPUTE_THREADS = old


def _batch2(target: tgt.Target, ids: np.ndarray) -> "torch.Tensor":
    import torch

    n = len(ids)
    other = np.resize(ids[::-1], max(1, n // 2))  # a shorter second prompt, right-padded
    inp = torch.zeros((2, n), dtype=torch.int64)
    mask = torch.zeros((2, n), dtype=torch.int64)
    inp[0], mask[0] = torch.as_tensor(ids), 1
    inp[1, :len(other)], mask[1, :len(other)] = torch.as_tensor(other), 1
    with tgt.deterministic_torch():
        out = target.model.model(input_ids=inp, attention_mask=mask, use_cache=True)
    return tgt.stack_cache(out, target.config.num_hidden_layers, row=0)


def _child_process(target: tgt.Target, ids: np.ndarray) -> "torch.Tensor":
    """The sidecars' computation in a fresh process under ``CHILD_ENV`` (torch reads the kernel
    path at import, so it cannot change in this one)."""
    import torch

    with tempfile.TemporaryDirectory(prefix="speckv-engine-") as d:
        src, dst = Path(d) / "ids.npy", Path(d) / "kv.npy"
        np.save(src, ids)
        cmd = [sys.executable, "-m", "speckv.predictor.engines", "--target", target.spec, str(src), str(dst)]
        try:
            proc = subprocess.run(cmd, env={**os.environ, **CHILD_ENV}, capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise EngineError(f"engine avx2: child timed out after {CHILD_TIMEOUT_S:.0f} s") from e
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise EngineError(f"engine avx2: child exited {proc.returncode}: {tail}")
        return torch.from_numpy(np.load(dst)).view(torch.bfloat16)


def _fp8cache(target: tgt.Target, ids: np.ndarray) -> "torch.Tensor":
    """The sidecars' computation with each layer's K/V rounded to e4m3 before attention reads them
    (scale amax / 448 per (layer, kv), as ``fp8.kv_to_fp8``, from a pass without rounding: an engine
    with static scales calibrated on such KV); the KV returned is the rounded one."""
    return fp8_cache_kv(target, ids, fp8_cache_attention(target.kv(ids)))


def fp8_cache_kv(target: tgt.Target, ids: np.ndarray, fa: Fp8Attention) -> "torch.Tensor":
    """The KV an engine whose attention reads its FP8 cache stores, ``fa`` its scales and rounding:
    every layer's attention reads K/V rounded so, and the KV returned is rounded the same way."""
    import torch

    with tgt.reading_fp8(fa, target.config.num_hidden_layers):  # the engine: every layer its own
        kv = target.kv(ids)
    return torch.stack([torch.stack([fa.round(kv[i, j], i, j) for j in (0, 1)]) for i in range(len(kv))])


def fp8_cache_codes(kv: "torch.Tensor", fa: Fp8Attention) -> Fp8KV:
    """The e4m3 codes an FP8-cache engine stores for ``kv`` (values it rounded with ``fa``, so each is
    exactly ``code * scale`` at ``fa``'s static scales), and those scales."""
    import torch

    scales = np.stack([np.asarray(fa.k_scales, np.float32), np.asarray(fa.v_scales, np.float32)], axis=1)
    s = torch.from_numpy(scales)[:, :, None, None, None]
    codes = (kv.float() / s).to(torch.float8_e4m3fn)
    if not torch.equal((codes.float() * s).to(kv.dtype), kv):
        raise ValueError("the KV is not on the e4m3 grid of these scales")
    return Fp8KV(codes.view(torch.uint8).numpy(), scales)


def fp8_cache_attention(kv: "torch.Tensor", toward_zero: bool = False) -> Fp8Attention:
    """The ``fp8cache`` engine's cache rounding: ``kv_to_fp8``'s per-(layer, kv) scales of ``kv``."""
    from .fp8 import kv_to_fp8

    _, scales = kv_to_fp8(kv)
    s = scales.numpy().astype(np.float32)
    return Fp8Attention(tuple(map(float, s[:, 0])), tuple(map(float, s[:, 1])), toward_zero)


_RUNNERS: dict[str, Callable[[tgt.Target, np.ndarray], "torch.Tensor"]] = {
    "eager": _attention("eager"), "fp32": _plain("float32"), "bf16": _plain("bfloat16"),
    "threads1": _threads1, "avx2": _child_process, "batch2": _batch2, "fp8cache": _fp8cache}


def same_computation(engine: str) -> bool:
    """Whether this CPU computes ``engine`` with the sidecars' own kernels, bit for bit: an AVX2-only
    CPU (no AVX-512) already runs the ``avx2`` engine's kernel path, so its KV is same-kernel KV there."""
    import torch

    return engine == SAME or (engine == "avx2" and torch.backends.cpu.get_cpu_capability() == "AVX2")


def differing_fraction(kv: "torch.Tensor", same: "torch.Tensor") -> float:
    """The fraction of KV scalars whose bits differ from the same-kernel KV's."""
    from speckv.kv import bf16_bits

    return float(np.mean(bf16_bits(kv) != bf16_bits(same)))


def _child(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m speckv.predictor.engines")
    ap.add_argument("--target", default=tgt.DEFAULT_TARGET)
    ap.add_argument("ids", help=".npy of int64 prompt token ids")
    ap.add_argument("out", help=".npy the KV's BF16 bits (uint16) go to")
    a = ap.parse_args(argv)
    from speckv.kv import bf16_bits

    target = tgt.load_target(a.target)
    np.save(a.out, bf16_bits(target.kv(np.load(a.ids))))


if __name__ == "__main__":  # pragma: no cover - run as the avx2 engine's child process
    _child(sys.argv[1:])
