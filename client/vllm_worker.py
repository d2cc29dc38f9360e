"""The worker half of speckv's vLLM connector (``speckv.client.vllm``): Submit streams
out of vLLM's paged cache on a prefill engine, verified fetches into it on a decode
engine, each engine's counts for vLLM's stats. One per vLLM worker process.

Imported only inside vLLM's process.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

import grpc
import numpy as np
import torch

from speckv.errors import RpcFailed
from speckv.kv import Fp8Attention, HeadRange

from .client import DecoderClient, EncoderClient
from .core import tls_credentials
from .paged import PagedLayout, fp8_rounds_toward_zero
from .pd import LoadSpec, StepPlan, block_span
from .stream import SubmitStream
from .vllm_stats import SpeckvConnectorStats

# NOTE: a child of "vllm": vLLM configures that logger tree (format, level) in each of its processes
logger = logging.getLogger("vllm.speckv")

FETCH_WAIT_S = 30.0  # how long FetchKV waits for a transfer the decoder has not seen yet
TIMEOUT_S = 600.0  # one Submit or FetchKV call, end to end
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # vLLM's kv_cache_dtype names of e4m3 caches (e5m2 is refused)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class Settings(Protocol):
    """What the worker reads of its connector (``speckv.client.vllm.SpeckvConnector``)."""

    _vllm_config: Any
    block_size: int
    producer: bool
    consumer: bool
    encoder_address: str | None
    decoder_address: str | None
    local_socket: str | None  # this engine's sidecar's local socket (``local_socket``), or None
    model_id: str
    encoding: str
    fetch_wait_s: float
    head_range: HeadRange | None  # tensor parallelism: this rank's KV heads (None: one rank, all heads)


def _credentials() -> grpc.ChannelCredentials | None:
    """mTLS from the chart's SPECKV_TLS_CA / _CERT / _KEY, when set."""
    ca = os.environ.get("SPECKV_TLS_CA")
    return tls_credentials(ca, os.environ.get("SPECKV_TLS_CERT"), os.environ.get("SPECKV_TLS_KEY")) if ca else None


def local_socket(get: Callable[[str, Any], Any]) -> str | None:
    """This engine's sidecar's local socket (``speckv.client.local``: the encoder's hand-off
    for a producer, the decoder's local fetch for a consumer), from ``get`` (vLLM's
    ``get_from_extra_config``): the ``speckv_local_socket`` key of kv_connector_extra_config,
    else SPECKV_LOCAL_SOCKET (the variable the sidecar listens by); neither, or empty: None,
    the KV goes as bytes on gRPC."""
    path = get("speckv_local_socket", os.environ.get("SPECKV_LOCAL_SOCKET"))
    return str(path) if path else None


