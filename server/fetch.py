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
from speckv.digests import ALGORITHMS, BLAKE2B_128, KVDigest
from speckv.errors import RpcError
from speckv.status import abort, to_status
from speckv.v1 import decoder_pb2 as dpb
from speckv.wire import kv_shape, layer_frames

from . import tracing
from .auth import authorize
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

    def _gauges(self) -> None:  # pragma: no cover -- DecoderService's
        raise NotImplementedError

    async def FetchKV(self, request: dpb.FetchKVRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator["dpb.FetchKVResponse | bytes"]:
        logs.bind(request_id=request.request_id or None, peer=context.peer() or "?")
        await authorize(context, "FetchKV", self.allow)
        wait = request.wait_timeout_ms / 1000 if request.wait_timeout_ms else self.config.fetch_wait_s
        t0 = time.perf_counter()
        t = None
        span = tracing.start("speckv.decoder.FetchKV", context, request_id=request.request_id)
        try:
            algorithm = request.digest or BLAKE2B_128  # NOTE: unset: a client before FetchKVRequest.digest
            if algorithm not in ALGORITHMS:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown digest algorithm {request.digest}")
            t = await self.table.wait_for(request.request_id, wait)
            if request.model_id and request.model_id != t.model_id:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"transfer {request.request_id!r} holds KV of model {t.model_id!r}, not of "
                               f"{request.model_id!r}", reason=MODEL_MISMATCH)
            if t.fetching or t.state == S.TRANSFER_STATE_FETCHED:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"transfer {request.request_id!r} is already being fetched or was fetched",
                               reason="ALREADY_FETCHED")
            t.fetching = True
            if request.verified_only:
                if t.n_layers * t.layer_bytes > self.budget.limit:
                    raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"verified_only needs the whole KV ({t.n_layers * t.layer_bytes} bytes) "
                                   f"in memory; the in-flight cap is {self.budget.limit}")
                await t.wait_final(max(wait, self.config.lease_s))
            # NOTE: the client verifies another algorithm than the stream's: that one, over the
            # very layers handed out (each verified, and verified whole before FetchKVDone)
            handed = None if algorithm == t.digest.algorithm else KVDigest(algorithm)
            async for frame in self._layers(t, wait, t0, handed):
                yield frame
            digest = await t.wait_final(max(wait, self.config.lease_s))
            yield dpb.FetchKVResponse(done=dpb.FetchKVDone(raw_digest=digest if handed is None else handed.digest(),
                                                           raw_bytes=t.digest.raw_bytes), digest=algorithm)
            await t.end(S.TRANSFER_STATE_FETCHED)
            t.holding.close()
            tracing.end(span, raw_bytes=t.digest.raw_bytes, layers=t.n_layers)
        except BaseException as e:  # noqa: BLE001
            code, msg = to_status(e)
            logger.warning("fetch %s failed: %s %s", request.request_id, code.name, msg, extra={"code": code.name})
            tracing.end(span, code, msg)
            if t is not None and t.fetching and code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                # layers already handed out are gone. NOTE: recorded as an RpcError, never as this
                # call's CancelledError: a live Transfer handler raises t.error when woken, and a
                # CancelledError there passes for its own call's end (no status: the sender hangs)
                await t.end(S.TRANSFER_STATE_CANCELLED,
                            RpcError(grpc.StatusCode.CANCELLED, f"the FetchKV taking its layers ended: {msg}"))
            if isinstance(e, asyncio.CancelledError):
                raise
            await abort(context, e)
        finally:
            self._gauges()  # a fetched or cancelled transfer is no longer in flight

    async def _layers(self, t: DecoderTransfer, wait: float, t0: float,
                      handed: KVDigest | None) -> AsyncIterator[bytes]:
        """Each layer as pre-serialised FetchKVResponses (``speckv.frames``), in order."""
        algorithm = t.digest.algorithm if handed is None else handed.algorithm
        tail = dpb.FetchKVResponse(digest=algorithm)  # NOTE: FetchKVResponse.layer is field 1, digest 3
        hdr_shape, dtype = None, None
        for layer in range(t.n_layers):
            arr, scales = await t.take(layer, max(wait, self.config.lease_s))
            if layer == 0:
                self.metrics.seconds("first_layer", time.perf_counter() - t0)
                dtype = 1 if arr.dtype == np.uint16 else 2
                hdr_shape = kv_shape((t.n_layers,) + arr.shape[:2] + arr.shape[2:])
            assert dtype is not None  # set at layer 0
            if handed is not None:
                handed.update_layer(arr, scales)
            for p in layer_frames(layer, arr, dtype, hdr_shape, self.config.message_bytes, scales):
                yield frames.join(frames.submessage(1, p, tail))
            t.holding.release(arr.nbytes)

