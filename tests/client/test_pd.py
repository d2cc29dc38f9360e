"""The vLLM connector's hand-off plan, without vLLM or torch: which prefill requests
open a Submit and when their layers go (ProducerPlan), which decode requests fetch
into which blocks (ConsumerPlan), the kv_transfer_params each side hands the other,
cancellation of a Submit whose request ends early, and block_span."""
from __future__ import annotations

import itertools

import pytest

from speckv.client.pd import (
    DECODER_ADDRESS,
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    TRANSFER_ID,
    ConsumerPlan,
    LoadSpec,
    ProducerPlan,
    SaveSpec,
    block_span,
)

PROMPT = list(range(100, 110))  # 10 tokens
REMOTE = {DO_REMOTE_DECODE: True}


def _producer(default: str | None = "dec:1") -> ProducerPlan:
    ids = itertools.count()
    return ProducerPlan(default, make_id=lambda: f"t{next(ids)}")


# -- ProducerPlan ------------------------------------------------------------------

@pytest.mark.parametrize("params", [None, {}, {DO_REMOTE_DECODE: False}, {DO_REMOTE_PREFILL: True}])
def test_producer_ignores_requests_not_handed_off(params):
    pp = _producer()
    assert pp.want("r", params, PROMPT) is False
    pp.scheduled("r", [1], 0, len(PROMPT), True)
    plan = pp.step({"r"})
    assert (plan.saves, plan.loads, plan.cancels) == ([], [], [])
    assert pp.finished("r", True) is None


def test_producer_one_step_prefill():
    pp = _producer()
    assert pp.want("r", REMOTE, PROMPT) is True
    pp.scheduled("r", [7, 3], 0, len(PROMPT), True)
    plan = pp.step({"r"})
    assert plan.saves == [SaveSpec("r", "t0", "dec:1", 10, [7, 3], PROMPT, True)]
    assert plan.cancels == []
    pp.scheduled("r", None, 10, 1, False)  # its first decode step: nothing more to send
    assert pp.step({"r"}).saves == []
    assert pp.finished("r", True) == {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, TRANSFER_ID: "t0",
                                      DECODER_ADDRESS: "dec:1"}
    assert pp.finished("r", True) is None  # forgotten
    assert pp.step({"r"}).cancels == []


def test_producer_chunked_prefill_opens_first_and_sends_on_the_last_chunk():
    pp = _producer()
    pp.want("r", REMOTE, PROMPT)
    pp.scheduled("r", [5], 0, 4, True)
    first = pp.step({"r"}).saves
    assert first == [SaveSpec("r", "t0", "dec:1", 10, [5], PROMPT, False)]  # opens the Submit
    pp.scheduled("r", [6], 4, 4, False)
    assert pp.step({"r"}).saves == [SaveSpec("r", "t0", "dec:1", 10, [5, 6], None, False)]
    pp.scheduled("r", [9], 8, 2, False)
    assert pp.step({"r"}).saves == [SaveSpec("r", "t0", "dec:1", 10, [5, 6, 9], None, True)]
    assert first[0].block_ids == [5]  # each step's spec is its own copy
    pp.scheduled("r", [11], 10, 1, False)  # decoding: the request's blocks no longer matter
    assert pp.step({"r"}).saves == []
    assert pp.finished("r", True)[TRANSFER_ID] == "t0"


def test_producer_only_scheduled_requests_save():
    pp = _producer()
    pp.want("a", REMOTE, PROMPT)
    pp.want("b", REMOTE, PROMPT[:3])
    pp.scheduled("a", [1], 0, 10, True)
    pp.scheduled("b", [2], 0, 3, True)
    assert [s.req_id for s in pp.step({"b", "c"}).saves] == ["b"]
    saves = pp.step({"a"}).saves
    assert saves == [SaveSpec("a", "t0", "dec:1", 10, [1], PROMPT, True)]


def test_producer_preemption_replaces_the_blocks():
    pp = _producer()
    pp.want("r", REMOTE, PROMPT)
    pp.scheduled("r", [1, 2], 0, 6, True)
    assert pp.step({"r"}).saves[0].block_ids == [1, 2]
    pp.scheduled("r", [8, 9], 0, 10, True)  # resumed after a preemption: recomputed in new blocks
    assert pp.step({"r"}).saves == [SaveSpec("r", "t0", "dec:1", 10, [8, 9], None, True)]


def test_producer_want_is_idempotent():
    calls = []
    pp = ProducerPlan("dec:1", make_id=lambda: calls.append(1) or f"t{len(calls)}")
    assert pp.want("r", REMOTE, PROMPT) is True
    pp.scheduled("r", [1], 0, 4, True)
    assert pp.want("r", REMOTE, PROMPT) is True  # asked again while waiting: nothing reset
    assert pp.want("r", None, PROMPT) is True
    assert calls == [1]
    assert pp.step({"r"}).saves == [SaveSpec("r", "t1", "dec:1", 10, [1], PROMPT, False)]


def test_producer_addresses_and_ids():
    pp = _producer(default=None)
    pp.want("a", {**REMOTE, DECODER_ADDRESS: "10.0.0.7:50052", TRANSFER_ID: "mine"}, PROMPT)
    pp.scheduled("a", [0], 0, 10, True)
    assert pp.step({"a"}).saves == [SaveSpec("a", "mine", "10.0.0.7:50052", 10, [0], PROMPT, True)]
    with pytest.raises(ValueError, match=DECODER_ADDRESS):
        pp.want("b", REMOTE, PROMPT)  # no address and no default
    assert pp.step({"b"}).saves == []

    pp = _producer(default="dec:1")
    pp.want("c", {**REMOTE, DECODER_ADDRESS: "dec:2"}, PROMPT)
    pp.want("d", REMOTE, PROMPT)
    pp.scheduled("c", [], 0, 10, True)
    pp.scheduled("d", [], 0, 10, True)
    got = {s.req_id: (s.transfer_id, s.decoder_address) for s in pp.step({"c", "d"}).saves}
    assert got == {"c": ("t0", "dec:2"), "d": ("t1", "dec:1")}