class Worker:
    """The worker half: Submit streams out of the paged cache, fetches into it."""

    def __init__(self, conn: Settings) -> None:
        self.conn = conn
        self.layers: list[str] = []
        self.caches: dict[str, torch.Tensor] = {}
        self.streams: dict[str, SubmitStream] = {}  # transfer id -> open Submit
        self.lock = threading.Lock()
        self._opened_for: StepPlan | None = None  # the step plan whose Submits are open
        self._layout: PagedLayout | None = None
        self._fp8_attention: Fp8Attention | None = None  # learned on first use (fp8_attention)
        self.stats = SpeckvConnectorStats()
        self.received: set[str] = set()
        self.errors: set[int] = set()
        creds = _credentials()
        # NOTE: the connector refused a producer without an encoder address, a consumer without a decoder's
        self.encoder = EncoderClient(str(conn.encoder_address), TIMEOUT_S, credentials=creds,
                                     local_socket=conn.local_socket) if conn.producer else None
        if self.encoder is not None and conn.local_socket:
            logger.info("speckv: the KV goes to the encoder as sealed memfds through %s", conn.local_socket)
        # NOTE: an instance that is both producer and consumer has one local socket: its encoder's
        fetch_socket = conn.local_socket if conn.consumer and not conn.producer else None
        self.decoder = DecoderClient(str(conn.decoder_address), TIMEOUT_S, credentials=creds,
                                     local_socket=fetch_socket) if conn.consumer else None
        if fetch_socket:
            logger.info("speckv: the KV comes from the decoder as sealed memfds through %s", fetch_socket)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="speckv-fetch") if conn.consumer else None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise NotImplementedError("SpeckvConnector reads the paged layout of vLLM's CPU backend only; "
                                      f"{current_platform.device_name} attention backends are not supported yet")
        self.caches = dict(kv_caches)
        self.layers = sorted(kv_caches, key=_layer_index)
        first = kv_caches[self.layers[0]]
        cache_dtype = str(self.conn._vllm_config.cache_config.cache_dtype)
        self.fp8 = first.dtype == torch.uint8 and cache_dtype in FP8_CACHE_DTYPES
        if first.dtype != torch.bfloat16 and not self.fp8:
            raise NotImplementedError(f"SpeckvConnector moves BF16 and FP8 e4m3 KV caches; this one is {first.dtype} "
                                      f"(kv_cache_dtype {cache_dtype})")
        self.heads, self.head_dim = int(first.shape[1]), int(first.shape[3]) // 2
        if self.conn.head_range is not None and self.conn.head_range.count != self.heads:
            raise NotImplementedError(f"this rank's cache holds {self.heads} KV heads, not the "
                                      f"{self.conn.head_range} tensor parallelism gives it")

    def scales(self, name: str) -> np.ndarray | None:
        """An FP8 layer's (k, v) scales, as vLLM's attention layer applies them (None for BF16)."""
        return self._scales(name) if self.fp8 else None

    def _scales(self, name: str) -> np.ndarray:
        layer = self.conn._vllm_config.compilation_config.static_forward_context[name]
        return np.array([layer._k_scale_float, layer._v_scale_float], np.float32)

    def fp8_attention(self) -> Fp8Attention | None:
        """How this engine's attention reads its FP8 cache (None for BF16): every layer's (k, v)
        scales and the cache writer's rounding, learned from the writer on first use."""
        if not self.fp8:
            return None
        with self.lock:
            if self._fp8_attention is None:
                scales = np.array([self._scales(name) for name in self.layers], np.float32)  # (layers, 2)
                write = _cpu_writer(self.conn, self.layers[0], self.head_dim, True)
                self._fp8_attention = Fp8Attention(tuple(map(float, scales[:, 0])), tuple(map(float, scales[:, 1])),
                                                   fp8_rounds_toward_zero(write, self.conn.block_size, self.head_dim),
                                                   amx=_attn_isa(self.conn, self.layers[0], self.head_dim,
                                                                 True) == "amx")
            return self._fp8_attention

    def layout(self) -> PagedLayout:
        """The CPU kernel's block interior, learned from its own cache writer on first use
        (the kernel ISA is chosen when vLLM builds its attention metadata)."""
        with self.lock:
            if self._layout is None:
                self._layout = _learn_cpu_layout(self.conn, self.layers[0], self.head_dim, self.fp8)
                logger.info("speckv: learned the paged layout of vLLM's CPU attention (block %d, head_dim %d)",
                            self.conn.block_size, self.head_dim)
            return self._layout

    def start(self, plan: StepPlan) -> None:
        for tid in plan.cancels:
            stream = self.streams.pop(tid, None)
            if stream is not None:
                stream.cancel()
        self.open_new(plan)
        for spec in plan.loads:
            assert self.pool is not None
            self.pool.submit(self._fetch, spec)

    def open_new(self, plan: StepPlan) -> None:
        """Open the Submits of the requests first scheduled this step, once per step.
        NOTE: vLLM's CPU runner calls start_load_kv after the forward; bind_connector_metadata
        comes before it, and save_kv_layer checks too."""
        if plan is self._opened_for:
            return
        self._opened_for = plan
        for s in plan.saves:
            if s.prompt_token_ids is not None:
                self._open(s.transfer_id, s.decoder_address, s.prompt_token_ids)

    def _open(self, tid: str, decoder: str, prompt: list[int]) -> None:
        assert self.encoder is not None
        shape = (len(self.layers), 2, self.heads, len(prompt), self.head_dim)
        try:
            stream = self.encoder.open_submit(tid, shape, np.asarray(prompt, np.int64), decoder, self.conn.model_id,
                                              dtype="fp8_e4m3" if self.fp8 else "bf16", encoding=self.conn.encoding,
                                              fp8_attention=self.fp8_attention(), heads=self.conn.head_range)
        except Exception as e:  # noqa: BLE001 -- never the engine's forward: the decode side recomputes
            logger.warning("speckv: cannot open the submit of %s: %s", tid, e)
            with self.lock:
                self.stats.add(send_failed=1)
            return
        self.streams[tid] = stream
        stream.add_done_callback(lambda st: self._submitted(tid, st))

    def _submitted(self, tid: str, stream: SubmitStream) -> None:
        self.streams.pop(tid, None)
        try:
            r = stream.result(timeout=0)
            logger.info("speckv: sent %s: %d bytes of KV as %d (ratio %.2f, %d stored chunks)", tid, r.raw_bytes,
                        r.wire_bytes, r.ratio, r.stored_chunks)
            with self.lock:
                self.stats.add(sent=1, raw_bytes_sent=r.raw_bytes, wire_bytes_sent=r.wire_bytes)
        except RpcFailed as e:
            if e.code != grpc.StatusCode.CANCELLED:
                logger.warning("speckv: submit %s failed: %s %s (the decode side will recompute)", tid,
                               e.code.name, e.details)
                with self.lock:
                    self.stats.add(send_failed=1)

    def save_layer(self, plan: StepPlan, name: str, layer: torch.Tensor) -> None:
        i = self.layers.index(name)
        self.open_new(plan)
        for s in plan.saves:
            stream = self.streams.get(s.transfer_id)
            if not s.complete or stream is None or stream.layers_sent != i:
                continue
            try:
                kv = self.layout().gather(layer, s.block_ids, 0, s.num_tokens)
                stream.send_layer(i, kv.numpy() if self.fp8 else kv, self.scales(name))
            except RpcFailed as e:
                self.streams.pop(s.transfer_id, None)
                if stream.done():
                    continue  # NOTE: the call itself failed: its done-callback logs why
                # the local hand-off refused the layer (a LOCAL_* reason) while the call is open:
                # as any failed submit, logged, counted and cancelled (the decode side recomputes)
                logger.warning("speckv: submit %s failed: %s %s %s (the decode side will recompute)",
                               s.transfer_id, e.code.name, e.reason, e.details)
                with self.lock:
                    self.stats.add(send_failed=1)
                stream.cancel()
            except Exception as e:  # noqa: BLE001 -- never the engine's forward: the decode side recomputes
                logger.warning("speckv: cannot send layer %d of %s: %s; its submit is cancelled", i, s.transfer_id, e)
                self.streams.pop(s.transfer_id, None)
                stream.cancel()

    def _fetch(self, spec: LoadSpec) -> None:
        assert self.decoder is not None
        failed: list[int] = []
        t0, raw = time.monotonic(), 0
        try:
            # NOTE: only the tokens this engine lacks (FetchKVRequest token range): its prefix-cache hit holds the rest
            for i, arr, scales in self.decoder.fetch_layers(spec.transfer_id, wait=self.conn.fetch_wait_s,
                                                            model_id=self.conn.model_id, heads=self.conn.head_range,
                                                            tokens=(spec.start, spec.stop)):
                raw += arr.nbytes
                self._check_scales(i, scales)
                part = np.ascontiguousarray(arr)
                kv = torch.from_numpy(part) if self.fp8 else torch.from_numpy(part.view(np.int16)).view(torch.bfloat16)
                self.layout().scatter(self.caches[self.layers[i]], spec.block_ids, spec.start, kv)
            logger.info("speckv: received %s: tokens [%d, %d), verified", spec.transfer_id, spec.start, spec.stop)
        except Exception as e:  # noqa: BLE001 -- any failure leaves vLLM to recompute the blocks
            logger.warning("speckv: fetch %s failed: %s (vLLM recomputes its %d tokens)", spec.transfer_id, e,
                           spec.stop - spec.start)
            failed = block_span(spec.block_ids, self.conn.block_size, spec.start, spec.stop)
        with self.lock:  # NOTE: together: vLLM reads a request's failed blocks no later than the request
            self.errors.update(failed)
            self.received.add(spec.req_id)
            if failed:
                self.stats.add(receive_failed=1)
            else:
                self.stats.fetched(raw, time.monotonic() - t0)

    def _check_scales(self, i: int, scales: np.ndarray | None) -> None:
        """FP8 codes mean code * scale: the sender's scales must be this engine's, bit for bit."""
        mine = self.scales(self.layers[i])
        if (mine is None) != (scales is None):
            raise ValueError(f"layer {i}: the transfer is {'FP8' if scales is not None else 'BF16'}, this engine's "
                             f"cache is {'FP8' if mine is not None else 'BF16'}")
        theirs = np.asarray(scales, np.float32)
        if mine is not None and not np.array_equal(mine.view(np.uint32), theirs.view(np.uint32)):
            raise ValueError(f"layer {i}: the prefill engine's FP8 scales {scales} differ from this engine's {mine}")

    def take_received(self) -> set[str]:
        with self.lock:
            out, self.received = self.received, set()
        return out

    def take_stats(self) -> SpeckvConnectorStats | None:
        with self.lock:
            return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def take_errors(self) -> set[int]:
        with self.lock:
            out, self.errors = self.errors, set()
        return out

    def close(self) -> None:
        for stream in list(self.streams.values()):
            stream.cancel()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        for c in (self.encoder, self.decoder):
            if c is not None:
                c.close()


