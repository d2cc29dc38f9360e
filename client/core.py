"""The client core, shared by the blocking and the asyncio shells (``client.py``):
channels and credentials, typed errors with their google.rpc details, the one retry
policy, the SubmitRequest stream, and the FetchKV collector that reassembles layers
and verifies the whole-transfer digest end to end. No call is made here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import grpc
import numpy as np

from speckv import frames
from speckv.digests import ALGORITHMS, BLAKE2B_128, XXH3_128, KVDigest
from speckv.errors import RpcFailed
from speckv.kv import Fp8Attention, Fp8KV, HeadRange, bf16_bits
from speckv.status import error_details
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import encoder_pb2 as epb
from speckv.wire import (
    MAX_MESSAGE_BYTES,
    NAN_SCALES,
    PART_BYTES,
    LayerAssembler,
    dtype_of,
    fp8_attention_msg,
    heads_msg,
    kv_shape,
    layer_frames,
    layer_messages,
    shape_of,
)

from .local import LocalHandoff, LocalLayers, LocalMailbox

if TYPE_CHECKING:  # pragma: no cover
    import torch

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
ENCODINGS = {"speckv": epb.ENCODING_SPECKV, "stored": epb.ENCODING_STORED}
FETCH_DIGEST = XXH3_128  # the whole-transfer digest the clients ask FetchKV for (FetchKVRequest.digest)


def fetch_stub(channel: "grpc.Channel | grpc.aio.Channel") -> Any:
    """DecoderService.FetchKV whose responses come as ``frames.Parsed``: each layer part's
    data a view of the bytes received (upb would copy it twice)."""
    return channel.unary_stream("/speckv.v1.DecoderService/FetchKV", request_serializer=frames.serialize,
                                response_deserializer=frames.deserializer(dpb.FetchKVResponse))


def submit_stub(channel: "grpc.Channel | grpc.aio.Channel") -> Any:
    """EncoderService.Submit taking ``submit_requests(..., framed=True)``: its serializer
    passes the pre-serialised layer parts through (``speckv.frames``)."""
    return channel.stream_unary("/speckv.v1.EncoderService/Submit", request_serializer=frames.serialize,
                                response_deserializer=epb.SubmitResponse.FromString)


def tls_credentials(ca: str, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """Channel credentials from PEM files: verify the sidecar with ``ca``; present
    ``cert``/``key`` where the sidecar requires client certificates (mTLS)."""
    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()
    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))


def _channel(address: str, credentials: grpc.ChannelCredentials | None,
             aio: bool = False) -> grpc.Channel | grpc.aio.Channel:
    mod = grpc.aio if aio else grpc
    if credentials is None:
        return mod.insecure_channel(address, options=CHANNEL_OPTIONS)
    return mod.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


def _failed(e: grpc.RpcError) -> RpcFailed:
    """The typed error of a failed call, with its google.rpc ErrorInfo reason and RetryInfo delay."""
    reason, retry_after = error_details(e)
    return RpcFailed(e.code(), e.details() or "", reason, retry_after)


def _retry_delay(e: grpc.RpcError, request_id: str, attempt: int, retries: int, backoff_s: float) -> float:
    """Seconds to wait before retrying a submit that failed with ``e``; raises the typed
    error when it is not retryable (only UNAVAILABLE is: the decoder keeps no state of a
    transfer whose call ended, so a retry under the same id starts afresh) or retries ran out.
    The wait is ``backoff_s`` doubling per attempt, or the server's RetryInfo if longer."""
    err = _failed(e)
    if err.code != grpc.StatusCode.UNAVAILABLE or attempt == retries:
        raise err from None
    delay: float = max(backoff_s * 2 ** attempt, err.retry_after or 0.0)
    logger.warning("submit %s: %s (attempt %d of %d), retrying in %.1f s", request_id, err.details,
                   attempt + 1, retries + 1, delay)
    return delay


