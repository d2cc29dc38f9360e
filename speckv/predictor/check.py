"""``speckv predictor check``: does a checkpoint's mu come out the same in every numeric environment here?

Each environment is a fresh process (``python -m speckv.predictor.check --child ...``) that loads
the checkpoint, computes mu of the text and prints the sha256 of its BF16 bits. Environments:
torch with 2 and with 1 compute threads; other CPU kernel paths through ``ATEN_CPU_CAPABILITY``
(aten's vectorised kernels), ``ONEDNN_MAX_CPU_ISA`` (oneDNN: int8 products, BF16 matmul) and
``MKL_ENABLE_INSTRUCTIONS`` (MKL's FP32 GEMM); the integer rung without the native extension, with
its per-stage native code instead of the fused kernels, and with the fused kernels' scalar loops
instead of their AVX-512 VNNI ones; CUDA where torch sees a device; and, for the portable rung, the int64 reference
(``torch.mm`` on int64, no BLAS, no oneDNN, no native code) on a short prefix, compared with the
default environment on that same prefix. The report is
``{"environments": [{"name", "tokens", "mu_sha256"}], "agree": bool}``; exit status 1 when any
two environments with the same token count disagree or one fails. An environment this machine
cannot run at all (``UNAVAILABLE``: torch's own limits, not the checkpoint's) is reported with
``"unavailable"`` instead of a digest and does not count.

The children run ``jobs`` at a time (default: one per two CPUs of this machine): each is its own
process with its own thread count, so running them side by side changes how long the check takes,
never a digest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REFERENCE_TOKENS = 128  # the int64 reference's prefix (it has no BLAS: minutes per 1,000 tokens)
# (environment variable, a line of the child's error) -> why this machine cannot run that environment
UNAVAILABLE = {
    # NOTE: torch 2.13 on a CPU with AMX picks SDPA's AMX kernel by the CPU, not by the capped
    # ATEN path, and that kernel refuses to run under it (benchmarks/RESULTS.md, "An Intel CPU with AMX")
    ("ATEN_CPU_CAPABILITY", "pack_vnni2 is only supported when avx512 is supported"):
        "torch's SDPA cannot run under a capped ATEN_CPU_CAPABILITY on this CPU (AMX)",
}


@dataclass(frozen=True)
class Environment:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    prefix: bool = False  # runs on the reference prefix instead of the whole text


def environments(portable: bool, cuda: bool) -> list[Environment]:
    out = [Environment("torch, 2 threads"), Environment("torch, 1 thread", args=("--threads", "1")),
           Environment("ATEN_CPU_CAPABILITY=default", {"ATEN_CPU_CAPABILITY": "default"}),
           Environment("ATEN_CPU_CAPABILITY=avx2", {"ATEN_CPU_CAPABILITY": "avx2"}),
           Environment("ONEDNN_MAX_CPU_ISA=AVX2", {"ONEDNN_MAX_CPU_ISA": "AVX2"}),
           Environment("MKL_ENABLE_INSTRUCTIONS=AVX2", {"MKL_ENABLE_INSTRUCTIONS": "AVX2"})]
    if cuda:
        out.append(Environment("cuda", args=("--device", "cuda")))
    if portable:
        out += [Environment("no native stages", args=("--no-native",)),
                Environment("native stages, not fused", args=("--no-fused",)),
                Environment("fused kernels' scalar loops", args=("--fused-scalar",)),
                Environment("torch, 2 threads (prefix)", prefix=True),
                Environment("int64 reference (prefix)", args=("--exact",), prefix=True)]
    return out


def run_child(ckpt: Path, text: Path, tokens: int, target: str, e: Environment, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "speckv.predictor.check", "--child", str(ckpt), str(text),
           str(min(tokens, REFERENCE_TOKENS) if e.prefix else tokens), "--target", target, *e.args]
    try:
        proc = subprocess.run(cmd, env={**os.environ, **e.env}, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": e.name, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        why = next((v for (var, line), v in UNAVAILABLE.items() if var in e.env and any(line in t for t in tail)), None)
        if why is not None:
            return {"name": e.name, "unavailable": why}
        return {"name": e.name, "error": " | ".join(tail) or f"exit {proc.returncode}"}
    return {"name": e.name, **json.loads(proc.stdout.strip().splitlines()[-1])}


def default_jobs() -> int:
    """Children at a time: one per two CPUs (the default environment itself runs 2 threads)."""
    return max(1, (os.cpu_count() or 1) // 2)


def check(ckpt: Path, text: Path, tokens: int, target: str = "default", timeout: float = 1800.0,
          jobs: int | None = None) -> dict[str, Any]:
    """Run every environment, ``jobs`` children at a time (``default_jobs()``); ``agree`` is False
    when two digests of the same token count differ or an environment failed (one this machine
    cannot run is left out: ``UNAVAILABLE``). The report lists the environments in their order."""
    import torch

    from .checkpoint import load_checkpoint
    from .ladder import PORTABLE

    rung = load_checkpoint(ckpt).rung
    envs = environments(rung.kind == PORTABLE, torch.cuda.is_available())
    with ThreadPoolExecutor(max(1, jobs or default_jobs())) as pool:  # NOTE: threads that wait on processes
        results = list(pool.map(lambda e: run_child(ckpt, text, tokens, target, e, timeout), envs))
    digests: dict[int, set[str]] = {}
    for r in results:
        if "mu_sha256" in r:
            digests.setdefault(r["tokens"], set()).add(r["mu_sha256"])
    agree = all("error" not in r for r in results) and all(len(d) == 1 for d in digests.values())
    return {"checkpoint": str(ckpt), "rung": rung.name, "environments": results, "agree": agree}


def mu_digest(mu: Any) -> str:
    from speckv.kv import bf16_bits

    return hashlib.sha256(bf16_bits(mu.contiguous().cpu()).tobytes()).hexdigest()


def _child(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="speckv.predictor.check --child")
    ap.add_argument("ckpt")
    ap.add_argument("text")
    ap.add_argument("tokens", type=int)
    ap.add_argument("--target", default="default")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--no-native", action="store_true")
    ap.add_argument("--no-fused", action="store_true")
    ap.add_argument("--fused-scalar", action="store_true")
    a = ap.parse_args(argv)
    from . import integer
    from . import target as tgt
    from .calibrate import read_text
    from .checkpoint import load_checkpoint
    from .portable import portable_kv
    from .predict import Predictor

    if a.threads is not None:
        tgt.COMPUTE_THREADS = a.threads  # NOTE: deterministic_torch reads it at each forward
        integer.FUSED_THREADS = a.threads
    integer.NATIVE, integer.FUSED = not a.no_native, not a.no_fused
    integer.FUSED_SCALAR = a.fused_scalar
    target = tgt.load_target(a.target)
    ids = target.tokenize(read_text(a.text), a.tokens)
    pred = Predictor.from_checkpoint(load_checkpoint(a.ckpt), target).to(a.device)
    mu = portable_kv(pred.model, ids, exact=True) if a.exact else pred.mu(ids)
    print(json.dumps({"tokens": int(len(ids)), "mu_sha256": mu_digest(mu)}))


if __name__ == "__main__":  # pragma: no cover - run as the check's child process
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2:])
    else:
        sys.exit("usage: speckv predictor check DIR --text FILE")
