"""The decoder's Transfer inbox: the sender's requests with this side's per-chunk
PredictorChecks interleaved as they become ready, and waits that a failed decode
task or a transfer ended from outside (CancelTransfer, lease expiry) interrupts.
"""

from __future__ import annotations

import asyncio
from typing import AsyncGenerator, AsyncIterator

import grpc

from speckv.coder import container as ct
from speckv.digests import algorithm_of
from speckv.errors import RpcError
from speckv.v1 import decoder_pb2 as dpb

from .layer_mu import LayerMu
from .transfers import DecoderTransfer


async def await_or_fail(aw, worker: asyncio.Future | None, t: DecoderTransfer):
    """``await aw``, unless ``worker`` fails or ``t`` is ended from outside (CancelTransfer,
    lease expiry) first: then the worker's error or ``t.error`` is raised here, in the
    handler, which reports it to the sender with its status.

    NOTE: the handler is never cancelled from outside: a cancelled grpc.aio handler
    sends no status at all, leaving the sender's call open until its deadline."""
    task = asyncio.ensure_future(aw)
    stop = asyncio.ensure_future(t.stopped.wait())
    guards = {task, stop} | ({worker} if worker is not None else set())
    try:
        done, _ = await asyncio.wait(guards, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the call itself is cancelled: no orphaned read or acquire
        task.cancel()
        raise
    finally:
        stop.cancel()
    if task in done:
        return task.result()
    task.cancel()
    if stop in done:
        raise t.error or RpcError(grpc.StatusCode.CANCELLED, "transfer ended")
    assert worker is not None  # neither the read nor the stop: the worker ended
    worker.result()  # raises the worker's error
    raise RpcError(grpc.StatusCode.INTERNAL, "decode task ended early")


async def mu_checks(h: ct.StreamHeader, mu: LayerMu) -> AsyncIterator[dpb.TransferResponse]:
    """One PredictorCheck per chunk, in order, each as soon as its layers' mu exists (its
    digest the stream version's)."""
    algorithm = algorithm_of(h.version)
    for i in range(h.n_chunks):
        start, count = h.chunk_layers(i)
        yield dpb.TransferResponse(predictor=dpb.PredictorCheck(
            chunk_index=i, mu_digest=await mu.digest_of(start, start + count, algorithm)))


async def events(it: AsyncIterator, checks: AsyncIterator | None, worker: asyncio.Future,
                  t: DecoderTransfer) -> AsyncGenerator:
    """The sender's requests, with this side's PredictorChecks interleaved as they become
    ready; ends with the requests. One read is outstanding at a time (backpressure holds)."""
    next_req: asyncio.Future | None = None
    next_check = None if checks is None else asyncio.ensure_future(anext(checks, None))
    try:
        while True:
            next_req = next_req or asyncio.ensure_future(anext(it, None))
            pending = [f for f in (next_req, next_check) if f is not None]
            await await_or_fail(asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED), worker, t)
            if next_check is not None and next_check.done():
                check, next_check = next_check.result(), None
                if check is not None:
                    assert checks is not None  # next_check came from it
                    next_check = asyncio.ensure_future(anext(checks, None))
                    yield check
                continue
            req, next_req = next_req.result(), None
            if req is None:
                return
            yield req
    finally:
        for f in (next_req, next_check):
            if f is not None and not f.done():
                f.cancel()
            elif f is not None and not f.cancelled():
                f.exception()  # retrieved: whoever ended the stream reports why
