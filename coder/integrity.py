"""The checks a decoder makes: a stream's header against its predictor and prompt
(``check_header``), each chunk's mu against its fingerprint (``check_mu``), and the check every
decoded chunk passes: it is only ever returned through
``verified``, which raises IntegrityError unless its raw bytes match the chunk's
``raw_digest``, computed as the stream's format version defines it (blake2b-128 in
version 2, XXH3-128 in version 3; the digests themselves are ``speckv.digests``).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from speckv.digests import algorithm_of, digest, prompt_digest
from speckv.errors import IntegrityError, MuMismatchError, PinMismatchError, PromptMismatchError

from . import container as ct
from .config import MAX_ELEMS_PER_LANE
from .reference import thread_map

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from .plan import Plan

Sums = tuple[bytes, bytes]  # a coded chunk's (mu_fingerprint, raw_digest)
_helper: tuple[int, ThreadPoolExecutor] | None = None  # (pid, the digest thread): see Ahead
_helper_lock = threading.Lock()


def verified(c: ct.Chunk, bits: np.ndarray, version: int, dtype: DTypeLike | None = None) -> np.ndarray:
    """``bits`` (chunk c's decoded layers, from a format ``version`` stream) as ``dtype``,
    checked against c's raw_digest."""
    if dtype is not None:
        bits = np.ascontiguousarray(bits, dtype)
    if c.raw_digest != digest(c.aux, bits, algorithm=algorithm_of(version)):
        raise IntegrityError(f"chunk {c.index}: decoded KV fails its checksum")
    return bits


def verified_all(h: ct.StreamHeader, chunks: list[ct.Chunk], bits: list[np.ndarray], threads: int) -> list[np.ndarray]:
    """Each chunk's decoded bit patterns as ``verified`` returns them (on ``threads`` threads)."""
    dt = np.uint16 if h.dtype == ct.DTYPE_BF16 else np.uint8
    return thread_map(threads, lambda a: verified(a[0], a[1].reshape((a[0].layer_count,) + h.shape[1:]), h.version,
                                                  dt), list(zip(chunks, bits, strict=True)))


def check_header(h: ct.StreamHeader, ids: np.ndarray, pin: str, models: list[int],
                 sigma_shape: tuple[int, ...]) -> None:
    """Raise unless a decoder whose predictor has ``pin``, residual ``models`` and log2 sigma of
    ``sigma_shape`` ``(layers, 2, heads, dim)`` can decode the stream of header ``h`` for prompt
    ``ids`` (a stored stream needs no predictor: only its prompt and token count are checked)."""
    if h.model != ct.MODEL_STORED and h.pin != bytes.fromhex(pin):
        raise PinMismatchError(f"stream was coded with predictor {h.pin.hex()}, this decoder has {pin}")
    if h.model != ct.MODEL_STORED and h.model not in models:
        raise IntegrityError(f"probability model id {h.model} is not one this checkpoint has ({models})")
    if h.prompt_digest != prompt_digest(ids):
        raise PromptMismatchError("prompt token ids differ from the encoder's")
    if h.elems_per_lane > MAX_ELEMS_PER_LANE:
        raise IntegrityError(f"elems_per_lane {h.elems_per_lane} exceeds {MAX_ELEMS_PER_LANE}")
    want = (sigma_shape[0], 2, sigma_shape[2], len(ids), sigma_shape[3])
    if h.model == ct.MODEL_STORED:  # NOTE: needs no predictor: another model's stored KV (a rolling upgrade)
        want = (*h.shape[:3], len(ids), h.shape[4])
    if h.shape != want:
        raise IntegrityError(f"stream shape {h.shape} does not fit this predictor and prompt {want}")


def check_mu(plan: Plan, h: ct.StreamHeader, chunks: list[ct.Chunk], threads: int) -> None:
    """Raise MuMismatchError at the first chunk whose mu_fingerprint is not the digest of this
    side's mu of its layers (on ``threads`` threads: XXH3 releases the GIL)."""
    algorithm = algorithm_of(h.version)
    same = thread_map(threads, lambda c: c.mu_fingerprint == digest(plan.mu_predicted[plan.chunk_slice(h, c.index)],
                                                                    algorithm=algorithm), chunks)
    for c, ok in zip(chunks, same, strict=True):
        if not ok:
            raise MuMismatchError(f"chunk {c.index}: the decoder's mu differs from the encoder's "
                                  "(predictor, hardware or library build differ)")


def chunk_sums(plan: Plan, h: ct.StreamHeader, i: int) -> Sums:
    """Coded chunk ``i``'s (mu_fingerprint, raw_digest): the stream version's digest
    (FORMAT.md) of its mu and of its aux then raw bit patterns (the aux of a chunk with rANS
    blocks, which every chunk with elements has)."""
    sl, algorithm = plan.chunk_slice(h, i), algorithm_of(h.version)
    assert plan.x is not None  # an encoding plan
    return (digest(plan.mu_predicted[sl], algorithm=algorithm),
            digest(plan.aux(sl, blocks=h.chunk_blocks(i) > 0), plan.x[sl], algorithm=algorithm))


def _digest_thread() -> ThreadPoolExecutor:
    """The process's one digest thread, started on first use. Every encode in the process queues
    its digests there (XXH3 hashes several GB/s: one thread keeps up with the backends).
    NOTE: keyed by pid: a forked child inherits the executor but not its thread, and a job
    submitted there would never run, so the child starts its own."""
    global _helper
    with _helper_lock:
        if _helper is None or _helper[0] != os.getpid():
            _helper = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="speckv-digest"))
        return _helper[1]


class Ahead:
    """Each job's digests: with ``threads`` > 1 computed on the digest thread while the caller goes
    on (the backend's encode: XXH3 releases the GIL, so the digests stop being a serial step of
    every chunk); with 1 thread on the caller, when ``result`` asks for them."""

    def __init__(self, threads: int, jobs: Sequence[Callable[[], Sums]]) -> None:
        self._jobs = jobs
        self._job: Future[list[Sums]] | None = None
        if threads > 1 and jobs:
            self._job = _digest_thread().submit(lambda: [j() for j in jobs])

    def result(self) -> list[Sums]:
        """The digests, in the jobs' order (a job's exception raised here)."""
        return [j() for j in self._jobs] if self._job is None else self._job.result()

    def cancel(self) -> None:
        """Drop the digests (the encode failed): not started, they never run."""
        if self._job is not None:
            self._job.cancel()

    def __enter__(self) -> "Ahead":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:  # NOTE: the encode failed: its digests are not wanted
            self.cancel()
