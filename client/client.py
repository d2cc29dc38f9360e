"""Python clients of the sidecars, sync and asyncio, with deadlines and typed errors.

Prefill side::

    enc = EncoderClient("127.0.0.1:50051")
    res = enc.submit("req-1", kv, prompt_ids, decoder_address="10.0.0.7:50052", model_id=...)

Decode side::

    dec = DecoderClient("127.0.0.1:50052")
    kv = dec.fetch("req-1")                  # waits for a transfer still in flight
    for layer, arr, scales in dec.fetch_layers("req-1"): ...   # start before the last layer

``kv`` is the canonical ``(layers, 2, kv_heads, tokens, head_dim)`` cache: a
torch.bfloat16 tensor or uint16 numpy bit patterns (BF16), or an
:class:`~speckv.kv.Fp8KV` (e4m3 codes + per-(layer, kv) scales).
``fetch`` returns uint16 numpy (``as_torch=True``: torch.bfloat16) or Fp8KV.
Every failure raises :class:`RpcFailed` (a SpeckvError) carrying the gRPC code.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

import grpc
import numpy as np

from speckv.errors import RpcFailed
from speckv.handoff import MAILBOX_UNKNOWN
from speckv.kv import Fp8Attention, Fp8KV, HeadRange
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import decoder_pb2_grpc as dgrpc
from speckv.v1 import encoder_pb2_grpc as egrpc
from speckv.wire import heads_msg

from .core import (
    ChunkTiming,
    SubmitResult,
    _channel,
    _Collector,
    _failed,
    _result,
    _retry_delay,
    fetch_request,
    fetch_stub,
    submit_requests,
    submit_stub,
    tls_credentials,
)
from .local import LocalHandoff, LocalMailbox
from .stream import SubmitStream

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["EncoderClient", "DecoderClient", "AsyncEncoderClient", "AsyncDecoderClient", "RpcFailed",
           "ChunkTiming", "SubmitResult", "SubmitStream", "submit_requests", "tls_credentials", "Fp8KV"]


# -- sync ------------------------------------------------------------------------

class EncoderClient:
    """Blocking client of an encoder sidecar. ``local_socket``: the encoder's local
    hand-off socket (same host): the KV goes as sealed memfds, not as bytes on the
    gRPC stream (``client/local.py``); without it, the bytes path."""

    def __init__(self, address: str, timeout: float = 600.0, channel: grpc.Channel | None = None,
                 credentials: grpc.ChannelCredentials | None = None, local_socket: str | None = None) -> None:
        self.channel = channel or _channel(address, credentials)
        self.stub = egrpc.EncoderServiceStub(self.channel)
        self._submit = submit_stub(self.channel)  # takes the pre-serialised layer parts
        self.timeout = timeout
        self.handoff = None if local_socket is None else LocalHandoff(local_socket)

    def submit(self, request_id: str, kv: Any, prompt_token_ids: Any, decoder_address: str, model_id: str,
               *, encoding: str = "speckv", expected_pin: str | None = None,
               timeout: float | None = None, retries: int = 0, backoff_s: float = 0.5,
               fp8_attention: Fp8Attention | None = None, heads: HeadRange | None = None) -> SubmitResult:
        """Submit one request's KV; with ``retries``, an UNAVAILABLE failure (the encoder
        or the decoder unreachable, a connection reset, a restart) is retried under the
        same request id after ``backoff_s`` (doubling): the decoder keeps no state of a
        transfer whose call ended, so a retry starts afresh. ``fp8_attention`` (FP8 KV): how
        the engine's attention read its FP8 cache; both predictors then follow it. ``heads``:
        ``kv`` holds only these heads (one tensor-parallel rank's); each rank submits its own
        under the same request id, and the decoder serves any range of them (``fetch``)."""
        for attempt in range(retries + 1):
            reqs = submit_requests(request_id, kv, prompt_token_ids, decoder_address, model_id, encoding,
                                   expected_pin, framed=True, handoff=self.handoff, fp8_attention=fp8_attention,
                                   heads=heads)
            try:
                return _result(self._submit(reqs, timeout=timeout or self.timeout))
            except grpc.RpcError as e:
                time.sleep(_retry_delay(e, request_id, attempt, retries, backoff_s))
        raise AssertionError("unreachable")

    def open_submit(self, request_id: str, shape: tuple[int, int, int, int, int], prompt_token_ids: Any,
                    decoder_address: str, model_id: str, *, dtype: str = "bf16", encoding: str = "speckv",
                    expected_pin: str | None = None, timeout: float | None = None,
                    fp8_attention: Fp8Attention | None = None, heads: HeadRange | None = None) -> SubmitStream:
        """Open a Submit whose layers follow one at a time (``SubmitStream.send_layer``), for an
        engine that produces the KV layer by layer: the header goes now, so both sidecars start
        their predictors while the engine still prefills. No retries: a failed stream raises."""
        return SubmitStream(self._submit, request_id, shape, prompt_token_ids, decoder_address, model_id,
                            dtype=dtype, encoding=encoding, expected_pin=expected_pin,
                            timeout=timeout or self.timeout, handoff=self.handoff, fp8_attention=fp8_attention,
                            heads=heads)

    def close(self) -> None:
        self.channel.close()
        if self.handoff is not None:
            self.handoff.close()

    def __enter__(self) -> "EncoderClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DecoderClient:
    """Blocking client of a decoder sidecar (the decode engine's side)."""

    def __init__(self, address: str, timeout: float = 600.0, channel: grpc.Channel | None = None,
                 credentials: grpc.ChannelCredentials | None = None, local_socket: str | None = None) -> None:
        self.channel = channel or _channel(address, credentials)
        self.stub = dgrpc.DecoderServiceStub(self.channel)
        self._fetch = fetch_stub(self.channel)  # its layer parts' data: views of the bytes received
        self.timeout = timeout
        # the decoder's local socket on this host: layers come as one sealed memfd, not bytes
        self.mailbox = None if local_socket is None else LocalMailbox(local_socket)

    def fetch_layers(self, request_id: str, wait: float | None = None, timeout: float | None = None,
                     verified_only: bool = False, model_id: str = "", heads: HeadRange | None = None,
                     tokens: tuple[int, int] | None = None) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
        """Yields ``(layer, (2, heads, tokens, dim) array, scales | None)`` as layers arrive.
        NOTE: each layer passed its chunk's checksum; the whole transfer is verified only
        when the iterator ends without raising (``verified_only``: nothing arrives before).
        ``model_id``: the model this engine runs; a transfer of another model is refused
        (MODEL_MISMATCH) before any layer arrives. ``heads``: only these heads (this rank's), from
        the transfers of ``request_id`` that hold them (one, several side by side, or a slice).
        ``tokens``: only tokens ``[start, stop)`` of each layer (a local prefix-cache hit holds the rest)."""
        col = _Collector(verified_only, model_id=model_id, heads=heads, tokens=tokens, mailbox=self.mailbox)
        yield from self._stream(request_id, wait, timeout, col)

    def _stream(self, request_id: str, wait: float | None, timeout: float | None,
                col: _Collector) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
        token = "" if self.mailbox is None else self.mailbox.token()
        req = fetch_request(request_id, wait, col.verified_only, col.model_id, col.heads, col.tokens, token)
        try:
            for msg in self._fetch(req, timeout=timeout or self.timeout):
                done = col.add(msg)
                if done is not None:
                    yield done
        except grpc.RpcError as e:
            raise _mailbox_failed(self.mailbox, _failed(e)) from None
        finally:
            col.close()
        col.check_done()

    def fetch(self, request_id: str, wait: float | None = None, timeout: float | None = None,
              as_torch: bool = False, verified_only: bool = False,
              model_id: str = "", heads: HeadRange | None = None,
              tokens: tuple[int, int] | None = None) -> "np.ndarray | Fp8KV | torch.Tensor":
        """The whole reconstructed KV (see the module docstring for its type), returned only
        after its whole-transfer digest matched, on the server and again here (``model_id``:
        ``heads`` and ``tokens``: as ``fetch_layers``)."""
        col = _Collector(verified_only, whole=True, model_id=model_id, heads=heads, tokens=tokens,
                         mailbox=self.mailbox)
        for layer, arr, scales in self._stream(request_id, wait, timeout, col):
            col.keep(layer, arr, scales)
        return col.result(as_torch)

    def status(self, request_id: str, timeout: float | None = None,
                 heads: HeadRange | None = None) -> dpb.TransferStatus:
        try:
            req = dpb.GetTransferStatusRequest(request_id=request_id, heads=heads_msg(heads))
            return self.stub.GetTransferStatus(req, timeout=timeout or self.timeout).status
        except grpc.RpcError as e:
            raise _failed(e) from None

    def cancel(self, request_id: str, timeout: float | None = None,
                 heads: HeadRange | None = None) -> dpb.TransferStatus:
        try:
            return self.stub.CancelTransfer(dpb.CancelTransferRequest(request_id=request_id, heads=heads_msg(heads)),
                                            timeout=timeout or self.timeout).status
        except grpc.RpcError as e:
            raise _failed(e) from None

    def close(self) -> None:
        self.channel.close()
        if self.mailbox is not None:
            self.mailbox.close()

    def __enter__(self) -> "DecoderClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _mailbox_failed(mailbox: LocalMailbox | None, e: RpcFailed) -> RpcFailed:
    """``e``; a decoder that knows no such mailbox (it restarted) makes the next fetch ask anew."""
    if mailbox is not None and e.reason == MAILBOX_UNKNOWN:
        mailbox.reset()
    return e


# -- asyncio -----------------------------------------------------------------------

class AsyncEncoderClient:
    """asyncio client of an encoder sidecar."""

    def __init__(self, address: str, timeout: float = 600.0,
                 credentials: grpc.ChannelCredentials | None = None, local_socket: str | None = None) -> None:
        self.channel = _channel(address, credentials, aio=True)
        self.stub = egrpc.EncoderServiceStub(self.channel)
        self._submit = submit_stub(self.channel)  # takes the pre-serialised layer parts
        self.timeout = timeout
        self.handoff = None if local_socket is None else LocalHandoff(local_socket)

    async def submit(self, request_id: str, kv: Any, prompt_token_ids: Any, decoder_address: str,
                     model_id: str, *, encoding: str = "speckv", expected_pin: str | None = None,
                     timeout: float | None = None, retries: int = 0, backoff_s: float = 0.5,
                     fp8_attention: Fp8Attention | None = None, heads: HeadRange | None = None) -> SubmitResult:
        """As the blocking client's ``submit`` (the same retries)."""
        for attempt in range(retries + 1):
            # NOTE: the memfd is written off the loop (a copy of the whole KV)
            reqs = await asyncio.to_thread(functools.partial(
                submit_requests, request_id, kv, prompt_token_ids, decoder_address, model_id, encoding,
                expected_pin, framed=True, handoff=self.handoff, fp8_attention=fp8_attention, heads=heads))
            try:
                # NOTE: grpc.aio takes a plain iterator for a request stream
                return _result(await self._submit(reqs, timeout=timeout or self.timeout))
            except grpc.RpcError as e:
                await asyncio.sleep(_retry_delay(e, request_id, attempt, retries, backoff_s))
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.channel.close()
        if self.handoff is not None:
            self.handoff.close()


class AsyncDecoderClient:
    """asyncio client of a decoder sidecar."""

    def __init__(self, address: str, timeout: float = 600.0,
                 credentials: grpc.ChannelCredentials | None = None, local_socket: str | None = None) -> None:
        self.channel = _channel(address, credentials, aio=True)
        self.stub = dgrpc.DecoderServiceStub(self.channel)
        self._fetch = fetch_stub(self.channel)  # its layer parts' data: views of the bytes received
        self.timeout = timeout
        # NOTE: the mailbox's socket calls block, briefly: a memfd's datagram is sent before its first layer
        self.mailbox = None if local_socket is None else LocalMailbox(local_socket)

    async def fetch_layers(self, request_id: str, wait: float | None = None, timeout: float | None = None,
                           verified_only: bool = False, model_id: str = "", heads: HeadRange | None = None,
                           tokens: tuple[int, int] | None = None,
                           ) -> AsyncIterator[tuple[int, np.ndarray, np.ndarray | None]]:
        """As the blocking client's ``fetch_layers``."""
        col = _Collector(verified_only, model_id=model_id, heads=heads, tokens=tokens, mailbox=self.mailbox)
        async for done in self._stream(request_id, wait, timeout, col):
            yield done

    async def _stream(self, request_id: str, wait: float | None, timeout: float | None,
                      col: _Collector) -> AsyncIterator[tuple[int, np.ndarray, np.ndarray | None]]:
        token = "" if self.mailbox is None else await asyncio.to_thread(self.mailbox.token)
        req = fetch_request(request_id, wait, col.verified_only, col.model_id, col.heads, col.tokens, token)
        try:
            async for msg in self._fetch(req, timeout=timeout or self.timeout):
                # NOTE: a local fetch maps, hashes and waits on its mailbox: off the loop
                done = col.add(msg) if self.mailbox is None else await asyncio.to_thread(col.add, msg)
                if done is not None:
                    yield done
        except grpc.RpcError as e:
            raise _mailbox_failed(self.mailbox, _failed(e)) from None
        finally:
            col.close()
        col.check_done()

    async def fetch(self, request_id: str, wait: float | None = None, timeout: float | None = None,
                    as_torch: bool = False, verified_only: bool = False,
                    model_id: str = "", heads: HeadRange | None = None,
                    tokens: tuple[int, int] | None = None) -> "np.ndarray | Fp8KV | torch.Tensor":
        """As the blocking client's ``fetch``."""
        col = _Collector(verified_only, whole=True, model_id=model_id, heads=heads, tokens=tokens,
                         mailbox=self.mailbox)
        async for layer, arr, scales in self._stream(request_id, wait, timeout, col):
            col.keep(layer, arr, scales)
        return col.result(as_torch)

    async def status(self, request_id: str, timeout: float | None = None,
                       heads: HeadRange | None = None) -> dpb.TransferStatus:
        try:
            req = dpb.GetTransferStatusRequest(request_id=request_id, heads=heads_msg(heads))
            r = await self.stub.GetTransferStatus(req, timeout=timeout or self.timeout)
            return r.status
        except grpc.RpcError as e:
            raise _failed(e) from None

    async def cancel(self, request_id: str, timeout: float | None = None,
                       heads: HeadRange | None = None) -> dpb.TransferStatus:
        try:
            r = await self.stub.CancelTransfer(dpb.CancelTransferRequest(request_id=request_id, heads=heads_msg(heads)),
                                               timeout=timeout or self.timeout)
            return r.status
        except grpc.RpcError as e:
            raise _failed(e) from None

    async def close(self) -> None:
        await self.channel.close()
        if self.mailbox is not None:
            self.mailbox.close()
