"""The decoder's transfers: per-request state shared by Transfer (producer) and
FetchKV (consumer), and the table that finds, limits and expires them.

Lifecycle of one transfer::

    RECEIVING --(all chunks decoded)--> READY --(FetchKV done)--> FETCHED
        \\--(error / cancel / lease)--> FAILED | CANCELLED

Decoded layers are published as soon as their chunk is verified, so FetchKV
streams layer l while later layers are still in flight; a layer handed out is
dropped at once and its bytes go back to the budget. An entry lingers after it
ends (as a tombstone for GetTransferStatus) until its lease runs out.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import numpy as np

from speckv.digests import KVDigest
from speckv.errors import RpcError
from speckv.kv import Fp8Attention
from speckv.status import in_band
from speckv.v1 import decoder_pb2 as dpb

from .budget import Holding

logger = logging.getLogger(__name__)

S = dpb.TransferState
LIVE = (S.TRANSFER_STATE_RECEIVING, S.TRANSFER_STATE_READY)


MAX_REQUEST_ID = 256  # characters; ids are echoed in status messages (gRPC metadata: 16 KiB at most)


def check_request_id(request_id: str) -> None:
    """INVALID_ARGUMENT unless 1 to MAX_REQUEST_ID characters."""
    if not 1 <= len(request_id) <= MAX_REQUEST_ID:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"request_id must be 1 to {MAX_REQUEST_ID} characters, not {len(request_id)}")


class DecoderTransfer:
    """One request's transfer on the decoder."""

    def __init__(self, request_id: str, n_layers: int, n_chunks: int, holding: Holding, algorithm: int) -> None:
        self.request_id = request_id
        self.n_layers, self.n_chunks = n_layers, n_chunks
        self.holding = holding
        self.state = S.TRANSFER_STATE_RECEIVING
        self.error: BaseException | None = None
        self.layers: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self.fetching = False
        self.chunks_received = self.chunks_decoded = 0
        self.wire_bytes = self.raw_bytes = 0
        self.predictor_s = self.decode_s = self.mu_wait_s = 0.0
        self.digest = KVDigest(algorithm)  # over the decoded layers, in order (the stream version's digest)
        self.verified: bytes | None = None  # the whole-transfer digest, once it matched
        self.layer_bytes = 0  # raw bytes per layer
        self.encoding = "speckv"  # or "stored" (asked for)
        self.fallback = False  # a chunk came stored: the predictors disagreed on its mu
        self.stored_chunks = 0  # chunks of a speckv stream that came stored (any reason)
        self.stored_reasons: set[str] = set()  # why they came stored (fallback_transfers_total)
        self.mu_hit = False  # mu came from the cache (or a pass another transfer started)
        self.stored_reason = ""  # Chunk.stored_reason of the record being reassembled
        self.peer = "?"
        self.model_id = ""  # the model the encoder named (FetchKVRequest.model_id is checked against it)
        self.fp8_attention: Fp8Attention | None = None  # how the engine's attention read its FP8 cache (mu follows)
        self.touched = time.monotonic()
        self.stopped = asyncio.Event()  # set when ended with an error: wakes the Transfer handler
        self._cond = asyncio.Condition()

    @property
    def live(self) -> bool:
        return self.state in LIVE

    async def publish(self, start: int, bits: np.ndarray, scales: np.ndarray | None) -> None:
        """Layers ``start ..`` of a verified chunk (bits ``(n, 2, H, T, D)``)."""
        async with self._cond:
            for k in range(bits.shape[0]):
                self.layers[start + k] = (bits[k], None if scales is None else scales[k])
                self.digest.update_layer(bits[k], None if scales is None else scales[k])
            self.chunks_decoded += 1
            self.touched = time.monotonic()
            self._cond.notify_all()

    async def end(self, state: int, error: BaseException | None = None) -> None:
        """Enter a final state (READY counts as final for the producer)."""
        async with self._cond:
            if not self.live:
                return
            self.state, self.error = state, error
            self.touched = time.monotonic()
            if state != S.TRANSFER_STATE_READY and state != S.TRANSFER_STATE_FETCHED:
                self.layers.clear()
                self.holding.close()
                self.stopped.set()
            self._cond.notify_all()

    async def take(self, layer: int, timeout: float) -> tuple[np.ndarray, np.ndarray | None]:
        """Wait for ``layer``, remove it and return it (raises if the transfer failed)."""
        async with self._cond:
            ok = await _wait(self._cond, lambda: layer in self.layers or self.error is not None
                             or self.state not in LIVE, timeout)
            if layer in self.layers:
                self.touched = time.monotonic()
                return self.layers.pop(layer)
            if not ok:
                raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"transfer {self.request_id!r}: layer {layer} did not arrive in {timeout:.1f} s")
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"transfer {self.request_id!r} {S.Name(self.state)}: {in_band(self.error).message}",
                           reason="TRANSFER_FAILED")

    async def wait_final(self, timeout: float) -> bytes:
        """Wait for the producer's verdict: the verified whole-transfer digest, or raise."""
        async with self._cond:
            ok = await _wait(self._cond, lambda: self.state != S.TRANSFER_STATE_RECEIVING, timeout)
            if self.verified is not None and self.state in (S.TRANSFER_STATE_READY, S.TRANSFER_STATE_FETCHED):
                return self.verified
            if not ok:
                raise RpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"transfer {self.request_id!r} was not verified within {timeout:.1f} s")
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"transfer {self.request_id!r} {S.Name(self.state)}: {in_band(self.error).message}",
                           reason="TRANSFER_FAILED")

    def status(self) -> dpb.TransferStatus:
        return dpb.TransferStatus(
            request_id=self.request_id, state=self.state, status=in_band(self.error),
            chunks_received=self.chunks_received, chunks_total=self.n_chunks,
            chunks_decoded=self.chunks_decoded, wire_bytes=self.wire_bytes, raw_bytes=self.raw_bytes)


