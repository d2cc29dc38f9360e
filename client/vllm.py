"""speckv's KV connector for vLLM (v1): a prefill instance hands each request's KV to
its encoder sidecar; a decode instance fetches it, verified, from its decoder sidecar.

Enable it on both instances (the module is loaded by path, so vLLM needs no plugin)::

    --kv-transfer-config '{"kv_connector": "SpeckvConnector",
                           "kv_connector_module_path": "speckv.client.vllm",
                           "kv_role": "kv_producer",          # the decode instance: kv_consumer
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {
                               "speckv_encoder_address": "127.0.0.1:50051",     # producer
                               "speckv_decoder_service": "decode-0:50052",      # producer: default target
                               "speckv_decoder_address": "127.0.0.1:50052",     # consumer
                               "speckv_model_id": "SmolLM2-135M-Instruct"}}'

(consumer only: ``speckv_fetch_wait_s``, how long a fetch waits for a transfer its decoder
sidecar has not heard of yet; 30 s.)

The router's protocol is vLLM's own (``speckv.client.pd``): the prefill request carries
``kv_transfer_params={"do_remote_decode": true}``, and its output's kv_transfer_params
go with the decode request.

Lifecycle (a scheduler/worker split, as vLLM runs them in separate processes):

- scheduler, producer: ``get_num_new_matched_tokens`` notes a request to hand off;
  ``build_connector_meta`` tells the worker to open its Submit on the request's first
  step and to send its layers on the step that computes the prompt's last token;
  ``request_finished`` returns the params the decode request needs.
- worker, producer: ``bind_connector_metadata``, before the step's forward, opens the
  Submit (header and prompt ids: both sidecars' predictors start while the prefill runs); ``save_kv_layer`` copies the
  request's tokens out of the paged layer and queues them, layer by layer, while the
  forward goes on (``speckv.client.stream``).
- scheduler, consumer: ``get_num_new_matched_tokens`` claims the prompt's tokens past any
  local prefix hit, loaded asynchronously; ``update_state_after_alloc`` records the blocks.
- worker, consumer: ``start_load_kv`` fetches in a thread and scatters each layer into
  the request's blocks as it arrives; ``get_finished`` reports the request only after
  the whole-transfer digest matched. Any failure (NOT_FOUND, DATA_LOSS, a timeout)
  reports the request's blocks in ``get_block_ids_with_load_errors``: with
  ``kv_load_failure_policy: recompute`` vLLM then computes them itself.

Telemetry: the workers' counts (transfers sent and received, failures, bytes) go through
vLLM's connector-stats API: logged as "KV Transfer metrics" and exported on vLLM's /metrics
as ``vllm:speckv_*`` (``speckv.client.vllm_stats``).

Not supported yet (each refused with a clear error, never a wrong KV): GPU attention
backends' paged layouts (``speckv.client.paged``), tensor or pipeline parallelism (no
head ranges on the wire yet), FP8 e5m2 KV caches. FP8 e4m3 caches move as codes with
their per-layer (k, v) scales; the decode engine refuses scales unlike its own.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from speckv.errors import RpcFailed

from .client import DecoderClient, EncoderClient
from .core import tls_credentials
from .paged import PagedLayout
from .pd import ConsumerPlan, ProducerPlan, StepPlan, block_span
from .stream import SubmitStream
from .vllm_stats import SpeckvConnectorStats, SpeckvPromMetrics

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# NOTE: a child of "vllm": vLLM configures that logger tree (format, level) in each of its processes
logger = logging.getLogger("vllm.speckv")

FETCH_WAIT_S = 30.0  # how long FetchKV waits for a transfer the decoder has not seen yet
TIMEOUT_S = 600.0  # one Submit or FetchKV call, end to end
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # vLLM's kv_cache_dtype names of e4m3 caches (e5m2 is refused)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass
class SpeckvMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


def _credentials() -> grpc.ChannelCredentials | None:
    """mTLS from the chart's SPECKV_TLS_CA / _CERT / _KEY, when set."""
    ca = os.environ.get("SPECKV_TLS_CA")
    return tls_credentials(ca, os.environ.get("SPECKV_TLS_CERT"), os.environ.get("SPECKV_TLS_KEY")) if ca else None


