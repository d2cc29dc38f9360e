"""How long a sidecar's idle OpenMP workers spin, whether MKL caches its buffers, and a target
prefill timed under the engine's own.

torch's OpenMP workers (libgomp) spin after each parallel op, 300,000 rounds by default, before
they sleep. In a predictor pass torch ops alternate with the native kernels, whose own thread
pool (coder/kernels/spk_pool.h) then shares the cores with workers that only spin. A sidecar
therefore bounds the spin (``GOMP_SPINCOUNT``, a wait policy: it changes no bit): its pass gets
~13% faster on the 2-core AMX Xeon, while a plain torch prefill gets ~5% slower under the same
setting, so an engine keeps libgomp's default (``benchmarks/omp_spin.py``, RESULTS.md).

A sidecar also turns off MKL's own memory manager (``MKL_DISABLE_FAST_MM=1``), which keeps
the buffers of the FP32 GEMMs it served (the exact head's linears) for the next call of that
size. It changes no bit and no transfer time within noise; six distinct prompts of 2,000-2,048
tokens in a loop (``benchmarks/load.py --clients 1 --seconds 40 --tokens 2048,2040,...``, two runs
each) peaked at 497-498 MiB in the decoder with it and 503-509 without, the encoder at 539-542
against 553-558.

NOTE: libgomp and MKL read their environment once, when torch first loads them;
``use_sidecar_policy`` must run before anything imports torch, and an operator's own
``GOMP_SPINCOUNT`` or ``MKL_DISABLE_FAST_MM`` is kept (MKL reads that one's presence: any value
turns its manager off).

``TargetTimer`` times the target's prefill in a child process that runs under the environment
the command started with (the engine's), so ``speckv bench`` compares the predictor under the
sidecar's policy with the target under the engine's, alternately, as a deployment runs them.
Every prefill the child runs must give the KV this process computed (its digest), so it times the
same computation.

NOTE: on this machine a process's first target prefill has, about once in 50 processes under
load, given KV that differs from every later one: its first cos came out less exact (RESULTS.md, "The
first cos of a process"; ``target.deterministic_torch`` now warms it up). Against whatever else a
first pass may set up, a disagreement is looked at once more
before it counts: a child whose first prefill disagrees runs one more (``TargetTimer``), and a
child whose two prefills agree with each other but not with this process's KV has this process
compute its KV again (``agreed_timer``). Either recovery is logged as a warning; a second
disagreement raises.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

SPIN_VAR = "GOMP_SPINCOUNT"
SIDECAR_SPINCOUNT = "10000"  # rounds; libgomp's default is 300000 (benchmarks/omp_spin.py)
MKL_FAST_MM_VAR = "MKL_DISABLE_FAST_MM"
SIDECAR_MKL_FAST_MM = "1"  # MKL frees its buffers as the sidecar's allocator does (module docstring)

logger = logging.getLogger(__name__)
_engine_env: dict[str, str] | None = None  # the environment before use_sidecar_policy changed it


def use_sidecar_policy() -> str:
    """Set the sidecar's spin count and MKL's buffer policy for this process where the operator set
    none; the spin policy in force (``policy()``). Once torch is loaded (a caller in-process, a
    test) libgomp and MKL have read their settings already, and nothing is changed."""
    global _engine_env
    if _engine_env is None:
        _engine_env = dict(os.environ)
    if "torch" not in sys.modules:
        os.environ.setdefault(SPIN_VAR, SIDECAR_SPINCOUNT)
        os.environ.setdefault(MKL_FAST_MM_VAR, SIDECAR_MKL_FAST_MM)
    return policy()


def engine_env() -> dict[str, str]:
    """The environment this process started with (an engine's: libgomp's default policy unless set)."""
    return dict(os.environ if _engine_env is None else _engine_env)


def policy(env: dict[str, str] | None = None) -> str:
    """``GOMP_SPINCOUNT=N`` or ``default``, as the JSON reports name a process's policy."""
    value = (os.environ if env is None else env).get(SPIN_VAR)
    return "default" if value is None else f"{SPIN_VAR}={value}"