def _learn_cpu_layout(conn: Settings, layer_name: str, head_dim: int, fp8: bool) -> PagedLayout:
    """Probe vLLM's CPU cache writer with the ISA its attention layers use."""
    write = _cpu_writer(conn, layer_name, head_dim, fp8)
    return PagedLayout.learn(write, conn.block_size, head_dim, torch.uint8 if fp8 else torch.bfloat16)


def _attn_isa(conn: Settings, layer_name: str, head_dim: int, fp8: bool) -> str:
    """The kernel ISA of vLLM's CPU attention layers (``amx``, ``vec``, ...): how they lay out and
    read the cache."""
    layer = conn._vllm_config.compilation_config.static_forward_context.get(layer_name)
    isa = getattr(layer, "isa", None)
    if isa is None:  # NOTE: private to vLLM: the same choice its CPU backend makes
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(torch.bfloat16, conn.block_size, head_dim, "fp8_e4m3" if fp8 else "auto")
    return str(isa)


def _cpu_writer(conn: Settings, layer_name: str, head_dim: int, fp8: bool) -> Callable[..., None]:
    """vLLM's CPU cache writer (scale 1.0) with the ISA its attention layers use."""
    from vllm import _custom_ops as ops

    isa = _attn_isa(conn, layer_name, head_dim, fp8)
    cache_dtype = "fp8_e4m3" if fp8 else "auto"

    def write(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, 1.0, 1.0, cache_dtype)

    return write


def _layer_index(name: str) -> int:
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise ValueError(f"no layer index in the attention layer name {name!r}")
    return int(m.group(1))
