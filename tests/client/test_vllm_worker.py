"""The vLLM connector's worker (``speckv.client.vllm_worker``) and the local KV hand-off,
without vLLM running: which socket the connector picks (``local_socket``), and that a
producer's layers then go as sealed memfds to a real hand-off listener
(``speckv.server.handoff.Handoffs``, the encoder's own), or, when that refuses them, the
request's submit fails as any submit does (logged, counted, cancelled).

vLLM is not installed in this environment: where it cannot be imported, the two vLLM
modules the worker imports (through ``speckv.client.vllm_stats``) are stood in for by
minimal stubs for the duration of a test; the Submit's gRPC call is a fake (no sidecar).
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch

from speckv import handoff as proto
from speckv.client.pd import SaveSpec, StepPlan, rank_heads
from speckv.kv import HeadRange, bf16_bits
from speckv.server.handoff import Handoffs
from speckv.v1 import encoder_pb2 as epb

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, TOKENS, DIM = 2, 3, 4
WORKER_MODULES = ("speckv.client.vllm_worker", "speckv.client.vllm_stats")


def _vllm_stubs() -> dict[str, types.ModuleType]:
    """What speckv.client.vllm_stats imports of vLLM, and no more."""

    @dataclass
    class KVConnectorStats:
        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:
        def __init__(self, *args: Any) -> None:
            pass

    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
             "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
             "vllm.v1", "vllm.v1.metrics", "vllm.v1.metrics.utils"]
    mods = {n: types.ModuleType(n) for n in names}
    metrics = mods["vllm.distributed.kv_transfer.kv_connector.v1.metrics"]
    metrics.KVConnectorStats, metrics.KVConnectorPromMetrics = KVConnectorStats, KVConnectorPromMetrics  # type: ignore[attr-defined]
    mods["vllm.v1.metrics.utils"].create_metric_per_engine = lambda metric, labels: {}  # type: ignore[attr-defined]
    return mods


@pytest.fixture()
def vw(monkeypatch):
    """speckv.client.vllm_worker: imported as it is where vLLM is installed, else over stubs
    (then imported afresh, and forgotten after the test)."""
    if importlib.util.find_spec("vllm") is not None:
        yield importlib.import_module("speckv.client.vllm_worker")
        return
    for name, mod in _vllm_stubs().items():
        monkeypatch.setitem(sys.modules, name, mod)
    for name in WORKER_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        yield importlib.import_module("speckv.client.vllm_worker")
    finally:
        package = sys.modules["speckv.client"]
        for name in WORKER_MODULES:
            sys.modules.pop(name, None)
            if hasattr(package, name.rsplit(".", 1)[1]):
                delattr(package, name.rsplit(".", 1)[1])


# -- which socket ---------------------------------------------------------------------

def test_local_socket_from_extra_config_else_the_variable(vw, monkeypatch):
    def get(extra: dict[str, Any]):
        return lambda key, default=None: extra.get(key, default)

    monkeypatch.delenv("SPECKV_LOCAL_SOCKET", raising=False)
    assert vw.local_socket(get({})) is None  # neither: the bytes path
    assert vw.local_socket(get({"speckv_local_socket": "/run/a.sock"})) == "/run/a.sock"
    monkeypatch.setenv("SPECKV_LOCAL_SOCKET", "/run/env.sock")
    assert vw.local_socket(get({})) == "/run/env.sock"
    assert vw.local_socket(get({"speckv_local_socket": "/run/a.sock"})) == "/run/a.sock"  # the key wins
    assert vw.local_socket(get({"speckv_local_socket": ""})) is None  # empty: off, even with the variable
    monkeypatch.setenv("SPECKV_LOCAL_SOCKET", "")
    assert vw.local_socket(get({})) is None


# -- the worker's Submits ---------------------------------------------------------------

class FakeCall:
    """The Submit call's stub and future in one: keeps the request iterator, ends only on cancel."""

    def __init__(self) -> None:
        self.requests: Any = None
        self.callbacks: list[Any] = []
        self._cancelled = False

    def future(self, requests: Any, timeout: float | None = None) -> "FakeCall":
        self.requests = requests
        return self

    def add_done_callback(self, fn: Any) -> None:
        if self._cancelled:
            fn(self)
        else:
            self.callbacks.append(fn)

    def cancel(self) -> bool:
        if self._cancelled:
            return False
        self._cancelled = True
        for fn in self.callbacks:
            fn(self)
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._cancelled

    def exception(self) -> None:
        return None

    def result(self, timeout: float | None = None) -> Any:
        if self._cancelled:
            raise grpc.FutureCancelledError()
        raise grpc.FutureTimeoutError()