class SpeckvConnector(KVConnectorBase_V1):
    """vLLM KV connector: prefill hands off through speckv's sidecars, decode fetches."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        par = vllm_config.parallel_config
        if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
            raise NotImplementedError("SpeckvConnector supports one rank (tensor and pipeline parallel size 1): "
                                      "the wire has no head ranges yet")
        self.block_size = vllm_config.cache_config.block_size
        self.producer = bool(cfg.is_kv_producer)
        self.consumer = bool(cfg.is_kv_consumer)
        get = cfg.get_from_extra_config
        self.model_id = str(get("speckv_model_id", os.path.basename(vllm_config.model_config.model.rstrip("/"))))
        self.encoding = str(get("speckv_encoding", "speckv"))
        self.fetch_wait_s = float(get("speckv_fetch_wait_s", FETCH_WAIT_S))
        self.encoder_address = get("speckv_encoder_address", os.environ.get("SPECKV_ENCODER_ADDRESS"))
        self.decoder_address = get("speckv_decoder_address", os.environ.get("SPECKV_DECODER_ADDRESS"))
        default_decoder = get("speckv_decoder_service", os.environ.get("SPECKV_DECODER_SERVICE"))
        if self.producer and not self.encoder_address:
            raise ValueError("SpeckvConnector as kv_producer needs speckv_encoder_address in kv_connector_extra_config")
        if self.consumer and not self.decoder_address:
            raise ValueError("SpeckvConnector as kv_consumer needs speckv_decoder_address in kv_connector_extra_config")
        self._producer_plan = ProducerPlan(default_decoder) if self.producer else None
        self._consumer_plan = ConsumerPlan() if self.consumer else None
        if role == KVConnectorRole.WORKER:
            self._worker = _Worker(self)

    # -- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        prompt = request.prompt_token_ids or []
        if self._producer_plan is not None:
            self._producer_plan.want(request.request_id, params, prompt)
        if self._consumer_plan is not None:
            return self._consumer_plan.matched(request.request_id, params, len(prompt), num_computed_tokens)
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self._consumer_plan is not None:
            self._consumer_plan.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        plan = StepPlan()
        if self._producer_plan is not None:
            pp = self._producer_plan
            n = scheduler_output.num_scheduled_tokens
            for new in scheduler_output.scheduled_new_reqs:
                pp.scheduled(new.req_id, new.block_ids[0], new.num_computed_tokens, n.get(new.req_id, 0), True)
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                new_blocks = cached.new_block_ids[i]
                pp.scheduled(req_id, new_blocks[0] if new_blocks else None, cached.num_computed_tokens[i],
                             n.get(req_id, 0), req_id in cached.resumed_req_ids)
            plan = pp.step(set(n))
        if self._consumer_plan is not None:
            plan.loads = self._consumer_plan.step().loads
        return SpeckvMetadata(plan)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        if self._consumer_plan is not None:
            self._consumer_plan.finished(request.request_id)
        if self._producer_plan is None:
            return False, None
        ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        # NOTE: the worker copied every layer out of the blocks during the forward: none is held
        return False, self._producer_plan.finished(request.request_id, ok)

    # -- worker side ------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward: the Submits of newly scheduled requests open here,
        so both sidecars' predictors run alongside the prefill."""
        super().bind_connector_metadata(connector_metadata)
        if self.role == KVConnectorRole.WORKER and isinstance(connector_metadata, SpeckvMetadata):
            self._worker.open_new(connector_metadata.plan)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker.start(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # NOTE: loads are asynchronous: vLLM schedules the request once get_finished reports it

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_layer(self._plan(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        return  # NOTE: save_kv_layer copied the layers out; grpc's thread sends them

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker.take_received() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_errors()

    def get_kv_connector_stats(self) -> SpeckvConnectorStats | None:
        """This worker's counts since the last call (vLLM aggregates, logs and exports them)."""
        worker = getattr(self, "_worker", None)
        return worker.take_stats() if worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SpeckvConnectorStats:
        return SpeckvConnectorStats(data=data) if data is not None else SpeckvConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> SpeckvPromMetrics:
        return SpeckvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if getattr(self, "_worker", None) is not None:
            self._worker.close()

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SpeckvMetadata)
        return meta.plan


class _Worker:
    """The worker half: Submit streams out of the paged cache, fetches into it."""

    def __init__(self, conn: SpeckvConnector) -> None:
        self.conn = conn
        self.layers: list[str] = []
        self.caches: dict[str, torch.Tensor] = {}
        self.streams: dict[str, SubmitStream] = {}  # transfer id -> open Submit
        self.lock = threading.Lock()
        self._opened_for: StepPlan | None = None  # the step plan whose Submits are open
        self._layout: PagedLayout | None = None
        self.stats = SpeckvConnectorStats()
        self.received: set[str] = set()
        self.errors: set[int] = set()
        creds = _credentials()
        self.encoder = EncoderClient(conn.encoder_address, TIMEOUT_S, credentials=creds) if conn.producer else None
        self.decoder = DecoderClient(conn.decoder_address, TIMEOUT_S, credentials=creds) if conn.consumer else None
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

    def scales(self, name: str) -> np.ndarray | None:
        """An FP8 layer's (k, v) scales, as vLLM's attention layer applies them (None for BF16)."""
        if not self.fp8:
            return None
        layer = self.conn._vllm_config.compilation_config.static_forward_context[name]
        return np.array([layer._k_scale_float, layer._v_scale_float], np.float32)

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
        stream = self.encoder.open_submit(tid, shape, np.asarray(prompt, np.int64), decoder, self.conn.model_id,
                                          dtype="fp8_e4m3" if self.fp8 else "bf16", encoding=self.conn.encoding)
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
            kv = self.layout().gather(layer, s.block_ids, 0, s.num_tokens)
            try:
                stream.send_layer(i, kv.numpy() if self.fp8 else kv, self.scales(name))
            except RpcFailed:
                self.streams.pop(s.transfer_id, None)  # NOTE: its done-callback logs why

    def _fetch(self, spec: Any) -> None:
        assert self.decoder is not None
        failed: list[int] = []
        t0, raw = time.monotonic(), 0
        try:
            for i, arr, scales in self.decoder.fetch_layers(spec.transfer_id, wait=self.conn.fetch_wait_s):
                raw += arr.nbytes
                self._check_scales(i, scales)
                part = np.ascontiguousarray(arr[:, :, spec.start:spec.stop])
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


def _learn_cpu_layout(conn: SpeckvConnector, layer_name: str, head_dim: int, fp8: bool) -> PagedLayout:
    """Probe vLLM's CPU cache writer with the ISA its attention layers use."""
    from vllm import _custom_ops as ops

    layer = conn._vllm_config.compilation_config.static_forward_context.get(layer_name)
    isa = getattr(layer, "isa", None)
    cache_dtype = "fp8_e4m3" if fp8 else "auto"
    if isa is None:  # NOTE: private to vLLM: the same choice its CPU backend makes
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(torch.bfloat16, conn.block_size, head_dim, cache_dtype)

    def write(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, 1.0, 1.0, cache_dtype)

    return PagedLayout.learn(write, conn.block_size, head_dim, torch.uint8 if fp8 else torch.bfloat16)


def _layer_index(name: str) -> int:
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise ValueError(f"no layer index in the attention layer name {name!r}")
    return int(m.group(1))
