"""The decoder's replies on a Transfer call, as the encoder reads them: its per-chunk
PredictorChecks, its acks and its verdict; and the handshake a speckv stream waits for.

Handshake: a speckv chunk is sent only once the decoder's check of its layers arrived,
so the encoder loses nothing by waiting for the first reply before it starts: either
chunk 0's check (the decoder took the header: same format, pin and model) or the
decoder's refusal. A refusal for a predictor pin the decoder does not hold
(PIN_MISMATCH: a rolling upgrade, two checkpoints live at once) is answered with a
stored stream, which needs no predictor, instead of a failed transfer.
"""

from __future__ import annotations

import asyncio

import grpc

from speckv.errors import RpcError
from speckv.status import error_details, from_in_band
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb

PIN_MISMATCH = "PIN_MISMATCH"  # the decoder's ErrorInfo reason for a header under another predictor pin


class Checks:
    """The decoder's PredictorCheck digests, by chunk index, as they arrive."""

    def __init__(self, n_chunks: int) -> None:
        self.n_chunks = n_chunks
        self._by_chunk: dict[int, asyncio.Future[bytes]] = {}

    def get(self, i: int) -> "asyncio.Future[bytes]":
        if i not in self._by_chunk:
            self._by_chunk[i] = asyncio.get_running_loop().create_future()
        return self._by_chunk[i]

    def put(self, check: dpb.PredictorCheck) -> None:
        i = check.chunk_index
        if i >= self.n_chunks or self.get(i).done():
            raise RpcError(grpc.StatusCode.INTERNAL, f"decoder sent a PredictorCheck for chunk {i} of "
                           f"{self.n_chunks} twice or out of range")
        self.get(i).set_result(bytes(check.mu_digest))


async def read_result(call, checks: Checks) -> dpb.TransferResult:
    """Drain the decoder's messages: its per-chunk PredictorChecks (into ``checks``), acks,
    and its TransferResult (or its gRPC error)."""
    result = None
    async for resp in call:
        kind = resp.WhichOneof("kind")
        if kind == "predictor":
            checks.put(resp.predictor)
        elif kind == "result":
            result = resp.result
            if result.status.code != pb.STATUS_CODE_OK:  # the decoder's verdict, in-band
                raise from_in_band(result.status)
    if result is None:
        raise RpcError(grpc.StatusCode.INTERNAL, "decoder ended the transfer without a result")
    return result


async def first_reply(checks: Checks, acks: "asyncio.Future[dpb.TransferResult]") -> BaseException | None:
    """Wait for the decoder's first reply to a speckv header: None once chunk 0's check
    arrived (the header was taken), else the error the call ended with."""
    first = checks.get(0)
    await asyncio.wait({first, acks}, return_when=asyncio.FIRST_COMPLETED)
    if first.done():
        return None
    return acks.exception() or RpcError(grpc.StatusCode.INTERNAL, "decoder ended the transfer before any check")


def is_pin_mismatch(err: BaseException) -> bool:
    """The decoder refused the header for its predictor pin (in-band verdict or call status)."""
    if isinstance(err, RpcError):
        return err.reason == PIN_MISMATCH
    return isinstance(err, grpc.RpcError) and error_details(err)[0] == PIN_MISMATCH
