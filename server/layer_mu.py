"""The predictor's mu of one prompt, layer by layer, as the forward pass produces it.

Lifecycle: ``LayerMu.start(predictor, ids, shape)`` runs the predictor in a
worker thread (or, given a ``batcher.PredictorBatcher``, queues the prompt
there); each decoder layer's mu lands in ``bits`` (filled in place) the moment
that layer has run, so a sidecar codes or decodes chunk i (and checks its
mu digest with the peer) while the predictor still computes the later layers:
no whole-mu gate. ``await upto(n)`` waits for layers ``[0, n)``;
``stop()`` ends the pass at its next layer (a cancelled transfer stops paying for
its predictor). The first error (the predictor's, or the stop) is raised by every
later ``upto``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from speckv.digests import XXH3_128, digest, prompt_digest
from speckv.heap import predictor_pass, release_free

if TYPE_CHECKING:  # pragma: no cover
    from speckv.kv import Fp8Attention
    from speckv.predictor.predict import Predictor

    from .batcher import PredictorBatcher


PREDICTOR_TASK = "speckv-predictor"  # the name of every LayerMu task (a stopping sidecar waits for them)


class PredictorStopped(Exception):
    """Raised inside the forward pass (from a layer hook) once ``LayerMu.stop`` was called."""


class LayerMu:
    """mu ``(layers, 2, kv_heads, tokens, head_dim)`` BF16 bits, arriving layer by layer."""

    def __init__(self, shape: tuple[int, ...], loop: asyncio.AbstractEventLoop) -> None:
        self.bits = np.zeros(shape, np.uint16)  # layers >= count are not computed yet
        self.count = 0  # layers ready
        self.ready_at = np.full(shape[0], -np.inf)  # perf_counter when each layer's mu existed (-inf: not yet)
        self.seconds = 0.0  # the whole pass, once it ended
        self.error: BaseException | None = None
        self._loop = loop
        self._changed = asyncio.Event()
        self._stopped = False
        self.task: asyncio.Future | None = None
        self.inputs = "?"  # what the pass computes from: the prompt's digest (and the FP8 reading's), for logs
        self._queued: "concurrent.futures.Future[None] | None" = None  # its place in a batcher's queue

    @classmethod
    def start(cls, predictor: "Predictor", ids: np.ndarray, shape: tuple[int, ...],
              fp8_attention: "Fp8Attention | None" = None, batcher: "PredictorBatcher | None" = None) -> "LayerMu":
        """The pass on a worker thread, or queued on ``batcher`` to run with other transfers'
        prompts (``fp8_attention``: as ``Predictor.mu``)."""
        loop = asyncio.get_running_loop()
        mu = cls(shape, loop)
        mu.inputs = prompt_digest(ids).hex()[:12] + ("" if fp8_attention is None else
                                                      "/fp8 " + digest(fp8_attention.key, algorithm=XXH3_128).hex()[:8])
        work = mu._batched(batcher, ids, fp8_attention) if batcher is not None else \
            asyncio.to_thread(mu._run, predictor, ids, fp8_attention)
        mu.task = loop.create_task(work, name=PREDICTOR_TASK)
        mu.task.add_done_callback(mu._ended)
        return mu

    def _on_layer(self, i: int, bits: np.ndarray) -> None:  # NOTE: on the predictor's thread
        if self._stopped:
            raise PredictorStopped("the transfer no longer needs this predictor pass")
        self.bits[i] = bits
        self.ready_at[i] = time.perf_counter()
        self._loop.call_soon_threadsafe(self._advance, i + 1)

    def _run(self, predictor: "Predictor", ids: np.ndarray, fp8_attention: "Fp8Attention | None") -> None:
        t0 = time.perf_counter()
        try:
            with predictor_pass(getattr(predictor, "device", "cpu")):  # bits holds the layers: the pass keeps none
                predictor.stream(ids, self._on_layer, fp8_attention=fp8_attention)
        finally:
            release_free()  # the pass's freed activations (server/memory.py)
        self.seconds = time.perf_counter() - t0

    async def _batched(self, batcher: "PredictorBatcher", ids: np.ndarray,
                       fp8_attention: "Fp8Attention | None") -> None:
        t0 = time.perf_counter()
        self._queued = batcher.submit(ids, self._on_layer, fp8_attention)
        await asyncio.wrap_future(self._queued)
        self.seconds = time.perf_counter() - t0  # NOTE: its wait in the queue included

    def _advance(self, count: int) -> None:
        self.count = max(self.count, count)
        self._notify()

    def _ended(self, task: "asyncio.Future[Any]") -> None:
        if task.cancelled():
            self._stopped = True  # a batched pass still running drops this prompt at its next layer
        err = PredictorStopped("cancelled") if task.cancelled() else task.exception()
        if err is None and self.count < self.bits.shape[0]:
            err = RuntimeError(f"the predictor produced {self.count} of {self.bits.shape[0]} layers")
        if err is not None and self.error is None:
            self.error = err
        self._notify()

    def _notify(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def upto(self, n: int) -> np.ndarray:
        """``bits`` once layers ``[0, n)`` exist (raises the predictor's error, if any)."""
        while self.count < n:
            if self.error is not None:
                raise self.error
            await self._changed.wait()
        return self.bits

    def ready_time(self, start: int, stop: int) -> float:
        """When layers ``[start, stop)`` all existed (perf_counter; -inf when none was timed)."""
        return float(self.ready_at[start:stop].max())

    def describe(self, start: int, stop: int) -> str:
        """Layers ``[start, stop)`` of mu as short digests, with the pass's inputs: what two sidecars'
        logs compare when their predictors disagree on a chunk."""
        layers = " ".join(f"{i}:{digest(self.bits[i], algorithm=XXH3_128).hex()[:12]}" for i in range(start, stop))
        return f"prompt {self.inputs}, mu layers {layers}"

    async def digest_of(self, start: int, stop: int, algorithm: int) -> bytes:
        """The ``algorithm`` digest of layers ``[start, stop)`` of mu (the per-chunk
        PredictorCheck: the stream version's digest, ``speckv.digests.algorithm_of``)."""
        bits = await self.upto(stop)
        return digest(bits[start:stop], algorithm=algorithm)

    async def done(self) -> float:
        """Wait for the whole pass; its seconds."""
        await self.upto(self.bits.shape[0])
        if self.task is not None:
            await asyncio.shield(self.task)
        return self.seconds

    def stop(self) -> None:
        """End the pass at its next layer (idempotent); waiting callers get PredictorStopped."""
        self._stopped = True
        if self._queued is not None:
            self._queued.cancel()  # still queued: it never runs (running: it stops at its next layer)
        if self.error is None and self.count < self.bits.shape[0]:
            self.error = PredictorStopped("the transfer ended before its predictor")
            self._notify()
