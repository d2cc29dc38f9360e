"""The decoder's transfers: per-request state shared by Transfer (producer) and
FetchKV (consumer), and the table that finds, limits and expires them.

Lifecycle of one transfer::

    RECEIVING --(all chunks decoded)--> READY --(FetchKV done)--> FETCHED
        \\--(error / cancel / lease)--> FAILED | CANCELLED

Decoded layers are published as soon as their chunk is verified, so FetchKV
streams layer l while later layers are still in flight; a layer handed out is
dropped at once and its bytes go back to the budget. An entry lingers after it
ends (as a tombstone for GetTransferStatus) until its lease runs out.

Tensor parallelism: each rank's Submit sends its own heads (``SubmitHeader.heads``)
under the same request id, so the table keys a transfer by (request id, head range).
Ranges of one request never overlap. A FetchKV names the heads it wants
(``cover``): they may be one transfer's, several transfers' side by side (a decode
engine with fewer ranks), or part of one (more ranks): ``take`` then hands out a
layer's heads in slices and drops the layer when every head is out; a transfer is
FETCHED once all of its heads were fetched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
import numpy as np

from speckv.digests import KVDigest
from speckv.errors import RpcError
from speckv.kv import Fp8Attention, HeadRange, some_heads
from speckv.status import in_band
from speckv.v1 import decoder_pb2 as dpb
from speckv.wire import heads_msg

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

    def __init__(self, request_id: str, n_layers: int, n_chunks: int, holding: Holding, algorithm: int,
                 n_heads: int, heads: HeadRange | None = None) -> None:
        self.request_id = request_id
        self.heads = heads  # SubmitHeader.heads (None: all of the model's)
        self.n_heads = n_heads  # heads in this transfer's KV
        self.claimed: set[int] = set()  # its heads claimed by FetchKV calls (never twice)
        self.fetched = 0  # heads whose fetch completed: FETCHED at n_heads
        self._given: dict[int, int] = {}  # layer -> heads handed out of it so far
        self.prompt = b""  # the stream's prompt digest: ranges assembled together must share it
        self.tokens = 0  # the prompt's tokens
        self.codec: Any = None  # the codec of its heads (coder/heads.py)
        self.n_layers, self.n_chunks = n_layers, n_chunks
        self.holding = holding
        self.state = S.TRANSFER_STATE_RECEIVING
        self.error: BaseException | None = None
        self.layers: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
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
        self.mu: Any = None  # its LayerMu while receiving (a mismatch's log shows its layers' digests)
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

    @property
    def span(self) -> tuple[int, int]:
        """The model heads ``[start, stop)`` this transfer holds."""
        return (0, self.n_heads) if self.heads is None else (self.heads.start, self.heads.stop)

    async def take(self, layer: int, timeout: float, part: slice | None = None,
                   ) -> tuple[np.ndarray, np.ndarray | None, int]:
        """Wait for ``layer`` and return its heads ``part`` (all: None), the scales and the bytes
        freed: the layer is dropped once every head of it was taken (raises if the transfer failed)."""
        async with self._cond:
            ok = await _wait(self._cond, lambda: layer in self.layers or self.error is not None
                             or self.state not in LIVE, timeout)
            if layer in self.layers:
                self.touched = time.monotonic()
                arr, scales = self.layers[layer]
                n = self.n_heads if part is None else part.stop - part.start
                given = self._given.pop(layer, 0) + n
                if given < self.n_heads:
                    self._given[layer] = given
                    return arr[:, part], scales, 0
                del self.layers[layer]
                return (arr if part is None else arr[:, part]), scales, arr.nbytes
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
            chunks_decoded=self.chunks_decoded, wire_bytes=self.wire_bytes, raw_bytes=self.raw_bytes,
            heads=heads_msg(self.heads))


async def _wait(cond: asyncio.Condition, pred, timeout: float) -> bool:
    try:
        await asyncio.wait_for(cond.wait_for(pred), timeout)
        return True
    except asyncio.TimeoutError:
        return False


Key = tuple[str, "HeadRange | None"]
ENDED = (S.TRANSFER_STATE_FAILED, S.TRANSFER_STATE_CANCELLED)


def _overlap(a: DecoderTransfer, b: DecoderTransfer) -> bool:
    """Whether two transfers of one request hold a head in common (all heads: always)."""
    return a.span[0] < b.span[1] and b.span[0] < a.span[1]


class TransferTable:
    """Transfers by (request id, head range), with a cap on live ones and a lease on all."""

    def __init__(self, max_live: int, lease_s: float) -> None:
        self.max_live, self.lease_s = max_live, lease_s
        self._by_id: dict[Key, DecoderTransfer] = {}
        self._arrived = asyncio.Condition()

    def __len__(self) -> int:
        return sum(t.live for t in self._by_id.values())

    def live(self) -> list[DecoderTransfer]:
        return [t for t in self._by_id.values() if t.live]

    def parts(self, request_id: str) -> list[DecoderTransfer]:
        """The transfers of ``request_id``, by first head."""
        return sorted((t for (rid, _), t in self._by_id.items() if rid == request_id), key=lambda t: t.span)

    async def add(self, t: DecoderTransfer) -> None:
        """Register ``t``; a failed or cancelled transfer it overlaps is replaced (a retry)."""
        same = [o for o in self.parts(t.request_id) if _overlap(o, t)]
        for old in same:
            what = "" if old.heads == t.heads else f" ({old.heads or 'all heads'})"
            if old.live:
                raise RpcError(grpc.StatusCode.ALREADY_EXISTS,
                               f"transfer {t.request_id!r}{what} is already in progress")
            if old.state == S.TRANSFER_STATE_FETCHED:
                raise RpcError(grpc.StatusCode.ALREADY_EXISTS,
                               f"transfer {t.request_id!r}{what} was already delivered")
        if len(self) >= self.max_live:
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{self.max_live} transfers in progress (max_transfers)")
        for old in same:
            del self._by_id[(old.request_id, old.heads)]
        self._by_id[(t.request_id, t.heads)] = t
        async with self._arrived:
            self._arrived.notify_all()

    def get(self, request_id: str, heads: HeadRange | None = None) -> DecoderTransfer:
        """The transfer of ``request_id`` with ``heads``; None names the request's only one."""
        check_request_id(request_id)
        found = self.parts(request_id)
        heads = some_heads(heads)  # all heads, named: as the decoder keys it
        if heads is not None:
            found = [t for t in found if t.heads == heads]
        if not found:
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"no transfer with request id {request_id!r}"
                           + ("" if heads is None else f" and {heads}"))
        if len(found) > 1:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"request {request_id!r} came in {len(found)} head "
                           "ranges: name one (heads)")
        return found[0]

    async def cover(self, request_id: str, want: HeadRange | None,
                    timeout: float) -> list[tuple[DecoderTransfer, slice | None]]:
        """The transfers holding heads ``want`` of ``request_id`` (None: all), each with the slice
        of its own heads that falls in ``want`` (None: all of them), in head order; waiting up to
        ``timeout`` s for them to arrive. A failed or cancelled one is returned only if no retry
        replaces it in time (so a decode engine's FetchKV rides over the encoder's retry)."""
        check_request_id(request_id)
        totals = {t.heads.total for t in self.parts(request_id) if t.heads is not None}
        if want is not None and totals and want.total not in totals:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{want}: the head ranges of request {request_id!r} are of {sorted(totals)[0]} heads")
        async with self._arrived:
            await _wait(self._arrived, lambda: self._covering(request_id, want, usable=True) is not None, timeout)
        found = self._covering(request_id, want, usable=False)
        if found is None:
            what = "" if want is None else f" holding {want}"
            raise RpcError(grpc.StatusCode.NOT_FOUND,
                           f"no transfer with request id {request_id!r}{what} arrived within {timeout:.1f} s")
        return found

    def _covering(self, request_id: str, want: HeadRange | None,
                  usable: bool) -> list[tuple[DecoderTransfer, slice | None]] | None:
        parts = [t for t in self.parts(request_id) if not (usable and t.state in ENDED)]
        whole = [t for t in parts if t.heads is None]
        if whole and (want is None or want.total == whole[0].n_heads):
            t = whole[0]
            part = some_heads(want)
            return [(t, None if part is None else slice(part.start, part.stop))]
        if not parts or whole:
            return None
        total = parts[0].heads.total if parts[0].heads else 0
        a, b = (0, total) if want is None else (want.start, want.stop)
        out, at = [], a
        for t in parts:
            s0, s1 = t.span
            if s1 <= at or s0 >= b:
                continue
            if s0 > at or t.heads is None or t.heads.total != total:
                return None
            hi = min(s1, b)
            out.append((t, None if (at, hi) == (s0, s1) else slice(at - s0, hi - s0)))
            at = hi
        return out if at == b and (want is None or want.total == total) else None

    async def expire(self, now: float | None = None) -> int:
        """End live transfers idle past the lease and drop old tombstones; returns how many."""
        now = time.monotonic() if now is None else now
        n = 0
        for key, t in list(self._by_id.items()):
            rid = key[0]
            if now - t.touched < self.lease_s:
                continue
            if t.live:
                logger.warning("transfer %s expired after %.0f s idle (lease)", rid, now - t.touched,
                               extra={"request_id": rid, "peer": t.peer})
                await t.end(S.TRANSFER_STATE_FAILED,
                            RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "lease expired before FetchKV"))
            elif self._by_id.get(key) is t:  # NOTE: not a retry added while an end above was awaited
                del self._by_id[key]
            n += 1
        return n
