"""asyncio helpers of the sidecars' streaming handlers: batching a queue, draining a
request stream, watching a group of tasks so the most telling error wins."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, TypeVar

import grpc

from speckv.errors import RpcError

MAX_BATCH = 64  # chunks decoded (or coded) in one pass at most
# NOTE: and at most this much raw KV (a chunk at least): the encoder's records go, and the decoder's
# layers reach FetchKV, while the next batch is coded; a whole-KV batch would serialise the two sides
# and hold the whole KV at once (2,048 tokens, mu cached: loopback 58-64 MB/s with whole-queue decode
# batches, 101-105 with these; benchmarks/RESULTS.md, "A serving sidecar's memory")
BATCH_BYTES = 4 << 20

T = TypeVar("T")


async def drain_requests(it: AsyncIterator) -> None:
    async for _ in it:
        pass


def batch_limit(chunk_bytes: int) -> int:
    """Chunks of ``chunk_bytes`` raw KV each that one batch takes (``BATCH_BYTES``, at least one)."""
    return max(1, min(MAX_BATCH, BATCH_BYTES // max(1, chunk_bytes)))


async def drain_batch(queue: asyncio.Queue, limit: int = MAX_BATCH) -> list:
    """The next item and everything queued behind it (up to ``limit``); [] at the end
    marker (None), which stays queued so later calls see it too."""
    items = [await queue.get()]
    while items[-1] is not None and len(items) < limit and not queue.empty():
        items.append(queue.get_nowait())
    if items[-1] is None:
        items.pop()
        queue.put_nowait(None)
    return items


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.7:51234`` -> ``ipv4:10.0.0.7``: a peer's source port changes per connection."""
    return peer.rsplit(":", 1)[0]


async def watched(aw: Awaitable[T], watch: tuple[asyncio.Future[Any], ...]) -> T:
    """Await ``aw`` unless a watched task (acks, sender) fails first; then raise the most
    telling error: the decoder's status from the ack reader rather than a failed write."""
    task = asyncio.ensure_future(aw)
    others = [w for w in watch if w is not task]
    while not task.done():
        if any(_failed(w) for w in others):
            task.cancel()
            await _raise_preferring(watch)
        try:
            await asyncio.wait([task, *[w for w in others if not w.done()]], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: leave no orphaned read, acquire or write behind
            if task not in watch:
                task.cancel()
            raise
    if task.cancelled() or task.exception() is None:
        return task.result()
    if task is watch[1]:
        await _raise_preferring(watch)
    exc = task.exception()
    assert exc is not None  # checked above
    raise exc


def _failed(f: asyncio.Future) -> bool:
    return f.done() and not f.cancelled() and f.exception() is not None


async def _raise_preferring(watch):
    acks = watch[0]
    if not acks.done():
        await asyncio.wait({acks}, timeout=2.0)  # the decoder's status usually follows a failed write
    for w in watch:  # acks first
        if _failed(w):
            raise w.exception()
    raise RpcError(grpc.StatusCode.INTERNAL, "transfer task ended without a result")
