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
sidecar has not heard of yet; 30 s. ``speckv_local_socket``, else the variable
SPECKV_LOCAL_SOCKET: the local socket of this engine's sidecar on this host. A producer
hands each layer to the encoder as a sealed memfd (``speckv.client.local``), not as bytes
on the Submit stream; a refused hand-off fails that request's submit like any other
submit error: logged, counted in ``send_failed``, the decode side recomputes. A consumer
(not also a producer) fetches each transfer from the decoder as one sealed memfd; a
refused fetch fails like any other fetch.)

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

Tensor parallelism: each rank's worker submits its own KV heads under the request's one
transfer id (``SubmitHeader.heads``), and each decode rank fetches its heads, whatever
the prefill engine's tensor-parallel size (the decoder assembles or slices the ranges).

Not supported yet (each refused with a clear error, never a wrong KV): GPU attention
backends' paged layouts (``speckv.client.paged``), pipeline parallelism, more
tensor-parallel ranks than KV heads (replicated heads), FP8 e5m2 KV caches. FP8 e4m3 caches move as codes with
their per-layer (k, v) scales; the decode engine refuses scales unlike its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from .pd import ConsumerPlan, ProducerPlan, StepPlan, rank_heads
from .vllm_stats import SpeckvConnectorStats, SpeckvPromMetrics
from .vllm_worker import FETCH_WAIT_S, Worker, local_socket

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class SpeckvMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


class SpeckvConnector(KVConnectorBase_V1):
    """vLLM KV connector: prefill hands off through speckv's sidecars, decode fetches."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size > 1:
            raise NotImplementedError("SpeckvConnector supports pipeline parallel size 1")
        tp = par.tensor_parallel_size
        self.head_range = None if tp == 1 else rank_heads(tp, vllm_config.model_config.get_total_num_kv_heads(),
                                                          role == KVConnectorRole.WORKER)
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
        self.local_socket = local_socket(get)
        if self.producer and not self.encoder_address:
            raise ValueError("SpeckvConnector as kv_producer needs speckv_encoder_address in kv_connector_extra_config")
        if self.consumer and not self.decoder_address:
            raise ValueError("SpeckvConnector as kv_consumer needs speckv_decoder_address in kv_connector_extra_config")
        self._producer_plan = ProducerPlan(default_decoder) if self.producer else None
        self._consumer_plan = ConsumerPlan() if self.consumer else None
        if role == KVConnectorRole.WORKER:
            self._worker = Worker(self)

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
