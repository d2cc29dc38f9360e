"""FetchKV, the decode engine's side of the decoder sidecar: a transfer's layers as
they are verified, each handed out once (its bytes back to the budget), then
FetchKVDone with the whole-transfer digest in the algorithm the client verifies.

A mixin of ``DecoderService`` (decoder.py): it uses the service's table, config,
metrics, budget, allow list and gauges.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator

import grpc
import numpy as np

from speckv import frames, logs
from speckv import handoff as proto
from speckv.digests import ALGORITHMS, BLAKE2B_128, KVDigest
from speckv.errors import RpcError
from speckv.status import abort, in_band, to_status
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.wire import heads_of, kv_shape, layer_frames

from . import tracing
from .auth import authorize
from .mailbox import LocalKV, Mailboxes
from .replies import MODEL_MISMATCH
from .transfers import DecoderTransfer, S

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # pragma: no cover
    from .budget import ByteBudget
    from .config import ServerConfig
    from .metrics import Metrics
    from .transfers import TransferTable


class FetchService:
    """DecoderService.FetchKV (see the module docstring)."""

    table: "TransferTable"
    config: "ServerConfig"
    metrics: "Metrics"
    budget: "ByteBudget"
    allow: dict[str, frozenset[str]]
    mailboxes: "Mailboxes | None"

    def _gauges(self) -> None:  # pragma: no cover -- DecoderService's
        raise NotImplementedError

    async def FetchKV(self, request: dpb.FetchKVRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator["dpb.FetchKVResponse | bytes"]:
        logs.bind(request_id=request.request_id or None, peer=context.peer() or "?")
        await authorize(context, "FetchKV", self.allow)
        wait = request.wait_timeout_ms / 1000 if request.wait_timeout_ms else self.config.fetch_wait_s
        t0 = time.perf_counter()
        pieces: list[Piece] = []
        local: _LocalOut | None = None
        span = tracing.start("speckv.decoder.FetchKV", context, request_id=request.request_id)
        try:
            local = _LocalOut(self.mailboxes, request.local_mailbox) if request.local_mailbox else None
            algorithm = request.digest or BLAKE2B_128  # NOTE: unset: a client before FetchKVRequest.digest
            if algorithm not in ALGORITHMS:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown digest algorithm {request.digest}")
            want = heads_of(request.heads)
            found = await self.table.cover(request.request_id, want, wait)
            self._check_pieces(request, found)
            toks = _tokens(request, found[0][0].tokens)
            self._check_memory(request, found)
            if local is not None:  # NOTE: before the claim: a memfd that cannot be made leaves the transfer fetchable
                local.create(one_layer_bytes(found, toks) * found[0][0].n_layers)
            pieces = _claim(found)
            if request.verified_only:
                for t, _ in pieces:
                    await t.wait_final(max(wait, self.config.lease_s))
            # NOTE: the client verifies another algorithm than the stream's, or gets other heads than
            # one transfer's: that algorithm over the very layers handed out (each verified, and
            # every transfer verified whole before FetchKVDone)
            one = pieces[0][0]
            whole = len(pieces) == 1 and pieces[0][1] is None and toks is None
            handed = None if whole and algorithm == one.digest.algorithm else KVDigest(algorithm)
            async for frame in self._layers(pieces, wait, t0, handed, toks, local):
                yield frame
            for t, _ in pieces:
                digest = await t.wait_final(max(wait, self.config.lease_s))
            if local is not None:
                local.seal()  # NOTE: before FetchKVDone: the client verifies bytes no one can change
                self.metrics.local(local.size)
            raw = one.digest.raw_bytes if handed is None else handed.raw_bytes
            yield dpb.FetchKVResponse(done=dpb.FetchKVDone(raw_digest=digest if handed is None else handed.digest(),
                                                           raw_bytes=raw), digest=algorithm)
            for t, part in pieces:
                t.fetched += t.n_heads if part is None else part.stop - part.start
                if t.fetched == t.n_heads:
                    await t.end(S.TRANSFER_STATE_FETCHED)
                    t.holding.close()
            tracing.end(span, raw_bytes=raw, layers=one.n_layers)
        except BaseException as e:  # noqa: BLE001
            code, msg = to_status(e)
            logger.warning("fetch %s failed: %s %s", request.request_id, code.name, msg, extra={"code": code.name})
            tracing.end(span, code, msg)
            # layers already handed out are gone, and the heads this call claimed are never handed
            # out again: every transfer it claimed ends (a failed one already has), its memory freed.
            # NOTE: recorded as an RpcError, never as this call's CancelledError: a live Transfer handler
            # raises t.error when woken, and a CancelledError there passes for its own call's end
            # (no status: the sender hangs)
            cancelled = code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
            for t, _ in pieces:
                await t.end(S.TRANSFER_STATE_CANCELLED if cancelled else S.TRANSFER_STATE_FAILED,
                            RpcError(grpc.StatusCode.CANCELLED if cancelled else code,
                                     f"the FetchKV taking its layers ended: {msg}"))
            if isinstance(e, asyncio.CancelledError):
                raise
            await abort(context, e)
        finally:
            if local is not None:
                local.close()
            self._gauges()  # a fetched or cancelled transfer is no longer in flight

    def _check_pieces(self, request: dpb.FetchKVRequest, found: list[Piece]) -> None:
        """The model the engine names, and transfers of ranges that can go together."""
        rid = request.request_id
        for t, _ in found:
            if request.model_id and request.model_id != t.model_id:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"transfer {rid!r} holds KV of model {t.model_id!r}, not of "
                               f"{request.model_id!r}", reason=MODEL_MISMATCH)
        for t, _ in found:
            if t.state in (S.TRANSFER_STATE_FAILED, S.TRANSFER_STATE_CANCELLED):
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"transfer {rid!r} {S.Name(t.state)}: {in_band(t.error).message}",
                               reason="TRANSFER_FAILED")
        first = found[0][0]
        for t, _ in found[1:]:
            if (t.model_id, t.prompt, t.n_layers, t.layer_bytes // t.n_heads) != (
                    first.model_id, first.prompt, first.n_layers, first.layer_bytes // first.n_heads):
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the head ranges of request {rid!r} hold different KV (model, prompt, "
                               "layers, tokens or dtype)", reason="RANGES_DIFFER")

    def _check_memory(self, request: dpb.FetchKVRequest, found: list[Piece]) -> None:
        """RESOURCE_EXHAUSTED where the fetch may need more than the in-flight cap at once:
        ``verified_only`` holds the whole KV, and heads assembled from several transfers may
        hold all of one while another lags (its layers wait for memory only this fetch frees)."""
        need = sum(_bytes_of(t, part) for t, part in found)
        if (request.verified_only or len(found) > 1) and need > self.budget.limit:
            what = "verified_only" if request.verified_only else f"heads assembled from {len(found)} transfers"
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{what} needs up to the whole KV ({need} bytes) in memory; the in-flight cap is "
                           f"{self.budget.limit}" + ("" if request.verified_only else ": fetch each range alone"))

    async def _layers(self, pieces: list[Piece], wait: float, t0: float, handed: KVDigest | None,
                      toks: slice | None, local: "_LocalOut | None") -> AsyncIterator["bytes | dpb.FetchKVResponse"]:
        """Each layer as pre-serialised FetchKVResponses (``speckv.frames``), in order: the
        pieces' heads side by side, tokens ``toks`` (None: all); ``local``: written into its
        memfd instead, one LocalFetchLayer each."""
        one = pieces[0][0]
        algorithm = one.digest.algorithm if handed is None else handed.algorithm
        tail = dpb.FetchKVResponse(digest=algorithm)  # NOTE: FetchKVResponse.layer is field 1, digest 3
        hdr_shape, dtype = None, None
        for layer in range(one.n_layers):
            got = [await t.take(layer, max(wait, self.config.lease_s), part) for t, part in pieces]
            arr = got[0][0] if len(got) == 1 else np.concatenate([g[0] for g in got], axis=1)
            arr = arr if toks is None else arr[:, :, toks]
            scales = got[0][1]
            if any(not _same_scales(g[1], scales) for g in got[1:]):
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"layer {layer}: the head ranges carry different FP8 scales; they cannot "
                               "be handed out as one layer", reason="RANGES_DIFFER")
            if layer == 0:
                self.metrics.seconds("first_layer", time.perf_counter() - t0)
                dtype = 1 if arr.dtype == np.uint16 else 2
                hdr_shape = kv_shape((one.n_layers,) + arr.shape)
            assert dtype is not None  # set at layer 0
            if handed is not None:
                handed.update_layer(arr, scales)
            if local is not None:
                yield local.layer(layer, arr, dtype, hdr_shape, scales, algorithm)
            else:
                for p in layer_frames(layer, arr, dtype, hdr_shape, self.config.message_bytes, scales):
                    yield frames.join(frames.submessage(1, p, tail))
            for (t, _), (_, _, freed) in zip(pieces, got, strict=True):
                t.holding.release(freed)


Piece = tuple[DecoderTransfer, "slice | None"]


def _claim(found: list[Piece]) -> list[Piece]:
    """Claim each piece's heads for this fetch (FAILED_PRECONDITION when a fetch has any)."""
    heads = [set(range(t.n_heads)) if part is None else set(range(part.start, part.stop)) for t, part in found]
    for (t, part), hs in zip(found, heads, strict=True):
        if t.state == S.TRANSFER_STATE_FETCHED or hs & t.claimed:
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"transfer {t.request_id!r} is already being fetched or was fetched"
                           + ("" if part is None else " (these heads)"), reason="ALREADY_FETCHED")
    for (t, _), hs in zip(found, heads, strict=True):
        t.claimed |= hs
    return found


