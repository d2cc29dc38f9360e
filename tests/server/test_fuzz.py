"""Fuzzing of real sidecars (a decoder and an encoder on loopback, LocalPair), driven
by hypothesis with benchmarks/fuzzing's generators (benchmarks/fuzz.py runs 10,000
inputs per target; here a few dozen): mutated and random TransferRequest streams to
DecoderService.Transfer, mutated and random SubmitRequest streams to
EncoderService.Submit, random FetchKV / GetTransferStatus / CancelTransfer requests
(odd and huge ids, odd wait times, finished and still-receiving transfers), random
bytes as serialized messages to every method path.

What must hold for every input: the call ends within its deadline with a gRPC
status other than UNKNOWN and INTERNAL; a transfer reported OK is fetchable and
bit-exact; afterwards both in-flight byte budgets are back to 0 with no transfer
left live, no sidecar logged an error, and health stays SERVING.

Hypothesis draws each input's seed (``random.Random(seed)`` drives the generators,
as in the benchmark). Each bug the fuzzer found has a regression test of its own
below.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from fuzzing import query_targets, server_targets
from fuzzing.findings import Finding
from fuzzing.server_env import MODEL, ServerEnv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speckv.client.client import DecoderClient, EncoderClient, submit_requests
from speckv.coder import container as ct
from speckv.coder.codec import Fp8KV
from speckv.v1 import decoder_pb2 as dpb

FEW = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
# NOTE: hypothesis draws a seed, not each choice: an input that hypothesis cut short
# halfway (its data exhausted) would leave a finished transfer behind, unfetched
SEED = st.integers(0, 2**64 - 1)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def env(embedded_session):
    e = ServerEnv(embedded_session.predictor, embedded_session.target, seed=1)
    yield e
    e.close()


def _code(rpc: Callable[[], object]) -> grpc.StatusCode:
    """The status an RPC ends with."""
    try:
        rpc()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _still_fine(env) -> None:
    env.check_clean()
    assert env.healthy() == {"decoder": "SERVING", "encoder": "SERVING"}


# ---------------------------------------------------------------- random runs

@pytest.mark.parametrize("name", list(server_targets.SERVER_TARGETS))
@FEW
@given(seed=SEED)
def test_target(env, name, seed):
    """decoder.transfer / .transfer_random: mutated and random Transfer streams;
    encoder.submit: mutated and random Submit streams; decoder.fetch / .query: random
    FetchKV, GetTransferStatus, CancelTransfer requests; raw.bytes: random bytes as
    the serialized requests of every method."""
    server_targets.SERVER_TARGETS[name](env, random.Random(seed))


def test_sidecars_fine_after_the_random_runs(env):
    _still_fine(env)
    assert env.live() == 0 and env.used() == (0, 0)


# ---------------------------------------------------------------- the harness can fail

class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "fake"


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
def test_harness_flags_imprecise_statuses(env, code):
    def fail():
        raise _FakeRpcError(code)
    with pytest.raises(Finding) as ei:
        env.call(fail, 5)
    assert ei.value.kind == "crash"


def test_harness_flags_calls_that_run_into_their_deadline(env):
    req = dpb.FetchKVRequest(request_id="never-arrives", wait_timeout_ms=3000)
    with pytest.raises(Finding) as ei:
        env.call(lambda: list(env.dstub.FetchKV(req, timeout=0.3)), 0.3)
    assert ei.value.kind == "hang"
    # the same call is fine when the wait was asked to outlast the deadline
    assert env.call(lambda: list(env.dstub.FetchKV(req, timeout=0.3)), 0.3, expect_timeout=True).code \
        == grpc.StatusCode.DEADLINE_EXCEEDED


def test_harness_flags_memory_not_given_back(env):
    budget = env.service("decoder").budget
    holding = env.on_loop(budget.holding)

    async def grab():
        await holding.acquire(1000)
    env.pair._run(grab(), 5)
    try:
        with pytest.raises(Finding) as ei:
            env.check_drained(timeout=0.2)
        assert ei.value.kind == "leak"
    finally:
        env.on_loop(holding.close)
    env.check_drained()


def test_harness_flags_errors_the_sidecars_log(env):
    logging.getLogger("speckv.server.decoder").error("something broke")
    with pytest.raises(Finding, match="something broke") as ei:
        env.check_clean()
    assert ei.value.kind == "crash"
    env.check_clean()  # taken: reported once


def test_harness_flags_wrong_bits_after_an_ok_transfer(env):
    rid = env.new_id("oracle")
    b = env.bases["stored-bf16"]
    assert env.transfer(env.transfer_messages(b, rid, 1 << 20)).code == grpc.StatusCode.OK
    wrong = b.bits.copy()
    wrong.reshape(-1)[7] ^= 1
    with pytest.raises(Finding) as ei:
        env.fetch_and_check(rid, wrong, None, "oracle")
    assert ei.value.kind == "corrupt"
    with pytest.raises(Finding) as ei:  # fetched once: a second fetch is refused
        env.fetch_and_check(rid, b.bits, None, "oracle")
    assert ei.value.kind == "lost"
    env.check_drained()


# ---------------------------------------------------------------- bugs the fuzzer found (fixed), one test each

GARBAGE = b"\xff\xff\xff"  # not a protobuf message: a truncated field


@pytest.mark.parametrize("method", ["Transfer", "Transfer-2nd", "FetchKV", "GetTransferStatus", "CancelTransfer",
                                    "Submit"])
def test_undecodable_request_bytes_are_invalid_argument(env, method):
    path = f"/speckv.v1.{'EncoderService' if method == 'Submit' else 'DecoderService'}/{method.split('-')[0]}"
    reqs = [GARBAGE]
    if method == "Transfer-2nd":
        hdr = env.transfer_messages(env.bases["stored-bf16"], env.new_id("garbage"), 1 << 20)[0]
        reqs = [hdr.SerializeToString(), GARBAGE]
    code = _code(lambda: env.raw_call(path, reqs, 10))
    env.check_clean()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, code


def test_corrupt_rans_payload_behind_a_valid_crc_is_data_loss(env):
    """Chunk 0 of a speckv stream with one u16 word moved from the first block that has
    words to the next block's count: every length still adds up and the crc is
    recomputed, so only the rANS decoder (or the chunk's raw digest) can tell."""
    b = env.bases["speckv-bf16"]
    h, _ = ct.unpack_header(b.header.header_record)
    c, _ = ct.unpack_chunk(b.records[0], h)
    wc = c.word_counts.copy()
    k = int(np.flatnonzero(wc[:-1])[0])
    wc[k] -= 1
    wc[k + 1] += 1
    bad = ct.pack_chunk(ct.Chunk(index=c.index, layer_start=c.layer_start, layer_count=c.layer_count,
                                 steps=c.steps, mu_fingerprint=c.mu_fingerprint, raw_digest=c.raw_digest,
                                 aux=c.aux, states=c.states, word_counts=wc, words=c.words, bits=c.bits))
    msgs = env.transfer_messages(b, env.new_id("rans"), 1 << 20, records=[bad] + b.records[1:])
    code = _code(lambda: list(env.dstub.Transfer(iter(msgs), timeout=30)))
    env.check_clean()
    assert code == grpc.StatusCode.DATA_LOSS, code


def test_cancel_transfer_ends_a_live_transfer_call(env):
    """A Transfer whose sender has sent every chunk but not the trailer is cancelled by
    CancelTransfer; its stream is then released. The call must end within seconds
    (it ends at once, or after the decoder's 2 s drain), every time."""
    b = env.bases["stored-bf16"]
    stuck = None  # the trial whose call did not end
    for trial in range(25):
        rid = env.new_id("cancel")
        msgs = env.transfer_messages(b, rid, 1 << 20)
        g = query_targets.Gated(env, msgs, len(msgs) - 1, deadline=6)
        assert g.reached.wait(10)
        deadline = time.monotonic() + 5
        while True:  # the header may still be on its way
            try:
                env.dstub.CancelTransfer(dpb.CancelTransferRequest(request_id=rid), timeout=5)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() < deadline
                time.sleep(0.001)
        g.open()
        g.thread.join(5)
        if g.thread.is_alive():
            stuck = trial
            g.thread.join(10)  # it ends at its own 6 s deadline
            break
    env.check_clean()
    assert stuck is None, f"a cancelled Transfer call did not end (trial {stuck})"


def test_fetch_ending_at_its_deadline_ends_the_live_transfer_call(env):
    """A FetchKV of a live transfer that runs into its own deadline cancels the transfer
    (layers it took are gone); the Transfer call must then end with CANCELLED, not wait
    for its deadline (the decoder once recorded the FetchKV's CancelledError as the
    transfer's error, and the woken Transfer handler took it for its own cancellation)."""
    b = env.bases["stored-bf16"]
    for after in (1, 2):  # held back after the header, or after the first chunk
        rid = env.new_id("fetch-deadline")
        g = query_targets.Gated(env, env.transfer_messages(b, rid, 1 << 20), after, deadline=8)
        assert g.reached.wait(10)
        call = query_targets.fetch(env, rid, 1000, False, deadline=0.3, expect_timeout=True)
        assert call.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert g.join(5).code == grpc.StatusCode.CANCELLED
        assert env.status(rid).responses[0].status.state == dpb.TRANSFER_STATE_CANCELLED
        env.check_clean()


def test_unusable_decoder_address_is_a_precise_error(env):
    msgs = list(submit_requests(env.new_id("addr"), env.kv_bf16, env.ids, "x:1##", MODEL, "stored"))
    code = _code(lambda: env.estub.Submit(iter(msgs), timeout=20))
    env.check_drained()
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE), code