async def _wait(cond: asyncio.Condition, pred, timeout: float) -> bool:
    try:
        await asyncio.wait_for(cond.wait_for(pred), timeout)
        return True
    except asyncio.TimeoutError:
        return False


class TransferTable:
    """Transfers by request id, with a cap on live ones and a lease on all."""

    def __init__(self, max_live: int, lease_s: float) -> None:
        self.max_live, self.lease_s = max_live, lease_s
        self._by_id: dict[str, DecoderTransfer] = {}
        self._arrived = asyncio.Condition()

    def __len__(self) -> int:
        return sum(t.live for t in self._by_id.values())

    def live(self) -> list[DecoderTransfer]:
        return [t for t in self._by_id.values() if t.live]

    async def add(self, t: DecoderTransfer) -> None:
        old = self._by_id.get(t.request_id)
        if old is not None and old.live:
            raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"transfer {t.request_id!r} is already in progress")
        if old is not None and old.state == S.TRANSFER_STATE_FETCHED:
            raise RpcError(grpc.StatusCode.ALREADY_EXISTS, f"transfer {t.request_id!r} was already delivered")
        if len(self) >= self.max_live:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{self.max_live} transfers in progress (max_transfers)")
        self._by_id[t.request_id] = t
        async with self._arrived:
            self._arrived.notify_all()

    def get(self, request_id: str) -> DecoderTransfer:
        check_request_id(request_id)
        t = self._by_id.get(request_id)
        if t is None:
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"no transfer with request id {request_id!r}")
        return t

    async def wait_for(self, request_id: str, timeout: float) -> DecoderTransfer:
        """The transfer ``request_id``, waiting up to ``timeout`` s for it to arrive; a failed
        or cancelled one is returned only if no retry under the same id replaces it in time
        (so a decode engine's FetchKV rides over the encoder's retry)."""
        check_request_id(request_id)
        ended = (S.TRANSFER_STATE_FAILED, S.TRANSFER_STATE_CANCELLED)

        def usable() -> bool:
            t = self._by_id.get(request_id)
            return t is not None and t.state not in ended

        async with self._arrived:
            await _wait(self._arrived, usable, timeout)
        if request_id not in self._by_id:
            raise RpcError(grpc.StatusCode.NOT_FOUND,
                           f"no transfer with request id {request_id!r} arrived within {timeout:.1f} s")
        return self._by_id[request_id]

    async def expire(self, now: float | None = None) -> int:
        """End live transfers idle past the lease and drop old tombstones; returns how many."""
        now = time.monotonic() if now is None else now
        n = 0
        for rid, t in list(self._by_id.items()):
            if now - t.touched < self.lease_s:
                continue
            if t.live:
                logger.warning("transfer %s expired after %.0f s idle (lease)", rid, now - t.touched,
                               extra={"request_id": rid, "peer": t.peer})
                await t.end(S.TRANSFER_STATE_FAILED,
                            RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "lease expired before FetchKV"))
            else:
                del self._by_id[rid]
            n += 1
        return n