class WholeLayer:
    """A paged layout whose 'paged' layer is already the request's (2, heads, tokens, dim)."""

    def gather(self, layer: torch.Tensor, block_ids: list[int], start: int, stop: int) -> torch.Tensor:
        return layer[:, :, start:stop]


def _worker(vw, socket_path: str | None, head_range: HeadRange | None = None):
    conn = SimpleNamespace(_vllm_config=None, block_size=16, producer=True, consumer=False,
                           encoder_address="127.0.0.1:9", decoder_address=None, local_socket=socket_path,
                           model_id="SmolLM2-135M-Instruct", encoding="stored", fetch_wait_s=1.0,
                           head_range=head_range)
    w = vw.Worker(conn)
    w.layers, w.heads, w.head_dim, w.fp8 = list(LAYERS), HEADS, DIM, False
    w._layout = WholeLayer()
    call = FakeCall()
    w.encoder._submit = call  # NOTE: the channel (to nothing) is never used
    return w, call


def _plan() -> StepPlan:
    return StepPlan(saves=[SaveSpec("req-1", "t-1", "10.0.0.7:50052", TOKENS, [0], prompt_token_ids=[5, 6, 7],
                                    complete=True)])


def _layers() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, HEADS, TOKENS, DIM, generator=g).to(torch.bfloat16) for _ in LAYERS]


@pytest.fixture()
def handoffs(tmp_path):
    """A real hand-off listener (the encoder sidecar's), admitting ``uids``."""
    started = []

    def start(uids: frozenset[int] = frozenset({os.getuid()})) -> Handoffs:
        h = Handoffs(str(tmp_path / "encoder.sock"), uids, ttl_s=30.0, max_handles=8, max_bytes=1 << 20)
        h.start()
        started.append(h)
        return h

    yield start
    for h in started:
        h.stop()


def test_layers_go_as_sealed_memfds(vw, handoffs):
    h = handoffs()
    w, call = _worker(vw, h.path)
    assert w.encoder.handoff is not None and w.encoder.handoff.path == h.path
    plan, kv = _plan(), _layers()
    w.open_new(plan)
    for name, layer in zip(LAYERS, kv, strict=True):
        w.save_layer(plan, name, layer)
    reqs = list(call.requests)  # the request stream ended after the last layer
    assert [r.WhichOneof("kind") for r in reqs] == ["header", "local_layer", "local_layer"]
    assert h.handles == 2  # one memfd per layer, mapped by the listener
    owner = object()
    for i, r in enumerate(reqs[1:]):
        m = r.local_layer
        assert m.layer == i and m.byte_offset == 0
        got = bytes(h.claim(m.handle, owner).view(m.byte_offset, m.layer_bytes))
        assert got == bf16_bits(kv[i]).tobytes()
    h.release(owner)
    assert "t-1" in w.streams and w.stats.data["send_failed"] == 0
    w.close()


def test_bytes_path_without_a_socket(vw):
    w, call = _worker(vw, None)
    assert w.encoder.handoff is None
    plan, kv = _plan(), _layers()
    w.open_new(plan)
    for name, layer in zip(LAYERS, kv, strict=True):
        w.save_layer(plan, name, layer)
    parts = [epb.SubmitRequest.FromString(bytes(f)) for f in list(call.requests)[1:]]  # pre-serialised frames
    assert [(p.WhichOneof("kind"), p.layer.layer) for p in parts] == [("layer", 0), ("layer", 1)]
    w.close()