def test_producer_request_ending_before_its_kv_went_cancels_its_submit():
    pp = _producer()
    pp.want("r", REMOTE, PROMPT)
    pp.scheduled("r", [1], 0, 4, True)
    pp.step({"r"})  # opened, not sent
    assert pp.finished("r", False) is None
    assert pp.step(set()).cancels == ["t0"]
    assert pp.step(set()).cancels == []  # once


@pytest.mark.parametrize("ok", [True, False])
def test_producer_request_ending_before_its_submit_opened_cancels_nothing(ok):
    pp = _producer()
    pp.want("r", REMOTE, PROMPT)
    pp.scheduled("r", [1], 0, 10, True)  # never in a step's plan
    assert pp.finished("r", ok) is None
    assert pp.step({"r"}).saves == []
    assert pp.step(set()).cancels == []


def test_producer_aborted_after_sending_hands_nothing_on_and_cancels_its_submit():
    pp = _producer()
    pp.want("r", REMOTE, PROMPT)
    pp.scheduled("r", [1], 0, 10, True)
    assert pp.step({"r"}).saves[0].complete
    assert pp.finished("r", False) is None  # no decode request will fetch it: a Submit still going ends
    assert pp.step(set()).cancels == ["t0"]


def test_producer_ignores_untracked_requests():
    pp = _producer()
    pp.scheduled("x", [1], 0, 10, True)
    assert pp.step({"x"}).saves == []
    assert pp.finished("x", True) is None


# -- ConsumerPlan ------------------------------------------------------------------

REMOTE_PREFILL = {DO_REMOTE_PREFILL: True, TRANSFER_ID: "t9", DECODER_ADDRESS: "dec:1"}


@pytest.mark.parametrize("params", [None, {}, {DO_REMOTE_PREFILL: False, TRANSFER_ID: "t9"},
                                    {DO_REMOTE_PREFILL: True}, {DO_REMOTE_PREFILL: True, TRANSFER_ID: ""},
                                    {DO_REMOTE_DECODE: True}])
def test_consumer_loads_only_remote_prefills_with_a_transfer_id(params):
    cp = ConsumerPlan()
    assert cp.matched("r", params, 10, 0) == (0, False)
    cp.allocated("r", [1], 10)
    assert cp.step().loads == []


def test_consumer_loads_every_token_past_the_local_hit():
    cp = ConsumerPlan()
    assert cp.matched("r", REMOTE_PREFILL, 10, 4) == (6, True)
    assert cp.step().loads == []  # nothing before the blocks are allocated
    cp.allocated("r", [3, 8, 2], 6)
    assert cp.step().loads == [LoadSpec("r", "t9", [3, 8, 2], 4, 10)]
    assert cp.step().loads == []


def test_consumer_load_stops_at_the_allocated_tokens():
    cp = ConsumerPlan()
    assert cp.matched("r", REMOTE_PREFILL, 10, 0) == (10, True)
    cp.allocated("r", [3, 8], 7)
    assert cp.step().loads == [LoadSpec("r", "t9", [3, 8], 0, 7)]


def test_consumer_nothing_to_load():
    cp = ConsumerPlan()
    assert cp.matched("r", REMOTE_PREFILL, 10, 10) == (0, False)  # a whole local hit
    cp.allocated("r", [1], 0)
    assert cp.matched("s", REMOTE_PREFILL, 10, 0) == (10, True)
    cp.allocated("s", [1], 0)  # vLLM loads nothing after all
    assert cp.step().loads == []


def test_consumer_one_transfer_per_request():
    cp = ConsumerPlan()
    assert cp.matched("r", REMOTE_PREFILL, 10, 0) == (10, True)
    cp.allocated("r", [1], 10)
    assert len(cp.step().loads) == 1
    assert cp.matched("r", REMOTE_PREFILL, 10, 0) == (0, False)  # e.g. preempted: recomputed locally
    cp.allocated("r", [2], 10)
    assert cp.step().loads == []
    cp.finished("r")
    assert cp.matched("r", REMOTE_PREFILL, 10, 0) == (10, True)  # the id is free again


def test_consumer_matched_again_before_allocation_keeps_the_latest():
    cp = ConsumerPlan()
    assert cp.matched("r", REMOTE_PREFILL, 10, 0) == (10, True)
    assert cp.matched("r", REMOTE_PREFILL, 10, 2) == (8, True)  # no blocks last time; a prefix hit now
    cp.allocated("r", [4], 8)
    assert cp.step().loads == [LoadSpec("r", "t9", [4], 2, 10)]


def test_consumer_finished_before_allocation_loads_nothing():
    cp = ConsumerPlan()
    cp.matched("r", REMOTE_PREFILL, 10, 0)
    cp.finished("r")
    cp.allocated("r", [1], 10)
    assert cp.step().loads == []
    cp.allocated("never-matched", [1], 10)
    assert cp.step().loads == []


# -- block_span --------------------------------------------------------------------

@pytest.mark.parametrize("start, stop, want", [
    (0, 16, [10, 11, 12, 13]),
    (0, 1, [10]),
    (3, 4, [10]),
    (3, 5, [10, 11]),
    (4, 8, [11]),
    (4, 9, [11, 12]),
    (7, 13, [11, 12, 13]),
    (15, 16, [13]),
    (5, 5, []),
    (9, 3, []),
])
def test_block_span(start, stop, want):
    assert block_span([10, 11, 12, 13], 4, start, stop) == want