@pytest.mark.parametrize("method", ["GetTransferStatus", "CancelTransfer", "FetchKV"])
def test_long_request_ids_get_the_decoders_answer(env, method):
    rid = "z" * 20_000
    if method == "FetchKV":
        code = _code(lambda: list(env.dstub.FetchKV(dpb.FetchKVRequest(request_id=rid, wait_timeout_ms=1),
                                                    timeout=10)))
    else:
        req = getattr(dpb, f"{method}Request")(request_id=rid)
        code = _code(lambda: getattr(env.dstub, method)(req, timeout=10))
    assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), code


@pytest.mark.parametrize("pattern", [0x7FC00000, 0xFFC12345, 0x7F800001], ids=["qnan", "qnan-payload", "snan"])
def test_fp8_nan_scales_are_refused_not_altered(env, pattern):
    """A NaN's payload cannot cross a proto float field bit-exact (Python floats quiet a
    signalling NaN), so NaN scales are refused: by the client before any call, and by
    the encoder (INVALID_ARGUMENT) when a raw stream carries one."""
    scales = env.fp8.scales.copy()
    scales.view(np.uint32)[0, 0] = pattern
    kv = Fp8KV(env.fp8.codes, scales)
    with pytest.raises(ValueError, match="NaN"):
        submit_requests(env.new_id("nan-scale"), kv, env.ids, env.daddr, MODEL, "stored")
    msgs = list(submit_requests(env.new_id("nan-scale"), env.fp8, env.ids, env.daddr, MODEL, "stored"))
    msgs[1].layer.fp8_scales[0] = float("nan")
    with pytest.raises(grpc.RpcError) as err:
        env.estub.Submit(iter(msgs), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in err.value.details()
    env.check_drained()


@pytest.mark.parametrize("pattern", [0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x3F800001],
                         ids=["inf", "-inf", "-0", "denormal", "one-ulp"])
def test_fp8_odd_scales_arrive_bit_exact(env, pattern):
    """Every scale other than NaN is delivered bit for bit (compared as fp32 bit patterns)."""
    codes, scales = env.fp8.codes, env.fp8.scales.copy()
    scales.view(np.uint32)[0, 0] = pattern
    rid = env.new_id("odd-scale")
    box: list = []
    t = threading.Thread(target=lambda: box.append(
        DecoderClient(env.daddr, channel=env.dch).fetch(rid, wait=3, timeout=30)), daemon=True)
    t.start()
    EncoderClient(env.eaddr, channel=env.ech).submit(rid, Fp8KV(codes, scales), env.ids, env.daddr, MODEL,
                                                     encoding="stored", timeout=30)
    t.join(30)
    env.check_drained()
    got = box[0]
    assert np.array_equal(got.codes, codes)
    assert np.array_equal(np.asarray(got.scales, np.float32).view(np.uint32), scales.view(np.uint32))
