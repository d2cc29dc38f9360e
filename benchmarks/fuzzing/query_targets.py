"""The request/reply targets of the decoder: random FetchKV, GetTransferStatus and
CancelTransfer requests (odd and huge ids, odd wait times) on unknown ids, on
finished transfers, and on live ones (a Transfer whose stream is held back)."""

from __future__ import annotations

import random
import threading
from typing import Callable, Iterator

import grpc

from speckv.client.core import _Collector
from speckv.errors import RpcFailed
from speckv.v1 import decoder_pb2 as dpb

from .coder_env import same_kv
from .findings import Finding
from .mutate import odd_string
from .server_env import Call, ServerEnv, TBase

OK = grpc.StatusCode.OK
STORED = ("stored-bf16", "stored-fp8")


def stored_transfer(env: ServerEnv, rng: random.Random, rid: str) -> TBase:
    """A valid stored transfer under ``rid``, complete (not fetched)."""
    b = env.bases[rng.choice(STORED)]
    call = env.transfer(env.transfer_messages(b, rid, 1 << 20))
    if call.code != OK:
        raise Finding("crash", f"a valid stored transfer failed: {call.code.name} {call.details[:100]}")
    return b


class Gated:
    """A Transfer in a thread whose stream stops after ``after`` messages until ``open()``
    (or 20 s, when it ends the stream)."""

    def __init__(self, env: ServerEnv, msgs: list, after: int, deadline: float = 10.0) -> None:
        self.msgs, self.after = msgs, after
        self.gate, self.reached = threading.Event(), threading.Event()
        self.result: list = []
        self.thread = threading.Thread(target=self._run, args=(env, deadline), daemon=True)
        self.thread.start()

    def _iter(self) -> Iterator[dpb.TransferRequest]:
        for k, m in enumerate(self.msgs):
            if k == self.after:
                self.reached.set()
                if not self.gate.wait(20):
                    return
            yield m
        self.reached.set()

    def _run(self, env: ServerEnv, deadline: float) -> None:
        try:
            self.result.append(env.transfer(self._iter(), deadline))
        except Finding as f:
            self.result.append(f)

    def open(self) -> None:
        """Let the rest of the stream go."""
        self.gate.set()

    def join(self, timeout: float, what: str = "") -> Call:
        """Release the stream and wait up to ``timeout`` s for the call to end."""
        self.open()
        self.thread.join(timeout)
        if self.thread.is_alive():  # left to end at its own deadline, in the background
            raise Finding("hang", f"a live Transfer did not end within {timeout} s of its stream's release{what}")
        res = self.result[0]
        if isinstance(res, Finding):
            raise res
        return res


def live_transfer(env: ServerEnv, rng: random.Random, ops: Callable[[str, TBase], bool]) -> None:
    """Run ``ops(rid, base)`` against a transfer that is still receiving (its stream held
    back after a random message). ``ops`` returns True when it called CancelTransfer: then
    the Transfer call must end with CANCELLED within seconds of the stream's release."""
    b = env.bases[rng.choice(STORED)]
    rid = env.new_id("live")
    msgs = env.transfer_messages(b, rid, rng.choice((1 << 20, 4096)))
    g = Gated(env, msgs, rng.randint(1, len(msgs) - 1))
    if not g.reached.wait(10):
        g.join(30)
        raise Finding("hang", "a gated Transfer never reached its gate")
    try:
        cancelled = ops(rid, b)
    except BaseException:
        g.open()  # a finding in ops: end this transfer, so it does not spill into the next input
        g.thread.join(20)
        raise
    # NOTE: released at once: the decoder reads (and drops) what is still sent after its
    # verdict for up to 2 s (DRAIN_S) before it ends the call; a call that still has not
    # ended 5 s after that is stuck
    call = g.join(5 if cancelled else 20, " (after CancelTransfer)" if cancelled else "")
    if cancelled and call.code != grpc.StatusCode.CANCELLED:
        raise Finding("crash", f"{rid!r}: CancelTransfer ended the live Transfer with {call.code.name}, not CANCELLED")
    if call.code == OK:  # nothing ended it: it must still be exact
        st = env.status(rid)
        if st.code == OK and st.responses[0].status.state == dpb.TRANSFER_STATE_READY:
            env.consume(rid, b.bits, b.scales, "live transfer", rng)


def wait_ms(rng: random.Random) -> int:
    """A FetchKV wait: mostly a few ms, sometimes the server's default (0), rarely huge."""
    r = rng.random()
    if r < 0.05:
        return 0
    if r < 0.9:
        return rng.randint(1, 5)
    if r < 0.98:
        return rng.randint(10, 100)
    return rng.choice((10_000, 2**32 - 1))


