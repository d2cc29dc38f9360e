"""Predictor passes of concurrent transfers, batched: one worker thread, several prompts a pass.

Every transfer needs its prompt's mu on both sidecars. A pass of a short prompt
costs mostly its fixed per-layer work (the W8A8 rung: ~15 small ops per layer),
so under load a sidecar spends its predictor time on overhead. The batcher keeps
one queue per runtime: ``submit(ids, on_layer, fp8_attention)`` returns a future;
a worker thread takes every queued prompt (first come first served, up to
``max_tokens`` tokens together, and always at least one) and runs them as one
pass (``Predictor.stream_batch``), each prompt's layers going to its own
``on_layer`` as the pass produces them. Nothing waits to fill a batch: an idle
sidecar starts a lone prompt at once, and a busy one batches what arrived during
the pass before. A prompt's mu is bit for bit its lone pass's (``w8a8_pass``), so
the peer's predictor, batched otherwise or not at all, computes the same bits.

The worker thread exists only while prompts are queued or running: it ends when
the queue is empty and the next ``submit`` starts another.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from speckv.heap import predictor_pass, release_free

if TYPE_CHECKING:  # pragma: no cover
    from speckv.kv import Fp8Attention
    from speckv.predictor.target import LayerSink

DEFAULT_BATCH_TOKENS = 2048  # a pass this long already fills the GEMMs on a CPU; bounds its activations


@dataclass
class _Pending:
    ids: np.ndarray
    on_layer: "LayerSink"
    fp8_attention: "Fp8Attention | None"
    future: "cf.Future[None]"


class PredictorBatcher:
    """A queue of prompts in front of one predictor (``Predictor.stream_batch``)."""

    def __init__(self, predictor: Any, max_tokens: int = DEFAULT_BATCH_TOKENS) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {max_tokens}")
        self.predictor, self.max_tokens = predictor, max_tokens
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None  # the running worker, while there is work
        self.passes = self.prompts = 0  # passes run, prompts they carried (sizes: prompts / passes)
        self.on_pass: Callable[[int], None] | None = None  # each pass's prompt count (metrics), on the worker

    def submit(self, ids: np.ndarray, on_layer: "LayerSink",
               fp8_attention: "Fp8Attention | None" = None) -> "cf.Future[None]":
        """Queue a prompt; the future ends with its pass (its error, if it has one)."""
        p = _Pending(np.asarray(ids), on_layer, fp8_attention, cf.Future())
        with self._lock:
            self._pending.append(p)
            if self._worker is None:
                worker = threading.Thread(target=self._drain, name="speckv-predictor", daemon=True)
                try:
                    worker.start()
                except BaseException:  # e.g. no thread left: this prompt fails, the queue stays usable
                    self._pending.remove(p)
                    raise
                self._worker = worker
        return p.future

    def join(self, timeout: float) -> bool:
        """Wait for the worker to finish what is queued (a stopping sidecar: its transfers'
        prompts stop at their next layer); False if it is still running after ``timeout``."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)
            return not worker.is_alive()
        return True

    def _take(self) -> list[_Pending]:
        """The next batch, first come first served (call with the lock held)."""
        batch, tokens = [self._pending.popleft()], 0
        tokens = len(batch[0].ids)
        while self._pending and tokens + len(self._pending[0].ids) <= self.max_tokens:
            tokens += len(self._pending[0].ids)
            batch.append(self._pending.popleft())
        return batch

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._worker = None
                    break
                batch = self._take()
            self._run([p for p in batch if p.future.set_running_or_notify_cancel()])  # cancelled: skipped
        release_free()  # NOTE: idle now: the passes' freed activations go back to the kernel

    def _run(self, batch: list[_Pending]) -> None:
        """One pass; every future of it ends, whatever fails (NOTE: a worker that died here would
        leave every later prompt waiting)."""
        if not batch:
            return
        try:
            self.passes, self.prompts = self.passes + 1, self.prompts + len(batch)
            if self.on_pass is not None:
                self.on_pass(len(batch))
            with predictor_pass(getattr(self.predictor, "device", "cpu")):
                errors = list(self.predictor.stream_batch([(p.ids, p.on_layer, p.fp8_attention) for p in batch]))
            if len(errors) != len(batch):
                raise RuntimeError(f"the predictor answered {len(errors)} of {len(batch)} prompts")
        except BaseException as e:  # noqa: BLE001 -- every prompt of the pass learns of it
            errors = [e] * len(batch)
        for p, err in zip(batch, errors, strict=True):
            if err is None:
                p.future.set_result(None)
            else:
                p.future.set_exception(err)
