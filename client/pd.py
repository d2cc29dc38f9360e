"""The prefill/decode hand-off plan of the vLLM connector: which request's KV goes
where and when, kept by the scheduler and handed to the workers each step.

Free of vLLM and torch, so its logic is tested without either (tests/client/test_pd.py);
``speckv.client.vllm`` feeds it vLLM's scheduler objects.

Protocol (the keys of vLLM's ``kv_transfer_params``; the ``do_remote_*`` pair is
vLLM's own, as NixlConnector and vLLM's disaggregated proxies use it):

- prefill request: ``{"do_remote_decode": true}``, and optionally
  ``"speckv_decoder_address"`` (the decoder sidecar of the decode instance the router
  chose; else the connector's configured one) and ``"speckv_transfer_id"`` (else one
  is made). The producer opens the Submit when the request is first scheduled, so both
  sidecars start their predictors while the prefill runs, and streams every layer on the
  step that computes the prompt's last token.
- the prefill's output carries ``{"do_remote_prefill": true, "speckv_transfer_id": ...,
  "speckv_decoder_address": ...}``: the router passes it on with the decode request,
  whose connector fetches the KV from its own decoder sidecar.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from speckv.kv import HeadRange

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
TRANSFER_ID = "speckv_transfer_id"
DECODER_ADDRESS = "speckv_decoder_address"


@dataclass
class SaveSpec:
    """Producer: one request's KV, streamed to the encoder sidecar."""

    req_id: str
    transfer_id: str
    decoder_address: str
    num_tokens: int  # the prompt's tokens: the KV sent
    block_ids: list[int]  # the request's blocks, in token order
    prompt_token_ids: list[int] | None = None  # set on the step that opens the Submit
    complete: bool = False  # this step computes the prompt's last token: send every layer


@dataclass
class LoadSpec:
    """Consumer: one request's KV, fetched from the decoder sidecar into its blocks."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    start: int  # first token loaded (tokens before it were a local prefix-cache hit)
    stop: int  # one past the last token loaded


@dataclass
class StepPlan:
    """What the workers do this step (vLLM's connector metadata carries it)."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # transfer ids whose Submit must end


@dataclass
class _Save:
    spec: SaveSpec
    opened: bool = False
    sent: bool = False


class ProducerPlan:
    """The prefill side: tracks requests asked to hand their KV off (``do_remote_decode``)."""

    def __init__(self, default_decoder: str | None, make_id: Callable[[], str] = lambda: uuid.uuid4().hex) -> None:
        self.default_decoder = default_decoder
        self.make_id = make_id
        self._reqs: dict[str, _Save] = {}
        self._cancels: list[str] = []

    def want(self, req_id: str, params: Mapping[str, Any] | None, prompt_token_ids: Sequence[int]) -> bool:
        """Note a new request (idempotent); True when its KV is to be handed off."""
        if req_id in self._reqs:
            return True
        if not params or not params.get(DO_REMOTE_DECODE):
            return False
        decoder = params.get(DECODER_ADDRESS) or self.default_decoder
        if not decoder:
            raise ValueError(f"request {req_id} asks for a remote decode, but names no {DECODER_ADDRESS} and the "
                             "connector has no speckv_decoder_service configured")
        tid = str(params.get(TRANSFER_ID) or self.make_id())
        spec = SaveSpec(req_id, tid, str(decoder), len(prompt_token_ids), [], [int(t) for t in prompt_token_ids])
        self._reqs[req_id] = _Save(spec)
        return True

    def scheduled(self, req_id: str, block_ids: Sequence[int] | None, num_computed: int, num_scheduled: int,
                  replace_blocks: bool) -> None:
        """A step schedules ``num_scheduled`` tokens of a tracked request after ``num_computed``;
        ``block_ids`` are its new blocks (``replace_blocks``: all of them, as after a preemption)."""
        r = self._reqs.get(req_id)
        if r is None or r.sent:
            return
        if replace_blocks:
            r.spec.block_ids = []
        r.spec.block_ids.extend(int(b) for b in block_ids or ())
        r.spec.complete = num_computed + num_scheduled >= r.spec.num_tokens

    def step(self, scheduled: set[str]) -> StepPlan:
        """The saves of this step: every tracked request scheduled in it, opening its
        Submit on the first and sending its layers on the one that completes the prompt."""
        plan = StepPlan(cancels=self._cancels)
        self._cancels = []
        for req_id in scheduled:
            r = self._reqs.get(req_id)
            if r is None or r.sent:
                continue
            s = r.spec
            plan.saves.append(SaveSpec(s.req_id, s.transfer_id, s.decoder_address, s.num_tokens, list(s.block_ids),
                                       None if r.opened else s.prompt_token_ids, s.complete))
            r.opened = True
            r.sent = s.complete
        return plan

    def finished(self, req_id: str, ok: bool) -> dict[str, Any] | None:
        """The kv_transfer_params of a finished request (None when it was not handed off).
        A request that ends before its KV was sent (``ok`` False: aborted, or stopped
        early) has its Submit cancelled on the next step."""
        r = self._reqs.pop(req_id, None)
        if r is None:
            return None
        if not (ok and r.sent):
            if r.opened:
                self._cancels.append(r.spec.transfer_id)
            return None
        return {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, TRANSFER_ID: r.spec.transfer_id,
                DECODER_ADDRESS: r.spec.decoder_address}


class ConsumerPlan:
    """The decode side: requests whose prompt KV is fetched from the decoder sidecar."""

    def __init__(self) -> None:
        self._pending: dict[str, LoadSpec] = {}
        self._loads: list[LoadSpec] = []
        self._handled: set[str] = set()

    def matched(self, req_id: str, params: Mapping[str, Any] | None, num_prompt: int,
                num_computed: int) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``: every prompt token past the local hit
        loads asynchronously (vLLM recomputes the last one for its logits)."""
        if req_id in self._handled or not params or not params.get(DO_REMOTE_PREFILL):
            return 0, False
        tid = params.get(TRANSFER_ID)
        if not tid or num_prompt - num_computed <= 0:
            return 0, False
        self._pending[req_id] = LoadSpec(req_id, str(tid), [], num_computed, num_prompt)
        return num_prompt - num_computed, True

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM's ``update_state_after_alloc``: the blocks the KV lands in."""
        spec = self._pending.pop(req_id, None)
        if spec is None or num_external <= 0:
            return
        spec.block_ids = [int(b) for b in block_ids]
        spec.stop = spec.start + num_external
        self._loads.append(spec)
        self._handled.add(req_id)  # NOTE: one transfer per request, as vLLM's own connectors

    def step(self) -> StepPlan:
        plan = StepPlan(loads=self._loads)
        self._loads = []
        return plan

    def finished(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._handled.discard(req_id)


def block_span(block_ids: Sequence[int], block_size: int, start: int, stop: int) -> list[int]:
    """The blocks holding tokens [start, stop)."""
    if stop <= start:
        return []
    return list(block_ids[start // block_size:(stop - 1) // block_size + 1])


def rank_heads(ranks: int, total: int, worker: bool) -> HeadRange | None:
    """This worker's KV heads under tensor parallelism (None: one rank, all heads; the
    scheduler has none). Replicated heads (more ranks than heads) are refused: a head would
    be sent twice and fetched by two ranks."""
    if ranks == 1:
        return None
    if ranks > total or total % ranks:
        raise NotImplementedError(f"SpeckvConnector splits {total} KV heads over {ranks} tensor-parallel ranks "
                                  "only when they divide evenly, without replicated heads")
    if not worker:
        return None
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return HeadRange.of_rank(get_tensor_model_parallel_rank(), ranks, total)