def fetch(env: ServerEnv, rid: str, wait: int, verified_only: bool, deadline: float | None = None,
          expect_timeout: bool | None = None) -> Call:
    """A raw FetchKV. For an unknown id the server answers NOT_FOUND after the wait; a wait
    longer than the deadline ends at the deadline (expected)."""
    w = env.fetch_wait(wait)
    if deadline is None:
        deadline = 0.3 if w > 1 else max(2.0, 4 * w + 1)
    if expect_timeout is None:
        expect_timeout = w >= deadline
    req = dpb.FetchKVRequest(request_id=rid, wait_timeout_ms=wait, verified_only=verified_only)
    return env.call(lambda: list(env.dstub.FetchKV(req, timeout=deadline)), deadline, expect_timeout=expect_timeout)


def check_fetched(rid: str, call: Call, b: TBase) -> None:
    """A FetchKV of a finished transfer must succeed and carry exactly ``b``'s KV."""
    if call.code != OK:
        raise Finding("lost", f"{rid!r}: FetchKV of a finished transfer failed: {call.code.name} {call.details[:100]}")
    col = _Collector()
    try:
        for msg in call.responses:
            got = col.add(msg)
            if got is not None:
                col.keep(*got)
        out = col.result(False)
    except RpcFailed as e:
        raise Finding("corrupt", f"{rid!r}: FetchKV stream rejected by the client: {e}") from None
    if not same_kv(out, b.bits, b.scales):
        raise Finding("corrupt", f"{rid!r}: FetchKV returned other bits")


def t_decoder_fetch(env: ServerEnv, rng: random.Random) -> str:
    """Random FetchKV requests: odd ids and wait times, finished and live transfers."""
    r = rng.random()
    if r < 0.1:  # a finished transfer: fetched with random parameters, then again
        rid = env.new_id("fe")
        b = stored_transfer(env, rng, rid)
        call = fetch(env, rid, rng.choice((0, 1, 1000, 2**32 - 1)), rng.random() < 0.5, deadline=20,
                     expect_timeout=False)
        check_fetched(rid, call, b)
        outcome = "again:" + fetch(env, rid, wait_ms(rng), rng.random() < 0.5).code.name
    elif r < 0.13:  # a live transfer: FetchKV waits for layers that do not come until its deadline
        codes = []

        def ops(rid: str, b: TBase) -> bool:
            codes.append(fetch(env, rid, rng.randint(0, 50), rng.random() < 0.5, deadline=0.2,
                               expect_timeout=True).code.name)
            return False
        live_transfer(env, rng, ops)
        outcome = "live:" + codes[0]
    else:
        rid = odd_string(rng) if rng.random() < 0.7 else env.new_id("nope")
        outcome = fetch(env, rid, wait_ms(rng), rng.random() < 0.5).code.name
    env.check_clean()
    return outcome


def _query_finished(env: ServerEnv, rng: random.Random) -> str:
    """Status, cancel and fetch of a finished transfer, in a random order; then it is
    cancelled (it must not stay live)."""
    rid = env.new_id("q")
    stored_transfer(env, rng, rid)
    outs = []
    for op in rng.sample(["status", "cancel", "cancel", "fetch"], rng.randint(1, 4)):
        if op == "fetch":
            # NOTE: a short wait: FetchKV waits it out on a cancelled transfer (a retry may replace it)
            outs.append(fetch(env, rid, 50, False, deadline=20, expect_timeout=False).code.name)
        else:
            outs.append((env.status if op == "status" else env.cancel)(rid).code.name)
    c = env.cancel(rid)  # whatever happened, end it
    if c.code == OK and c.responses[0].status.state in (dpb.TRANSFER_STATE_RECEIVING, dpb.TRANSFER_STATE_READY):
        raise Finding("crash", f"{rid!r}: CancelTransfer left the transfer live")
    return "/".join(outs)


def _query_live(env: ServerEnv, rng: random.Random) -> str:
    """Status of a live transfer (it must be RECEIVING), then (mostly) its cancellation."""
    codes = []

    def ops(rid: str, b: TBase) -> bool:
        st = env.status(rid)
        codes.append(st.code.name)
        if st.code == OK and st.responses[0].status.state != dpb.TRANSFER_STATE_RECEIVING:
            state = dpb.TransferState.Name(st.responses[0].status.state)
            raise Finding("crash", f"{rid!r}: a transfer held back mid-stream is {state}")
        if rng.random() < 0.7:
            c = env.cancel(rid)
            codes.append(c.code.name)
            return c.code == OK
        return False
    live_transfer(env, rng, ops)
    return "live:" + "/".join(codes)


def t_decoder_query(env: ServerEnv, rng: random.Random) -> str:
    """Random GetTransferStatus / CancelTransfer, on unknown ids and on real transfers."""
    r = rng.random()
    if r < 0.1:
        outcome = _query_finished(env, rng)
    elif r < 0.13:
        outcome = _query_live(env, rng)
    else:
        rid = odd_string(rng) if rng.random() < 0.8 else env.new_id("nope")
        outcome = (env.status if rng.random() < 0.5 else env.cancel)(rid).code.name
    env.check_clean()
    return outcome
