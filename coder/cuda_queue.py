"""The CUDA coder for a serving process: concurrent callers' encodes (decodes) share a launch a pass.

A sidecar codes each transfer's chunks on a thread of its own (``asyncio.to_thread``), a few layers
at a time: alone, such a call is a few dozen warps on a GPU of thousands. ``QueuedCuda`` queues the
calls; one worker thread takes the queued calls of one kind (encode or decode) and one key (lane
length, tables, KV dtype, heads, dim) and runs them as one ``CudaCoder.encode_batch`` /
``decode_batch``. Each caller gets its own result or error: a corrupt stream fails its own decode
only, and a batch that raises (an argument only one call got wrong) runs again call by call. Nothing
waits to fill a batch: a call that finds the coder idle runs at once on its caller's thread (no
hand-off to another thread: a lone caller pays nothing for the queue), and the calls that arrive
meanwhile queue; a worker thread then runs them as one batch, and the next batch with what arrived
during that launch (as ``server/batcher.py`` does with predictor passes). The worker thread exists
only while calls are queued or running.

Same signatures as ``CudaCoder.encode`` / ``decode`` (numpy in and out); everything else is the
wrapped coder's.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .cuda import CudaCoder, Request
from .native import EncodedChunk
from .rans import RansBlocks
from .tables import CodingTables

logger = logging.getLogger(__name__)
MAX_BATCH_ELEMENTS = 1 << 25  # a batch's KV scalars (64 MB of BF16): bounds its device scratch (~12 bytes each)


@dataclass(eq=False)  # NOTE: compared by identity: its arrays have no truth value
class _Call:
    kind: str  # "encode" | "decode"
    key: tuple
    request: Request
    streams: Sequence[tuple[RansBlocks, bytes]] | None  # decode
    elements: int
    future: "cf.Future[Any]"


class QueuedCuda:
    """A ``CudaCoder`` behind a queue (module docstring)."""

    _load_lock = threading.Lock()
    _cache: "QueuedCuda | None" = None

    @classmethod
    def load(cls) -> "QueuedCuda":
        """The process's queue, in front of ``CudaCoder.load()``: every codec's calls share it."""
        with cls._load_lock:
            if cls._cache is None:
                cls._cache = cls(CudaCoder.load())
            return cls._cache

    def __init__(self, coder: CudaCoder, max_elements: int = MAX_BATCH_ELEMENTS) -> None:
        if max_elements < 1:
            raise ValueError(f"max_elements must be >= 1, not {max_elements}")
        self.coder, self.max_elements = coder, max_elements
        self.name = coder.name
        self.device = coder.cp.cuda.Device().id  # the worker codes on the device the coder was made on
        self._pending: deque[_Call] = deque()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._inline = False  # a call runs on its caller's thread
        self.launches = self.calls = 0  # batches run, calls they carried (sizes: calls / launches)

    def __getattr__(self, name: str) -> Any:  # prepare_mu, encode_device, ...: the coder's own
        if name == "coder" or name.startswith("__"):  # NOTE: a copy without __init__ must not recurse
            raise AttributeError(name)
        return getattr(self.coder, name)

    def encode(self, x: np.ndarray, mu: np.ndarray, log2_sigma: np.ndarray, layer_counts: Sequence[int],
               elems_per_lane: int, tables: CodingTables) -> list[EncodedChunk]:
        """CudaCoder.encode, batched with the concurrent callers' encodes."""
        x = np.ascontiguousarray(x)
        return self._submit("encode", x, Request(x, np.ascontiguousarray(mu), log2_sigma, layer_counts),
                            elems_per_lane, tables, None)

    def decode(self, mu: np.ndarray, log2_sigma: np.ndarray, layer_counts: Sequence[int], elems_per_lane: int,
               streams: Sequence[tuple[RansBlocks, bytes]], tables: CodingTables, out: np.ndarray) -> None:
        """CudaCoder.decode, batched with the concurrent callers' decodes (``out`` written only on success)."""
        dev = self.coder.cp.empty(out.shape, out.dtype)
        self._submit("decode", out, Request(dev, np.ascontiguousarray(mu), log2_sigma, layer_counts),
                     elems_per_lane, tables, streams)
        self.coder.copy_out(dev, out)  # NOTE: complete: decode_batch waits for its last pass

    def _submit(self, kind: str, kv: np.ndarray, request: Request, epl: int, tables: CodingTables,
                streams: Sequence[tuple[RansBlocks, bytes]] | None) -> Any:
        # NOTE: id(tables): the caller holds them until its future ends, so no other object has that id meanwhile
        key = (epl, id(tables), kv.dtype.itemsize, kv.shape[2:3], kv.shape[4:5])
        call = _Call(kind, key + (tables,), request, streams, int(kv.size), cf.Future())
        with self._lock:
            inline = self._worker is None and not self._inline and not self._pending
            if inline:
                self._inline = True
            else:
                self._pending.append(call)
                if self._worker is None and not self._inline:  # NOTE: else the running call starts one
                    try:
                        self._start_worker()
                    except BaseException:
                        self._pending.remove(call)
                        raise
        if inline:
            self._run_inline(call)
        return call.future.result()

    def _start_worker(self) -> None:  # NOTE: lock held
        worker = threading.Thread(target=self._drain, name="speckv-cuda", daemon=True)
        worker.start()
        self._worker = worker

    def _run_inline(self, call: _Call) -> None:
        """A call that found the coder idle, on its caller's thread; then a worker for the calls that
        queued meanwhile."""
        try:
            with self.coder.cp.cuda.Device(self.device):  # NOTE: the caller's thread may use another device
                self._run([call] if call.future.set_running_or_notify_cancel() else [])
        finally:
            with self._lock:
                self._inline = False
                if self._pending and self._worker is None:
                    try:
                        self._start_worker()
                    except BaseException as e:  # noqa: BLE001 -- no thread: the queued calls end with the error
                        left, self._pending = list(self._pending), deque()
                        for c in left:
                            c.future.set_exception(e)

    def _take(self) -> list[_Call]:
        """The oldest call and the queued calls of its kind and key, up to max_elements (lock held)."""
        first = self._pending.popleft()
        batch, rest, n = [first], deque[_Call](), first.elements
        for c in self._pending:
            if (c.kind, c.key) == (first.kind, first.key) and n + c.elements <= self.max_elements:
                batch.append(c)
                n += c.elements
            else:
                rest.append(c)
        self._pending = rest
        return batch

    def _drain(self) -> None:
        batch: list[_Call] = []
        try:
            self.coder.cp.cuda.Device(self.device).use()  # NOTE: a new thread starts on device 0
            while True:
                with self._lock:
                    if not self._pending:
                        self._worker = None
                        return
                    batch = self._take()
                self._run([c for c in batch if c.future.set_running_or_notify_cancel()])
                batch = []
        except BaseException as e:  # noqa: BLE001 -- a dying worker fails every call it would leave waiting
            with self._lock:
                left, self._pending, self._worker = batch + list(self._pending), deque(), None
            for c in left:
                if not c.future.done():
                    c.future.set_exception(e)
            logger.error("speckv: the CUDA queue's worker failed; its calls end with the error", exc_info=e)

    def _run(self, batch: list[_Call]) -> None:
        """One batch; every future of it ends, whatever fails (NOTE: a worker that died here would leave
        every later call waiting)."""
        if not batch:
            return
        self.launches, self.calls = self.launches + 1, self.calls + len(batch)
        try:
            outcomes = self._launch(batch)
        except Exception as e:  # noqa: BLE001 -- one call's bad argument fails a launch: each call alone
            outcomes = [e] if len(batch) == 1 else [self._alone(c) for c in batch]
        except BaseException as e:  # noqa: BLE001 -- every caller learns of it
            outcomes = [e] * len(batch)
        for c, o in zip(batch, outcomes, strict=True):
            if isinstance(o, BaseException):
                c.future.set_exception(o)
            else:
                c.future.set_result(o)

    def _launch(self, batch: list[_Call]) -> list[Any]:
        """Results (encode: chunks; decode: None) or errors, in ``batch``'s order."""
        epl, tables = batch[0].key[0], batch[0].key[-1]
        reqs = [c.request for c in batch]
        if batch[0].kind == "encode":
            return list(self.coder.encode_batch(reqs, epl, tables))
        return list(self.coder.decode_batch(reqs, epl, [c.streams or [] for c in batch], tables))

    def _alone(self, call: _Call) -> Any:
        try:
            return self._launch([call])[0]
        except Exception as e:  # noqa: BLE001 -- this call's own error
            return e