@dataclass(frozen=True)
class ChunkTiming:
    """When one chunk's stages ended on the encoder, in seconds since the Submit header's arrival."""

    chunk: int
    layers_in_seconds: float  # its layers all in from the engine
    ready_seconds: float  # its layers and (speckv) both sides' mu of them in hand
    coded_seconds: float  # its record coded
    written_seconds: float  # its record written to the decoder
    wire_bytes: int  # its record's size
    mu_seconds: float = 0.0  # this encoder's mu of its layers existed (0: before the Submit, or stored)
    peer_mu_seconds: float = 0.0  # the decoder's check of its mu arrived (0: stored)

    @property
    def inputs_seconds(self) -> float:
        """When all it needs existed: its layers and both sides' mu, however busy the sender was."""
        return max(self.layers_in_seconds, self.mu_seconds, self.peer_mu_seconds)


@dataclass(frozen=True)
class SubmitResult:
    raw_bytes: int
    wire_bytes: int
    chunks: int
    predictor_seconds: float
    encode_seconds: float
    transfer_seconds: float
    total_seconds: float
    message_bytes: int
    encoding: str = "speckv"
    fallback: bool = False  # some chunk went stored: the predictors disagreed on its layers' mu
    stored_chunks: int = 0  # chunks of a speckv stream sent stored (mismatch or size guard)
    mu_wait_seconds: float = 0.0  # the encoder waiting for mu (its own, or the decoder's check)
    wire_wait_seconds: float = 0.0  # the encoder inside writes to the decoder (flow control)
    chunk_timings: tuple[ChunkTiming, ...] = ()  # per chunk: when its stages ended on the encoder

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else float("inf")


# -- request building (shared by the sync and async clients) ---------------------

def _as_kv(kv: Any) -> tuple[int, np.ndarray, np.ndarray | None]:
    """(dtype enum, bits array, scales) of a KV given as torch/numpy BF16 or Fp8KV."""
    if isinstance(kv, Fp8KV):
        codes = np.ascontiguousarray(kv.codes)
        if codes.dtype != np.uint8:
            raise TypeError(f"Fp8KV codes must be uint8, not {codes.dtype}")
        scales = np.asarray(kv.scales, np.float32)
        if scales.shape != (codes.shape[0], 2):
            raise ValueError(f"Fp8KV scales must have shape ({codes.shape[0]}, 2), not {scales.shape}")
        return pb.DTYPE_FP8_E4M3, codes, scales
    bits = bf16_bits(kv)
    return pb.DTYPE_BF16, bits, None


def submit_requests(request_id: str, kv: Any, prompt_token_ids: Any, decoder_address: str,
                    model_id: str, encoding: str = "speckv", expected_pin: str | None = None,
                    part_bytes: int = PART_BYTES, *, framed: bool = False,
                    handoff: "LocalHandoff | None" = None, fp8_attention: Fp8Attention | None = None,
                    heads: HeadRange | None = None) -> Iterator[Any]:
    """The SubmitRequest stream: header, then every layer in parts. The KV is checked
    here, before any call starts (ValueError / TypeError). ``framed``: the layer parts
    come pre-serialised (bytes, each part's data copied once: ``speckv.frames``), for a
    stub whose serializer passes them through (``submit_stub``). ``handoff``: the KV goes
    as one sealed memfd over the encoder's local socket, shared here (``client/local.py``),
    and the stream names it in one LocalLayer per layer."""
    dtype, bits, scales = _as_kv(kv)
    if bits.ndim != 5 or bits.shape[1] != 2:
        raise ValueError(f"KV must be (layers, 2, kv_heads, tokens, head_dim), not {bits.shape}")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {sorted(ENCODINGS)}, not {encoding!r}")
    if scales is not None and np.isnan(scales).any():
        raise ValueError(NAN_SCALES)
    if handoff is not None:
        from .local import local_submit_requests

        header = submit_header(request_id, dtype, kv_shape(bits.shape), prompt_token_ids, decoder_address, model_id,
                               encoding, expected_pin, fp8_attention, heads)
        return local_submit_requests(handoff, header, bits, scales)
    header = submit_header(request_id, dtype, kv_shape(bits.shape), prompt_token_ids, decoder_address, model_id,
                           encoding, expected_pin, fp8_attention, heads)
    return _submit_stream(header, bits, scales, dtype, kv_shape(bits.shape), part_bytes, framed)