def _tokens(request: dpb.FetchKVRequest, tokens: int) -> slice | None:
    """The tokens a fetch asks for (None: all of them); INVALID_ARGUMENT past the prompt's end."""
    a = request.token_start
    b = tokens if request.token_count == 0 else a + request.token_count
    if not (a < b <= tokens or a == b == tokens == 0):
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"tokens [{a}, {b}) are not within the "
                       f"transfer's {tokens}")
    return None if (a, b) == (0, tokens) else slice(a, b)


def _bytes_of(t: DecoderTransfer, part: slice | None) -> int:
    return t.n_layers * t.layer_bytes * (1 if part is None else part.stop - part.start) // t.n_heads


def _same_scales(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None) == (b is None) and (a is None or bytes(np.asarray(a, np.float32)) == bytes(
        np.asarray(b, np.float32)))


def one_layer_bytes(found: list[Piece], toks: slice | None) -> int:
    """Bytes of one layer as a fetch of ``found`` hands it out (its heads side by side, tokens ``toks``)."""
    total = 0
    for t, part in found:
        per_token = t.layer_bytes // t.n_heads // t.tokens if t.tokens else 0  # (2, 1, 1, head_dim) of one head
        heads = t.n_heads if part is None else part.stop - part.start
        total += heads * per_token * (t.tokens if toks is None else toks.stop - toks.start)
    return total


