"""A Submit fed one layer at a time, for engines that produce the KV layer by layer.

A vLLM prefill writes each attention layer's KV into its paged cache as that layer's
forward runs. ``EncoderClient.open_submit`` sends the header at once, so the encoder
and decoder sidecars start their predictors while the engine still prefills; each
``send_layer`` then queues one layer, in order, and returns without waiting for the
network (grpc's own thread drains the queue as flow control allows).

Lifecycle::

    s = enc.open_submit("t-1", (layers, 2, heads, tokens, dim), prompt_ids, decoder_address=..., model_id=...)
    for i in range(layers):
        s.send_layer(i, kv_of_layer_i)          # (2, heads, tokens, dim): BF16 bits or torch.bfloat16
    res = s.result()                            # the SubmitResponse, after the last layer
    # or s.cancel(): the call ends and the decoder drops the transfer

Chunked prefill: ``send_tokens(layer, start, kv_of_those_tokens)`` sends a layer's tokens
as each prefill step computes them (KVLayer token ranges), every layer so; a layer's
ranges in token order, and a layer's last range after the previous layer's last.

NOTE: the queue is not bounded: each queued layer is a copy the caller already made
(the engine's paged blocks may be reused once ``send_layer`` returns), so at most one
request's KV waits here.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

import grpc
import numpy as np

from speckv.errors import RpcFailed
from speckv.kv import Fp8Attention, HeadRange
from speckv.v1 import common_pb2 as pb
from speckv.wire import NAN_SCALES, PART_BYTES, kv_shape

from .core import SubmitResult, _failed, _result, submit_header, submit_layer_frames
from .local import LocalHandoff, local_layers

_END = None  # the queue's end-of-stream mark
DTYPES = {"bf16": pb.DTYPE_BF16, "fp8_e4m3": pb.DTYPE_FP8_E4M3}


class SubmitStream:
    """One Submit call whose layers are handed over as the engine produces them."""

    def __init__(self, stub: Any, request_id: str, shape: tuple[int, int, int, int, int], prompt_token_ids: Any,
                 decoder_address: str, model_id: str, *, dtype: str = "bf16", encoding: str = "speckv",
                 expected_pin: str | None = None, timeout: float = 600.0, part_bytes: int = PART_BYTES,
                 handoff: LocalHandoff | None = None, fp8_attention: Fp8Attention | None = None,
                 heads: HeadRange | None = None) -> None:
        if len(shape) != 5 or shape[1] != 2 or min(shape) < 0:
            raise ValueError(f"shape must be (layers, 2, kv_heads, tokens, head_dim), not {shape}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
        self.request_id = request_id
        self.shape = tuple(int(d) for d in shape)
        self._dtype = DTYPES[dtype]
        self._pb_shape = kv_shape(self.shape)
        self._part_bytes = part_bytes
        self._next = 0  # the next layer send_layer takes; with token ranges, the next to complete
        self._tokens: dict[int, int] | None = None  # token ranges: tokens sent per layer not yet complete
        self._handoff = handoff  # NOTE: each layer then goes as its own sealed memfd
        self._queue: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        header = submit_header(request_id, self._dtype, self._pb_shape, prompt_token_ids, decoder_address,
                               model_id, encoding, expected_pin, fp8_attention, heads)
        self._future = stub.future(self._requests(header), timeout=timeout)
        # NOTE: however the call ends, the request stream ends too: else grpc's thread that
        # reads it stays parked in _requests for good after a call that failed mid-stream
        self._future.add_done_callback(lambda _f: self._queue.put(_END))

    def _requests(self, header: Any) -> Iterator[Any]:
        yield header
        while (item := self._queue.get()) is not _END:
            yield item

    @property
    def layers_sent(self) -> int:
        return self._next

    def send_layer(self, layer: int, kv: Any, scales: Any = None) -> None:
        """Queue layer ``layer`` (``(2, heads, tokens, dim)``: uint16 BF16 bits or a
        torch.bfloat16 tensor; FP8: uint8 codes and its two fp32 scales). Layers go in
        order; after the last one the request stream ends. Raises ValueError on a wrong
        layer or shape, RpcFailed when the call has already failed."""
        arr = self._array(kv)
        with self._lock:
            if self._tokens is not None:
                raise ValueError("this stream sends token ranges (send_tokens)")
            if self._next == self.shape[0]:
                raise ValueError(f"layer {layer}: all {self.shape[0]} layers were sent")
            if layer != self._next:
                raise ValueError(f"layer {layer} out of order: layer {self._next} is next of {self.shape[0]}")
            if arr.shape != self.shape[1:]:
                raise ValueError(f"layer {layer} has shape {arr.shape}, the stream's layers are {self.shape[1:]}")
            sc = self._scales(scales)
            self._raise_if_failed()
            if self._handoff is not None:
                handle, _ = self._handoff.share([arr])
                self._queue.put(next(local_layers(handle, arr[None], None if sc is None else sc[None], layer)))
            else:
                for frame in submit_layer_frames(layer, arr, self._dtype, self._pb_shape, self._part_bytes, sc):
                    self._queue.put(frame)
            self._next += 1
            if self._next == self.shape[0]:
                self._queue.put(_END)

    def send_tokens(self, layer: int, start: int, kv: Any, scales: Any = None) -> None:
        """Queue tokens ``[start, start + n)`` of layer ``layer`` (``(2, heads, n, dim)``, as
        ``send_layer``'s). Ranges of a layer go in token order without a gap; layers complete
        in order; after the last layer's last token the request stream ends. Raises ValueError
        on a wrong range or shape, RpcFailed when the call has already failed. NOTE: always as
        bytes on the stream, with a local hand-off too (a LocalLayer carries a whole layer)."""
        arr = self._array(kv)
        with self._lock:
            if self._tokens is None:
                if self._next:
                    raise ValueError("this stream sends whole layers (send_layer)")
                self._tokens = {}
            have = self._tokens.get(layer, 0)
            T = self.shape[3]
            fits = arr.ndim == 4 and arr.shape[:2] + arr.shape[3:] == self.shape[1:3] + self.shape[4:]
            if not (self._next <= layer < self.shape[0] and start == have and fits and 1 <= arr.shape[2] <= T - have):
                raise ValueError(f"layer {layer} tokens {start} + {arr.shape}: not the next range of a layer still "
                                 f"open ({self._next} to {self.shape[0] - 1}; its tokens [0, {have}) of {T} sent)")
            if have + arr.shape[2] == T and layer != self._next:
                raise ValueError(f"layer {layer} would complete before layer {self._next}")
            sc = self._scales(scales)
            self._raise_if_failed()
            for frame in submit_layer_frames(layer, arr, self._dtype, self._pb_shape, self._part_bytes, sc, start):
                self._queue.put(frame)
            self._tokens[layer] = have + arr.shape[2]
            if self._tokens[layer] == T:
                del self._tokens[layer]
                self._next += 1
                if self._next == self.shape[0]:
                    self._queue.put(_END)

    def _array(self, kv: Any) -> np.ndarray:
        if self._dtype == pb.DTYPE_FP8_E4M3:
            arr = np.ascontiguousarray(kv)
            if arr.dtype != np.uint8:
                raise TypeError(f"FP8 layers are uint8 e4m3 codes, not {arr.dtype}")
            return arr
        from speckv.kv import bf16_bits

        return bf16_bits(kv)

    def _scales(self, scales: Any) -> np.ndarray | None:
        if self._dtype != pb.DTYPE_FP8_E4M3:
            if scales is not None:
                raise ValueError("scales belong to FP8 layers only")
            return None
        sc = np.asarray(scales, np.float32).reshape(-1)
        if sc.shape != (2,):
            raise ValueError(f"an FP8 layer takes two scales (k, v), not {sc.shape}")
        if np.isnan(sc).any():
            raise ValueError(NAN_SCALES)
        return sc

    def _raise_if_failed(self) -> None:
        if self._future.cancelled():
            raise RpcFailed(grpc.StatusCode.CANCELLED, f"submit {self.request_id} was cancelled")
        if self._future.done() and self._future.exception() is not None:
            raise _failed(self._future.exception())

    def result(self, timeout: float | None = None) -> SubmitResult:
        """The SubmitResponse once the encoder has sent every chunk (raises RpcFailed)."""
        try:
            return _result(self._future.result(timeout=timeout))
        except grpc.FutureCancelledError:
            raise RpcFailed(grpc.StatusCode.CANCELLED, f"submit {self.request_id} was cancelled") from None
        except grpc.FutureTimeoutError:
            raise RpcFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"submit {self.request_id}: no response within {timeout} s") from None
        except grpc.RpcError as e:
            raise _failed(e) from None

    def add_done_callback(self, fn: Any) -> None:
        """Call ``fn(self)`` from grpc's thread once the call has ended, however it ended."""
        self._future.add_done_callback(lambda _f: fn(self))

    def done(self) -> bool:
        return bool(self._future.done())

    def cancel(self) -> None:
        """End the call now: the encoder stops, and the decoder drops the transfer."""
        # NOTE: cancelled before the request stream ends: the other way round, the encoder
        # may see a stream cut short first, and the call fail INVALID_ARGUMENT, not CANCELLED
        self._future.cancel()
        self._queue.put(_END)