def _submit_stream(header: epb.SubmitRequest, bits: np.ndarray, scales: np.ndarray | None, dtype: int,
                   shape: pb.KVShape, part_bytes: int, framed: bool) -> Iterator[Any]:
    yield header
    for layer in range(bits.shape[0]):
        sc = None if scales is None else scales[layer]
        if framed:
            yield from submit_layer_frames(layer, bits[layer], dtype, shape, part_bytes, sc)
        else:
            for part in layer_messages(layer, bits[layer], dtype, shape, part_bytes, sc):
                yield epb.SubmitRequest(layer=part)


def submit_header(request_id: str, dtype: int, shape: pb.KVShape, prompt_token_ids: Any, decoder_address: str,
                  model_id: str, encoding: str, expected_pin: str | None,
                  fp8_attention: Fp8Attention | None = None, heads: HeadRange | None = None) -> epb.SubmitRequest:
    """The first SubmitRequest of a call: what both sidecars need to start their predictors
    (``fp8_attention``: how the engine's attention read its FP8 cache, FP8 KV only; ``heads``:
    the KV holds only these heads, one tensor-parallel rank's)."""
    if heads is not None and heads.count != shape.kv_heads:
        raise ValueError(f"{heads} but the KV has {shape.kv_heads} heads")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {sorted(ENCODINGS)}, not {encoding!r}")
    if fp8_attention is not None and dtype != pb.DTYPE_FP8_E4M3:
        raise ValueError("fp8_attention is for FP8 KV only")
    return epb.SubmitRequest(header=epb.SubmitHeader(
        request_id=request_id, decoder_address=decoder_address, model_id=model_id, dtype=dtype,
        shape=shape, prompt_token_ids=[int(t) for t in np.asarray(prompt_token_ids).ravel()],
        expected_predictor_pin=bytes.fromhex(expected_pin) if expected_pin else b"",
        encoding=ENCODINGS[encoding], fp8_attention=fp8_attention_msg(fp8_attention), heads=heads_msg(heads)))


def submit_layer_frames(layer: int, arr: np.ndarray, dtype: int, shape: pb.KVShape, part_bytes: int,
                        scales: np.ndarray | None, token_start: int | None = None) -> Iterator[bytes]:
    """One layer ``(2, heads, tokens, dim)`` (``token_start``: its token range from there) as
    pre-serialised SubmitRequests (``submit_stub``)."""
    for p in layer_frames(layer, arr, dtype, shape, part_bytes, scales, token_start):
        yield frames.join(frames.submessage(2, p))  # NOTE: SubmitRequest.layer is field 2


def _result(r: epb.SubmitResponse) -> SubmitResult:
    return SubmitResult(r.raw_bytes, r.wire_bytes, r.chunks, r.predictor_seconds, r.encode_seconds,
                        r.transfer_seconds, r.total_seconds, r.message_bytes, r.encoding, r.fallback,
                        r.stored_chunks, r.mu_wait_seconds, r.wire_wait_seconds,
                        tuple(ChunkTiming(t.chunk, t.layers_in_seconds, t.ready_seconds, t.coded_seconds,
                                          t.written_seconds, t.wire_bytes, t.mu_seconds, t.peer_mu_seconds)
                              for t in r.chunk_timings))


