"""server/batcher.py: what queues during a pass runs as the next pass (first come first
served, up to max_tokens, at least one prompt); each future ends with its own prompt's
outcome; the worker thread exists only while there is work. With a real runtime,
concurrent transfers' mu is their lone passes' bit for bit, and passes were shared."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from speckv.predictor.calibrate import build_checkpoint
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.predict import Predictor
from speckv.server.batcher import PredictorBatcher
from speckv.server.config import ServerConfig
from speckv.server.metrics import Metrics
from speckv.server.runtime import Runtime


class Recording:
    """A predictor stand-in: records each pass's prompt lengths; the first pass waits on a gate."""

    def __init__(self) -> None:
        self.passes: list[list[int]] = []
        self.gate, self.entered = threading.Event(), threading.Event()

    def stream_batch(self, reqs):
        if not self.passes:
            self.entered.set()
            assert self.gate.wait(30)
        self.passes.append([len(ids) for ids, _, _ in reqs])
        out = []
        for ids, on_layer, _ in reqs:
            on_layer(0, np.zeros(1, np.uint16))
            out.append(ValueError(f"bad prompt of {len(ids)}") if len(ids) == 13 else None)
        return out


def workers() -> int:
    return sum(t.name == "speckv-predictor" for t in threading.enumerate())


def test_queued_prompts_share_the_next_pass_up_to_max_tokens():
    rec = Recording()
    b = PredictorBatcher(rec, max_tokens=100)
    metrics = Metrics("decoder", "m", registry=CollectorRegistry())
    b.on_pass = metrics.predictor_pass
    first = b.submit(np.zeros(5), lambda i, x: None)
    assert rec.entered.wait(30)
    futs = [b.submit(np.zeros(n), lambda i, x: None) for n in (40, 13, 50, 200, 7)]  # queued during pass 1
    rec.gate.set()
    for f in [first, *futs]:
        f.exception(30)
    # FIFO: 40 + 13 fit, + 50 would pass 100; then 50 (+ 200 would pass); 200 alone (over the cap, still
    # served); 7
    assert rec.passes == [[5], [40, 13], [50], [200], [7]]
    assert isinstance(futs[1].exception(), ValueError)  # the 13-token prompt's own error
    assert all(f.exception() is None for f in (first, futs[0], *futs[2:]))
    assert (b.passes, b.prompts) == (5, 6)
    sample = metrics.registry.get_sample_value
    labels = {"role": "decoder", "model": "m"}
    assert sample("speckv_predictor_pass_prompts_count", labels) == 5
    assert sample("speckv_predictor_pass_prompts_sum", labels) == 6
    assert sample("speckv_predictor_pass_prompts_bucket", {**labels, "le": "1.0"}) == 4
    assert sample("speckv_peak_resident_bytes", labels) >= 100 << 20  # this process's VmHWM
    for _ in range(100):  # the worker ends with the queue
        if not workers():
            break
        threading.Event().wait(0.05)
    assert workers() == 0


def test_a_batched_pass_is_marked_running():
    from speckv import heap

    seen: list[int] = []

    class Counting(Recording):
        def stream_batch(self, reqs):
            seen.append(heap.passes_running())
            return super().stream_batch(reqs)

    rec = Counting()
    rec.gate.set()
    assert PredictorBatcher(rec).submit(np.zeros(3), lambda i, x: None).result(30) is None
    assert seen == [1] and heap.passes_running() == 0


def test_cancelled_prompts_are_skipped_and_a_broken_hook_fails_only_its_pass():
    rec = Recording()
    b = PredictorBatcher(rec)
    first = b.submit(np.zeros(5), lambda i, x: None)
    assert rec.entered.wait(30)
    gone, kept = b.submit(np.zeros(7), lambda i, x: None), b.submit(np.zeros(9), lambda i, x: None)
    assert gone.cancel()  # still queued (what LayerMu.stop does)
    rec.gate.set()
    assert first.result(30) is None and kept.result(30) is None and rec.passes == [[5], [9]]
    assert b.join(30)

    def broken(n: int) -> None:
        raise RuntimeError("metrics fell over")

    b.on_pass = broken
    with pytest.raises(RuntimeError, match="metrics fell over"):
        b.submit(np.zeros(3), lambda i, x: None).result(30)
    b.on_pass = None
    assert b.submit(np.zeros(3), lambda i, x: None).result(30) is None  # a worker still serves the queue


def test_a_failing_pass_fails_its_prompts_and_the_batcher_goes_on():
    class Broken:
        calls = 0

        def stream_batch(self, reqs):
            Broken.calls += 1
            if Broken.calls == 1:
                raise RuntimeError("the device fell over")
            return [None] * len(reqs)

    b = PredictorBatcher(Broken())
    with pytest.raises(RuntimeError, match="fell over"):
        b.submit(np.zeros(3), lambda i, x: None).result(30)
    assert b.submit(np.zeros(3), lambda i, x: None).result(30) is None
    with pytest.raises(ValueError):
        PredictorBatcher(Broken(), max_tokens=0)


@pytest.fixture(scope="module")
def w8a8_dir(tiny_target, tiny_text, tmp_path_factory):
    d = tmp_path_factory.mktemp("batcher")
    build_checkpoint(tiny_target, tiny_text, d, tokens=64, segment=32, rung="w8a8:1", derive_weights=True)
    return d


def test_concurrent_transfers_get_their_lone_mu(w8a8_dir, tiny_target):
    pred = Predictor.from_checkpoint(load_checkpoint(w8a8_dir), tiny_target)
    rt = Runtime.from_predictor(pred, ServerConfig(role="decoder"))
    assert rt.batcher is not None and rt.batcher.max_tokens == ServerConfig(role="decoder").predictor_batch_tokens
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, tiny_target.config.vocab_size, n).astype(np.int64) for n in (3, 40, 17, 1, 64, 9)]

    async def all_mu():
        mus = [rt.mu_layers(ids) for ids in prompts]
        await asyncio.gather(*(m.done() for m in mus))
        return [m.bits for m in mus]

    got = asyncio.run(all_mu())
    for ids, bits in zip(prompts, got, strict=True):
        alone = pred.mu(ids).contiguous().view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(bits, alone)
    assert rt.batcher.prompts == len(prompts) and rt.batcher.passes < len(prompts)  # some passes were shared
    off = Runtime.from_predictor(pred, ServerConfig(role="decoder", predictor_batch_tokens=0))
    assert off.batcher is None
    with pytest.raises(ValueError, match="predictor_batch_tokens"):
        ServerConfig(role="decoder", predictor_batch_tokens=-1)


def test_a_stopped_layer_mu_leaves_the_queue():
    """LayerMu.stop() on a prompt still queued cancels it: it never runs, and its waiters learn why."""
    from speckv.server.layer_mu import LayerMu, PredictorStopped

    rec = Recording()
    b = PredictorBatcher(rec)

    async def go():
        first = LayerMu.start(None, np.zeros(5), (1, 1), batcher=b)
        await asyncio.to_thread(rec.entered.wait, 30)
        second = LayerMu.start(None, np.zeros(6), (1, 1), batcher=b)
        await asyncio.sleep(0)  # its task submits it
        second.stop()
        rec.gate.set()
        await first.done()
        with pytest.raises(PredictorStopped):
            await second.upto(1)
        await asyncio.wait([second.task], timeout=30)

    asyncio.run(asyncio.wait_for(go(), 60))
    assert b.join(30) and rec.passes == [[5]]