class TargetTimer:
    """A child process that loads ``target`` and times its prefill of ``ids`` on each ``time()``.

    Lifecycle: the constructor writes the ids, starts the child under ``engine_env()`` and waits
    for it to load; each ``time()`` runs one prefill there and returns its seconds; ``close`` ends
    it. The child's first prefill (in the constructor) is a warm-up, and its KV digest must equal
    ``kv_digest``; a child that exits or disagrees is a RuntimeError, the child and its files gone."""

    def __init__(self, target: str, ids: np.ndarray, kv_digest: str) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="speckv-target-timer-")
        path = Path(self._dir.name) / "ids.npy"
        np.save(path, np.asarray(ids, dtype=np.int64))
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, target, str(path)], env=engine_env(),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.kv_digest = kv_digest
        try:
            ready = self._read()
            self.policy: str = ready["policy"]
            if ready.get("kv_digest") != kv_digest:
                again = self._run()["kv_digest"]  # NOTE: a first prefill may differ (module docstring)
                if again != kv_digest:
                    raise TimerDisagrees(ready.get("kv_digest"), again, kv_digest)
                logger.warning("the timer's first target prefill gave KV %s, its second %s as expected",
                               ready.get("kv_digest"), kv_digest)
        except BaseException:
            self.close()
            raise

    def _run(self) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write("go\n")
        self._proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the target timer exited ({self._proc.wait()}) before it answered")
        return json.loads(line)

    def time(self) -> float:
        """Seconds of one more prefill in the child; its KV must be the expected one."""
        out = self._run()
        if out["kv_digest"] != self.kv_digest:
            raise RuntimeError(f"the timer's target prefill gave KV {out['kv_digest']}, not {self.kv_digest}")
        return float(out["s"])

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._dir.cleanup()

    def __enter__(self) -> "TargetTimer":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


def kv_digest(kv: Any) -> str:
    """The XXH3-128 of a KV's BF16 bits, hex (what the timer's first prefill must reproduce)."""
    from speckv.digests import XXH3_128, digest
    from speckv.kv import bf16_bits

    return digest(bf16_bits(kv), algorithm=XXH3_128).hex()


class TimerDisagrees(RuntimeError):
    """The timer's first two prefills both gave KV other than the expected ``want``."""

    def __init__(self, first: str | None, second: str, want: str) -> None:
        super().__init__(f"the timer's target prefill gave KV {first}, then {second}, not {want}")
        self.first, self.second, self.want = first, second, want


def agreed_timer(target: str, ids: np.ndarray, kv: Any, recompute: Callable[[], Any]) -> tuple[TargetTimer, Any]:
    """A ``TargetTimer`` that agrees with ``kv``, and the KV it agrees with: where the child's two
    prefills agree with each other and not with ``kv``, this process's pass was the odd one, and
    ``recompute()`` gives its KV once more (module docstring); any other disagreement raises."""
    try:
        return TargetTimer(target, ids, kv_digest(kv)), kv
    except TimerDisagrees as e:
        if e.first != e.second:
            raise
        again = recompute()
        if kv_digest(again) != e.second:
            raise RuntimeError(f"this process's target prefill gave KV {e.want}, then {kv_digest(again)}; "
                               f"the timer's gave {e.second} twice") from e
        logger.warning("this process's first target prefill gave KV %s, its second %s as the timer's", e.want, e.second)
        return TargetTimer(target, ids, e.second), again


def _child(target: str, ids_path: str) -> None:
    import time

    from speckv.predictor.target import load_target

    tgt = load_target(target)
    ids = np.load(ids_path)
    print(json.dumps({"kv_digest": kv_digest(tgt.kv(ids)), "policy": policy()}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t0 = time.perf_counter()
        kv = tgt.kv(ids)
        s = time.perf_counter() - t0
        print(json.dumps({"s": s, "kv_digest": kv_digest(kv)}), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