class _Collector:
    """Assembles FetchKV parts into layers (``whole``: straight into the whole cache)."""

    def __init__(self, verified_only: bool = False, whole: bool = False, model_id: str = "",
                 heads: HeadRange | None = None, tokens: tuple[int, int] | None = None,
                 mailbox: "LocalMailbox | None" = None) -> None:
        self.asm: LayerAssembler | LocalLayers | None = None
        self.mailbox = mailbox  # a local fetch's (FetchKVRequest.local_mailbox; None: bytes)
        self.out: np.ndarray | None = None
        self.scales: np.ndarray | None = None
        self.digest: KVDigest | None = None  # recomputed here (the check is end to end), once its algorithm is known
        self.done = False
        self.verified_only = verified_only  # ask the server to hold layers until verified
        self.whole = whole
        self.model_id = model_id  # the decode engine's model (FetchKVRequest.model_id; "" = not checked)
        self.heads = heads  # the heads asked for (FetchKVRequest.heads; None = the transfer's)
        self.tokens = tokens  # the tokens [start, stop) asked for (None: all)
        self.cut: slice | None = None  # those tokens, cut here: a decoder before FetchKVRequest.token_start

    def add(self, msg: "dpb.FetchKVResponse | frames.Parsed") -> tuple[int, np.ndarray, np.ndarray | None] | None:
        if self.done:
            raise RpcFailed(grpc.StatusCode.INTERNAL, "FetchKV sent data after FetchKVDone")
        algorithm = msg.digest or BLAKE2B_128  # NOTE: unset: a decoder before FetchKVRequest.digest
        if self.digest is None:
            if algorithm not in ALGORITHMS:
                raise RpcFailed(grpc.StatusCode.INTERNAL, f"FetchKV names an unknown digest algorithm {algorithm}")
            self.digest = KVDigest(algorithm)
        elif algorithm != self.digest.algorithm:
            raise RpcFailed(grpc.StatusCode.INTERNAL, "malformed FetchKV stream: its digest algorithm changed")
        kind = msg.WhichOneof("kind")
        if kind == "done":
            self._finish(msg.done)
            return None
        if kind == "local_layer":
            return self._local(msg.local_layer)
        part = msg.layer
        try:
            if self.asm is None:
                self.asm = self._assembler(part)
            assert isinstance(self.asm, LayerAssembler), "FetchKV mixed local and byte layers"
            got = self.asm.add(part, frames.payload_of(msg))
        except Exception as e:  # noqa: BLE001 -- whatever a server sent, the caller gets a typed error
            raise RpcFailed(grpc.StatusCode.INTERNAL, f"malformed FetchKV stream: {e}") from None
        if got is not None:
            self.digest.update_layer(got[1], got[2])
            if self.cut is not None and not self.whole:
                return got[0], got[1][:, :, self.cut], got[2]
        return got

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        """The heads and tokens asked for (a local fetch's decoder knows token ranges: no cut)."""
        if self.heads is not None and shape[2] != self.heads.count:
            raise ValueError(f"{shape[2]} heads sent for {self.heads}")
        if self.tokens is not None and shape[3] != self.tokens[1] - self.tokens[0]:
            raise ValueError(f"{shape[3]} tokens sent for tokens {self.tokens}")

    def _assembler(self, part: pb.KVLayer) -> LayerAssembler:
        shape = shape_of(part.shape)
        if self.heads is not None and shape[2] != self.heads.count:
            raise ValueError(f"{shape[2]} heads sent for {self.heads}")
        if self.tokens is not None and shape[3] != self.tokens[1] - self.tokens[0]:
            if shape[3] < self.tokens[1]:
                raise ValueError(f"{shape[3]} tokens sent for tokens {self.tokens}")
            self.cut = slice(*self.tokens)  # NOTE: the whole layers came: the digest is over them, then cut
        if not self.whole:
            return LayerAssembler(part.dtype, shape)
        self.out = np.empty(shape, dtype_of(part.dtype)[1])  # NOTE: layers land in it, no copy after
        return LayerAssembler(part.dtype, shape, out=self.out)

    def _local(self, part: dpb.LocalFetchLayer) -> tuple[int, np.ndarray, np.ndarray | None] | None:
        """A local fetch's layer: a view of the memfd (None when ``whole``: ``_finish`` maps it)."""
        if self.mailbox is None:
            raise RpcFailed(grpc.StatusCode.INTERNAL, "FetchKV sent a local layer to a fetch without a mailbox")
        try:
            if self.asm is None:
                self.asm = LocalLayers(self.mailbox, part, self.whole)
                self._check_shape(self.asm.shape)
            assert isinstance(self.asm, LocalLayers), "FetchKV mixed local and byte layers"
            layer, arr, scales = self.asm.add(part)
        except RpcFailed:
            raise  # the mailbox's own (UNAVAILABLE, DEADLINE_EXCEEDED, ...)
        except Exception as e:  # noqa: BLE001 -- whatever a server sent, the caller gets a typed error
            raise RpcFailed(grpc.StatusCode.INTERNAL, f"malformed FetchKV stream: {e}") from None
        return None if arr is None else (layer, arr, scales)

    def _finish(self, done: dpb.FetchKVDone) -> None:
        if self.asm is None or not self.asm.done or self.digest is None:
            raise RpcFailed(grpc.StatusCode.INTERNAL, "FetchKVDone before the last layer")
        if isinstance(self.asm, LocalLayers):  # NOTE: its digest is over the sealed memfd's final bytes
            try:
                out = self.asm.finish(self.digest)
            except (ValueError, OSError) as e:
                raise RpcFailed(grpc.StatusCode.DATA_LOSS, f"local fetch: {e}") from None
            if self.whole:
                self.out = out
                if self.asm.scales and self.asm.scales[0] is not None:
                    self.scales = np.stack(self.asm.scales)  # type: ignore[arg-type]  # FP8: every layer has its two
            del out  # NOTE: not kept alive by a traceback through this frame
        if (self.digest.digest(), self.digest.raw_bytes) != (bytes(done.raw_digest), done.raw_bytes):
            self.out = None  # NOTE: a local fetch's mapping (and its fd) goes with the bad bytes
            raise RpcFailed(grpc.StatusCode.DATA_LOSS, "the fetched KV does not match the encoder's "
                                                       "whole-transfer digest")
        self.done = True

    def keep(self, layer: int, arr: np.ndarray, scales: np.ndarray | None) -> None:
        assert self.asm is not None
        if self.out is None:
            self.out = np.empty(self.asm.shape, arr.dtype)
        if self.scales is None and scales is not None:
            self.scales = np.empty((self.asm.shape[0], 2), np.float32)
        if not self.whole:  # NOTE: whole: the assembler wrote it there already
            self.out[layer] = arr
        if scales is not None:
            assert self.scales is not None  # an FP8 transfer: allocated with its first layer
            self.scales[layer] = scales

    def close(self) -> None:
        """A local fetch's fd, if it is still open (the call failed or stopped early)."""
        if isinstance(self.asm, LocalLayers):
            self.asm.close()

    def check_done(self) -> None:
        if self.asm is None or not self.asm.done:
            raise RpcFailed(grpc.StatusCode.DATA_LOSS, "FetchKV ended before the last layer")
        if not self.done:
            raise RpcFailed(grpc.StatusCode.DATA_LOSS, "FetchKV ended without the whole-transfer verification")

    def result(self, as_torch: bool) -> "np.ndarray | Fp8KV | torch.Tensor":
        self.check_done()
        assert self.out is not None  # check_done: every layer was kept
        out = self.out if self.cut is None else np.ascontiguousarray(self.out[:, :, :, self.cut])
        if self.scales is not None:
            return Fp8KV(out, self.scales)
        return to_torch(out) if as_torch else out


def to_torch(bits: np.ndarray) -> "torch.Tensor":
    """uint16 BF16 bit patterns -> torch.bfloat16 (shares memory)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def fetch_request(request_id: str, wait: float | None, verified_only: bool, model_id: str = "",
                  heads: HeadRange | None = None, tokens: tuple[int, int] | None = None,
                  mailbox: str = "") -> dpb.FetchKVRequest:
    start, stop = tokens or (0, 0)
    if not 0 <= start <= stop:
        raise ValueError(f"tokens must be (start, stop) with 0 <= start <= stop, not {tokens}")
    if tokens is not None and stop == start:
        raise ValueError("tokens: an empty range (FetchKVRequest.token_count 0 means to the end)")
    return dpb.FetchKVRequest(request_id=request_id, wait_timeout_ms=int((wait or 0) * 1000),
                              verified_only=verified_only, digest=FETCH_DIGEST, model_id=model_id,
                              heads=heads_msg(heads), token_start=start, token_count=stop - start,
                              local_mailbox=mailbox)
