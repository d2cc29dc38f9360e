"""The decoder's replies on a Transfer call, as the encoder reads them: its per-chunk
PredictorChecks, its acks and its verdict; and the handshake a speckv stream waits for.

Handshake: a speckv chunk is sent only once the decoder's check of its layers arrived,
so the encoder loses nothing by waiting for the first reply before it starts: either
chunk 0's check (the decoder took the header: same format, pin and model) or the
decoder's refusal. A rolling upgrade leaves the two sides on different releases for a
while, and neither refusal it causes fails the transfer: a stream format version the
decoder does not read (UNSUPPORTED_VERSION) is answered with the same stream one
version older, a predictor pin the decoder does not hold (PIN_MISMATCH) or a model it
does not serve (MODEL_MISMATCH) with a stored stream, which needs no predictor (a decoder
takes stored streams of any model; the decode engine's FetchKV names the model it runs).
"""

from __future__ import annotations

import asyncio
import time

import grpc

from speckv.errors import RpcError
from speckv.status import error_details, from_in_band
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb

PIN_MISMATCH = "PIN_MISMATCH"  # the decoder's ErrorInfo reason for a header under another predictor pin
MODEL_MISMATCH = "MODEL_MISMATCH"  # ... for a speckv header of a model it does not serve
STORED_ON = {PIN_MISMATCH: "pin_mismatch", MODEL_MISMATCH: "model_mismatch"}  # refusal -> fallback reason
UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"  # ... for a stream format version it does not read
# NOTE: decoders before UNSUPPORTED_VERSION refused a newer version as a malformed stream, saying so
LEGACY_VERSION_REFUSAL = ("MALFORMED_STREAM", "unsupported format version")
OLDEST_WRITTEN = 3  # the oldest version the encoder writes again (version 2 has no stored chunks)


class Checks:
    """The decoder's PredictorCheck digests, by chunk index, as they arrive."""

    def __init__(self, n_chunks: int) -> None:
        self.n_chunks = n_chunks
        self._by_chunk: dict[int, asyncio.Future[bytes]] = {}
        self.arrived: dict[int, float] = {}  # chunk -> perf_counter of its check's arrival

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
        self.arrived[i] = time.perf_counter()


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


def _reason(err: BaseException) -> tuple[str, str]:
    """(ErrorInfo reason, message) of a refusal: an in-band verdict or a call's status."""
    if isinstance(err, RpcError):
        return err.reason, str(err)
    if isinstance(err, grpc.RpcError):
        details = getattr(err, "details", None)
        return error_details(err)[0], str(details() if callable(details) else err)
    return "", str(err)


def stored_fallback(err: BaseException) -> str | None:
    """The fallback reason when the decoder refused the header for a predictor pin or a model
    it does not have (a stored stream then goes through), else None."""
    return STORED_ON.get(_reason(err)[0])


def older_version(err: BaseException, version: int) -> int | None:
    """The version to write the stream in again after the decoder refused ``version`` as
    one it does not read (None: not that refusal, or no older version to write)."""
    reason, message = _reason(err)
    refused = reason == UNSUPPORTED_VERSION or (reason == LEGACY_VERSION_REFUSAL[0]
                                                 and LEGACY_VERSION_REFUSAL[1] in message)
    return version - 1 if refused and version > OLDEST_WRITTEN else None
