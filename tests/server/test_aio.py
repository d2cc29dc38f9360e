"""server/aio.py's batching: what one coding or decoding pass takes from a chunk queue."""
from __future__ import annotations

import asyncio

import pytest

from speckv.server import aio


@pytest.mark.parametrize("chunk_bytes, want", [
    (3 << 20, 1),  # a 2-layer chunk of 2,048 tokens of the embedded model: one at a time
    (aio.BATCH_BYTES, 1),
    (aio.BATCH_BYTES + 1, 1),  # a chunk larger than the cap still goes, alone
    (1 << 20, 4),
    (196_608, 21),  # 128 tokens: a whole small transfer in one pass
    (1, aio.MAX_BATCH),
    (0, aio.MAX_BATCH),
])
def test_batch_limit_caps_raw_bytes_and_chunks(chunk_bytes, want):
    assert aio.batch_limit(chunk_bytes) == want


def test_drain_batch_takes_what_queued_up_to_the_limit_and_leaves_the_end_marker():
    async def go():
        q: asyncio.Queue = asyncio.Queue()
        for item in (1, 2, 3, None):
            q.put_nowait(item)
        first = await aio.drain_batch(q, 2)
        rest = await aio.drain_batch(q, 2)
        return first, rest, await aio.drain_batch(q, 2), await aio.drain_batch(q, 2)
    assert asyncio.run(go()) == ([1, 2], [3], [], [])