class _LocalOut:
    """A local fetch's memfd (``mailbox.LocalKV``): made before the fetch claims its transfers,
    sent to the mailbox with the first layer, every layer of the same shape after it."""

    def __init__(self, mailboxes: "Mailboxes | None", token: str) -> None:
        if mailboxes is None:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "FetchKVRequest.local_mailbox needs a decoder with a "
                           "local socket (local_socket)", reason=proto.SOCKET_OFF)
        mailboxes.check(token)
        self.mailboxes, self.token = mailboxes, token
        self.kv: LocalKV | None = None
        self.sent = False

    def create(self, size: int) -> None:
        try:
            self.kv = LocalKV(size)
        except OSError as e:  # e.g. ENOMEM (no memory for the pages), EMFILE
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a local fetch's memfd of {size} bytes: {e}",
                           reason=proto.OVER_LIMIT) from None

    def layer(self, index: int, arr: np.ndarray, dtype: int, shape: pb.KVShape, scales: np.ndarray | None,
              algorithm: int) -> dpb.FetchKVResponse:
        assert self.kv is not None and self.kv.size == shape.layers * arr.nbytes, "create() sized it"
        if not self.sent:  # NOTE: layer 0 comes first
            self.mailboxes.send(self.token, self.kv.fd, self.kv.id, self.kv.size)
            self.sent = True
        self.kv.write(index * arr.nbytes, arr)
        sp = [] if scales is None else [float(v) for v in np.asarray(scales, np.float32).ravel()]
        return dpb.FetchKVResponse(local_layer=dpb.LocalFetchLayer(
            memfd_id=self.kv.id, memfd_bytes=self.kv.size, layer=index, dtype=dtype, shape=shape,
            byte_offset=index * arr.nbytes, layer_bytes=arr.nbytes, fp8_scales=sp), digest=algorithm)

    @property
    def size(self) -> int:
        return 0 if self.kv is None else self.kv.size

    def seal(self) -> None:
        if self.kv is not None:
            try:
                self.kv.seal()
            except OSError as e:  # EBUSY: someone mapped it shared and writable (a reopened fd)
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"local memfd {self.kv.id} could not be "
                               f"sealed: {e}", reason=proto.UNSEALED) from None

    def close(self) -> None:
        if self.kv is not None:
            self.kv.close()
