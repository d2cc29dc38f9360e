"""``QueuedCuda`` (coder/cuda_queue.py): concurrent callers' encodes and decodes share a launch a pass.

The first call (run on its caller's thread: the coder is idle) is held at a gate until the other
callers have queued, so the test knows which calls share a launch; every caller must get the native
coder's outcome for its own call.
On the warp emulator everywhere, on a CUDA device where there is one."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from cuda_helpers import assert_same_streams, decode_outcome, kv_case

from speckv.coder.cuda_queue import QueuedCuda
from speckv.coder.residual import models_of

TOKENS = (17, 40, 1, 9)


def _gated(cu):
    """A QueuedCuda whose first launch waits for ``release``; (queue, entered, release)."""
    q, entered, release = QueuedCuda(cu), threading.Event(), threading.Event()
    inner = q._launch

    def launch(batch):
        if not entered.is_set():
            entered.set()
            assert release.wait(60)
        return inner(batch)

    q._launch = launch
    return q, entered, release


def _concurrently(q, entered, release, calls):
    """Runs ``calls`` (no-argument callables) on threads, the first alone in the gated launch and the
    rest queued behind it; their results or errors, in order."""
    out: list = [None] * len(calls)

    def run(i):
        try:
            out[i] = calls[i]()
        except Exception as e:  # noqa: BLE001 -- compared by the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]  # NOTE: a hang fails
    threads[0].start()
    assert entered.wait(60)
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 60
    while len(q._pending) < len(calls) - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a caller still waits"
    return out


def _cases(nat, model, epls=None):
    epls, out = epls or (16,) * len(TOKENS), []
    for i, (t, epl) in enumerate(zip(TOKENS, epls, strict=True)):
        x, mu, a, b, scales, L = kv_case(model, False, 3, t, 200 + i)
        m = nat.prepare_mu(mu, a, b, scales)
        out.append((x, m, L, [2, 1], epl, nat.encode(x, m, L, [2, 1], epl, model.tables)))
    return out


def _encodes(cu, model, cases, max_elements=None):
    """``cases`` encoded through a gated queue (the first alone, the rest queued behind it), each
    call's streams checked against the native coder's; the queue, for its launch counts."""
    q, entered, release = _gated(cu)
    q.max_elements = max_elements or q.max_elements
    got = _concurrently(q, entered, release, [
        lambda c=c: q.encode(c[0], c[1], c[2], c[3], c[4], model.tables) for c in cases])
    for c, parts in zip(cases, got, strict=True):
        assert_same_streams(parts, c[5])
    return q


@pytest.mark.gpu
def test_concurrent_encodes_share_a_launch(coders, ckpt):
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    cases = _cases(nat, model)
    q = _encodes(cu, model, cases)
    assert (q.launches, q.calls) == (2, len(cases))  # the gated one, then the rest together


@pytest.mark.gpu
def test_concurrent_decodes_each_get_their_own_outcome(coders, ckpt):
    """Four decodes in one launch after the gated one: a corrupt stream gets the native coder's error,
    a call with a wrong mu (the launch raises) its own ValueError, the others their KV."""
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    cases = _cases(nat, model) + _cases(nat, model)[:1]
    streams = [[(p.blocks, p.bits) for p in c[5]] for c in cases]
    bad = streams[2][0][0].states.copy()
    bad[0, 3] ^= 1 << 7
    streams[2][0] = (type(streams[2][0][0])(bad, streams[2][0][0].word_counts, streams[2][0][0].words),
                     streams[2][0][1])
    want = decode_outcome(nat, cases[2][1], cases[2][2], [2, 1], 16, streams[2], model.tables, cases[2][0])
    assert not want.startswith("ok")
    mus = [c[1] for c in cases]
    mus[3] = mus[3][:, :, :, :1]  # fewer values than the KV
    outs = [np.zeros_like(c[0]) for c in cases]
    q, entered, release = _gated(cu)
    got = _concurrently(q, entered, release, [
        lambda i=i, c=c: q.decode(mus[i], c[2], c[3], c[4], streams[i], model.tables, outs[i])
        for i, c in enumerate(cases)])
    assert (q.launches, q.calls) == (2, len(cases))
    assert f"{type(got[2]).__name__}: {got[2]}" == want
    assert isinstance(got[3], ValueError) and "mu" in str(got[3])
    for i in (0, 1, 4):
        assert got[i] is None and np.array_equal(outs[i], cases[i][0]), i


@pytest.mark.gpu
def test_calls_of_other_lane_lengths_launch_apart(coders, ckpt):
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    cases = _cases(nat, model, epls=(16, 16, 64, 64))
    q = _encodes(cu, model, cases)
    assert (q.launches, q.calls) == (3, 4)  # the gated one; the other at 16; the two at 64


@pytest.mark.gpu
def test_a_batch_stays_under_its_element_bound(coders, ckpt):
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    cases = _cases(nat, model)
    q = _encodes(cu, model, cases, max_elements=cases[1][0].size)  # the 40-token call fills a launch alone
    assert (q.launches, q.calls) == (3, 4)  # the gated one; the 40-token one; the 1- and 9-token ones


@pytest.mark.gpu
def test_a_codec_on_the_queue_writes_the_native_records(coders, ckpt):
    from codec_helpers import _sample_bf16, bf16_tensor, ids_for

    from speckv.coder.codec import Codec, CodecConfig

    cfg = CodecConfig(elems_per_lane=64, layers_per_chunk=4, threads=2, coder="native")
    nat, queued = Codec.from_checkpoint(ckpt, cfg), Codec.from_checkpoint(ckpt, cfg)
    queued.backend = QueuedCuda(coders[0])
    x, mu_bits = _sample_bf16(24, seed=5)
    ids, mu = ids_for(24), bf16_tensor(mu_bits)
    recs = list(queued.encode(x, ids, mu))
    assert recs == list(nat.encode(x, ids, mu))
    assert np.array_equal(queued.decode(recs, ids, mu), x)
    assert queued.backend.launches > 0


def test_the_cuda_coder_is_the_process_queue(coders, monkeypatch):
    """``--coder cuda`` gives every codec the one queue in front of the process's CUDA coder (here the
    emulated one), so concurrent transfers' calls can share launches."""
    from speckv.coder import backends
    from speckv.coder.cuda import CudaCoder

    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    monkeypatch.setattr(CudaCoder, "load", classmethod(lambda cls: coders[0]))
    monkeypatch.setattr(QueuedCuda, "_cache", None)
    a, b = backends.select_backend("cuda", 2), backends.select_backend("cuda", 2)
    assert isinstance(a, QueuedCuda) and a is b and a.coder is coders[0] and backends.backend_name(a) == "cuda"