def test_a_tensor_parallel_rank_submits_its_heads(vw):
    """Rank 1 of 2 over 4 KV heads holds heads 2..3: its Submit says so (SubmitHeader.heads),
    under the request's one transfer id."""
    w, call = _worker(vw, None, HeadRange.of_rank(1, 2, 2 * HEADS))
    plan, kv = _plan(), _layers()
    w.open_new(plan)
    for name, layer in zip(LAYERS, kv, strict=True):
        w.save_layer(plan, name, layer)
    reqs = list(call.requests)
    hdr = reqs[0].header
    assert hdr.request_id == "t-1" and hdr.shape.kv_heads == HEADS
    assert (hdr.heads.start, hdr.heads.count, hdr.heads.total) == (HEADS, HEADS, 2 * HEADS)
    w.close()


def test_rank_heads(monkeypatch):
    """The connector's split: even splits only, the worker's rank from vLLM's parallel state."""
    assert rank_heads(1, 3, True) is None
    with pytest.raises(NotImplementedError, match="divide evenly"):
        rank_heads(2, 3, True)
    with pytest.raises(NotImplementedError):
        rank_heads(4, 2, True)  # replicated heads
    assert rank_heads(3, 3, False) is None  # the scheduler moves no KV
    state = types.ModuleType("vllm.distributed.parallel_state")
    state.get_tensor_model_parallel_rank = lambda: 2  # type: ignore[attr-defined]
    for name in ("vllm", "vllm.distributed"):
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", state)
    assert rank_heads(3, 3, True) == HeadRange(2, 1, 3)


@pytest.mark.parametrize("refusal", ["peer_denied", "unreachable"])
def test_refused_hand_off_fails_the_submit(vw, handoffs, tmp_path, caplog, refusal):
    """A refusal (LOCAL_* reason) ends that request's submit as any failed submit: a warning
    naming the code and reason, one send_failed, the call cancelled (the decoder drops the
    transfer and the decode side recomputes); no fallback to the bytes path."""
    if refusal == "peer_denied":
        path, code, reason = handoffs(frozenset({os.getuid() + 4242})).path, "PERMISSION_DENIED", proto.PEER_DENIED
    else:
        path, code, reason = str(tmp_path / "nobody.sock"), "UNAVAILABLE", "LOCAL_SOCKET_UNAVAILABLE"
    w, call = _worker(vw, path)
    plan, kv = _plan(), _layers()
    w.open_new(plan)
    with caplog.at_level(logging.WARNING, logger="vllm.speckv"):
        w.save_layer(plan, LAYERS[0], kv[0])
    assert call.cancelled() and "t-1" not in w.streams
    assert w.stats.data["send_failed"] == 1  # once: the cancelled call's own callback counts nothing
    (rec,) = [r for r in caplog.records if r.name == "vllm.speckv"]
    assert "submit t-1 failed" in rec.getMessage() and code in rec.getMessage() and reason in rec.getMessage()
    assert [r.WhichOneof("kind") for r in list(call.requests)] == ["header"]  # no layer went as bytes
    w.save_layer(plan, LAYERS[1], kv[1])  # the next layer: nothing more for that request
    assert w.stats.data["send_failed"] == 1
    w.close()


@pytest.mark.parametrize(("producer", "consumer"), [(False, True), (True, True)])
def test_consumer_fetches_through_the_socket(vw, producer, consumer):
    """A consumer's decoder client fetches through the sidecar's socket (a mailbox, opened on first
    fetch); an instance that is both producer and consumer keeps its one socket for its encoder."""
    conn = SimpleNamespace(_vllm_config=None, block_size=16, producer=producer, consumer=consumer,
                           encoder_address="127.0.0.1:9", decoder_address="127.0.0.1:9",
                           local_socket="/run/kv/sidecar.sock", model_id="SmolLM2-135M-Instruct",
                           encoding="stored", fetch_wait_s=1.0, head_range=None)
    w = vw.Worker(conn)
    try:
        mailbox = w.decoder.mailbox
        assert (mailbox.path if mailbox is not None else None) == (None if producer else "/run/kv/sidecar.sock")
        assert (w.encoder is not None) == producer
    finally:
        w.decoder.close()
        if w.encoder is not None:
            w.encoder.close()