@pytest.mark.gpu
def test_a_call_that_fits_past_one_that_does_not(coders, ckpt):
    """The queue takes a later call that fits past an earlier one that does not (17 tokens, then 40
    left for the next launch, then 1): every call ends with its own streams."""
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    cases = _cases(nat, model)
    order = [cases[3], cases[0], cases[1], cases[2]]  # 9 tokens gated; then 17, 40, 1 queued
    q = _encodes(cu, model, order, max_elements=cases[0][0].size + cases[2][0].size)
    assert (q.launches, q.calls) == (3, 4)  # the gated one; the 17- and 1-token ones; the 40-token one


def test_a_worker_that_dies_fails_its_calls_and_the_next_call_starts_another(coders, ckpt):
    """Nothing may leave a caller waiting: a worker killed by an error outside any launch fails the
    calls queued for it; the next calls run (inline, and queued for a fresh worker). A copy of the
    queue (made without __init__) reads the coder's attributes without recursing."""
    import copy

    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    cases = _cases(nat, model)[:2]
    q, entered, release = _gated(cu)
    real, q._take = q._take, lambda: (_ for _ in ()).throw(SystemError("worker broke"))
    got = _concurrently(q, entered, release, [
        lambda c=c: q.encode(c[0], c[1], c[2], c[3], c[4], model.tables) for c in cases])
    assert_same_streams(got[0], cases[0][5])  # the inline call
    assert isinstance(got[1], SystemError) and q._worker is None and not q._pending
    q._take = real
    q2, entered, release = _gated(cu)
    got = _concurrently(q2, entered, release, [
        lambda c=c: q2.encode(c[0], c[1], c[2], c[3], c[4], model.tables) for c in cases])
    for c, parts in zip(cases, got, strict=True):
        assert_same_streams(parts, c[5])
    assert copy.copy(q).prepare_mu == cu.prepare_mu


@pytest.mark.gpu
def test_a_lone_call_runs_on_its_callers_thread(coders, ckpt):
    """An idle coder runs a call at once on its caller's thread: no worker, no hand-off."""
    cu, nat, _ = coders
    model = models_of(ckpt)[2]
    c = _cases(nat, model)[2]
    q, ran_on = QueuedCuda(cu), []
    inner = q._launch
    q._launch = lambda batch: ran_on.append(threading.current_thread()) or inner(batch)
    for _ in range(2):
        assert_same_streams(q.encode(c[0], c[1], c[2], c[3], c[4], model.tables), c[5])
    assert ran_on == [threading.current_thread()] * 2 and q._worker is None and (q.launches, q.calls) == (2, 2)
