"""Helpers of the sidecar tests: a started decoder + encoder pair with its
clients, one transfer (fetch in a thread, submit in the caller), bit-exact
comparison, polling with a deadline, and raw request streams for crafting bad
input.

Every blocking wait here has a timeout, so a bug shows up as a failure, not a
hang.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import grpc
import numpy as np

from speckv.client.client import DecoderClient, EncoderClient, RpcFailed, submit_requests
from speckv.coder import container as ct
from speckv.coder.codec import Fp8KV, bf16_bits, stored_chunk
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import decoder_pb2_grpc as dgrpc
from speckv.v1 import encoder_pb2_grpc as egrpc

MODEL = "SmolLM2-135M-Instruct"
WAIT = 60.0  # seconds: the longest any single blocking step may take before the test fails
FETCH_WAIT = 10.0  # FetchKV's wait for a transfer to arrive (it arrives within a second when it does)

_ids = itertools.count()


def assert_timeline(res: Any) -> None:
    """A SubmitResult's chunk timings: one per chunk, in order, each stage after the one before
    and inside the Submit, and their bytes the stream's less its header record."""
    ts = res.chunk_timings
    assert [t.chunk for t in ts] == list(range(res.chunks)), ts
    for t in ts:
        assert 0 < t.layers_in_seconds <= t.ready_seconds <= t.coded_seconds <= t.written_seconds < res.total_seconds, t
        assert t.inputs_seconds <= t.ready_seconds, t  # the sender starts on a chunk once its inputs exist
        if res.encoding == "speckv" and not res.fallback:
            assert t.peer_mu_seconds > 0, t  # the decoder's check came during the Submit
    assert sum(t.wire_bytes for t in ts) == res.wire_bytes - ct.HEADER_LEN


def rid(prefix: str = "req") -> str:
    """A request id unique within the test session."""
    return f"{prefix}-{next(_ids)}"


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.005, what: str = "") -> Any:
    """Poll ``pred`` until it returns something truthy (returned); AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or pred}")
        time.sleep(interval)


def status_or_none(dec: DecoderClient, request_id: str) -> dpb.TransferStatus | None:
    try:
        return dec.status(request_id, timeout=5)
    except RpcFailed as e:
        if e.code == grpc.StatusCode.NOT_FOUND:
            return None
        raise


def assert_same_kv(got: Any, kv: Any) -> None:
    """Bit-exact equality of a fetched KV with the submitted one (BF16 bits or Fp8KV)."""
    if isinstance(kv, Fp8KV):
        assert isinstance(got, Fp8KV), type(got)
        assert got.codes.dtype == np.uint8 and got.codes.shape == kv.codes.shape
        assert np.array_equal(got.codes, kv.codes)
        assert got.scales.shape == kv.scales.shape
        assert np.array_equal(np.asarray(got.scales, np.float32).view(np.uint32),
                              np.asarray(kv.scales, np.float32).view(np.uint32))
        return
    want = bf16_bits(kv)
    assert isinstance(got, np.ndarray) and got.dtype == np.uint16, (type(got), getattr(got, "dtype", None))
    assert got.shape == want.shape
    assert np.array_equal(got, want)


def kv_nbytes(kv: Any) -> int:
    if isinstance(kv, Fp8KV):
        return int(kv.codes.nbytes)
    return int(bf16_bits(kv).nbytes)


@dataclass
class Pair:
    """A started decoder and encoder (sharing one Sidecars loop) and their blocking clients."""

    sidecars: Any
    decoder: Any
    daddr: str
    encoder: Any
    eaddr: str
    dec: DecoderClient
    enc: EncoderClient

    @classmethod
    def start(cls, sidecars, decoder: dict | None = None, encoder: dict | None = None, **both: Any) -> "Pair":
        d, daddr = sidecars.start("decoder", **{**both, **(decoder or {})})
        e, eaddr = sidecars.start("encoder", **{**both, **(encoder or {})})
        return cls(sidecars, d, daddr, e, eaddr, DecoderClient(daddr, timeout=WAIT),
                   EncoderClient(eaddr, timeout=WAIT))

    def stop(self, grace: float = 0.2) -> None:
        self.dec.close()
        self.enc.close()
        for s in (self.encoder, self.decoder):
            if s in self.sidecars.running:
                self.sidecars.stop(s, grace)

    def transfer(self, request_id: str, kv: Any, ids: np.ndarray, *, fetch: Callable | None = None,
                 **submit_kw: Any):
        """Submit ``kv`` while a concurrent FetchKV drains it; ``(SubmitResult, fetched KV)``.
        ``fetch(dec, request_id)`` replaces the default ``dec.fetch``."""
        fetch = fetch or (lambda dec, r: dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT))
        pool = ThreadPoolExecutor(1)
        fut = pool.submit(fetch, self.dec, request_id)
        try:
            res = self.enc.submit(request_id, kv, ids, self.daddr, MODEL, timeout=WAIT, **submit_kw)
        except BaseException:
            # end the fetch too if the transfer reached the decoder; else it gives up after FETCH_WAIT
            if status_or_none(self.dec, request_id) is not None:
                self.dec.cancel(request_id, timeout=5)
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        try:
            return res, fut.result(timeout=WAIT)
        finally:
            pool.shutdown(wait=False)

    def roundtrip(self, request_id: str, kv: Any, ids: np.ndarray, **submit_kw: Any):
        """``transfer`` and check the fetched KV bit for bit; returns the SubmitResult."""
        res, got = self.transfer(request_id, kv, ids, **submit_kw)
        assert_same_kv(got, kv)
        assert res.raw_bytes == kv_nbytes(kv)
        return res


class Gate:
    """A request iterator that yields ``reqs[:after]``, then blocks until ``open()``
    (gives up, ending the stream, after ``timeout``). ``reached`` is set when it blocks."""

    def __init__(self, reqs: Iterable[Any], after: int, timeout: float = WAIT) -> None:
        self.reqs, self.after, self.timeout = list(reqs), after, timeout
        self.event = threading.Event()
        self.reached = threading.Event()

    def open(self) -> None:
        self.event.set()

    def __iter__(self) -> Iterator[Any]:
        for k, r in enumerate(self.reqs):
            if k == self.after:
                self.reached.set()
                if not self.event.wait(self.timeout):
                    return
            yield r


def raw_submit_future(eaddr: str, requests: Iterable[Any], timeout: float = WAIT):
    """A raw Submit call (a grpc future) and its channel (close it when done)."""
    ch = grpc.insecure_channel(eaddr)
    return egrpc.EncoderServiceStub(ch).Submit.future(iter(requests), timeout=timeout), ch


def raw_submit(eaddr: str, requests: Iterable[Any], timeout: float = WAIT) -> grpc.RpcError:
    """Send a raw Submit stream that must fail; the grpc error."""
    with grpc.insecure_channel(eaddr) as ch:
        try:
            resp = egrpc.EncoderServiceStub(ch).Submit(iter(requests), timeout=timeout)
        except grpc.RpcError as e:
            return e
    raise AssertionError(f"Submit succeeded: {resp}")


def raw_transfer(daddr: str, requests: Iterable[Any], timeout: float = WAIT) -> list[dpb.TransferResponse]:
    """A raw Transfer call to a decoder; all responses (raises grpc.RpcError on failure)."""
    with grpc.insecure_channel(daddr) as ch:
        return list(dgrpc.DecoderServiceStub(ch).Transfer(iter(requests), timeout=timeout))


def submit_list(request_id: str, kv: Any, ids: np.ndarray, daddr: str, model: str = MODEL,
                **kw: Any) -> list:
    """The SubmitRequest messages of a submit (header first, one part per layer here)."""
    return list(submit_requests(request_id, kv, ids, daddr, model, **kw))


def stored_stream(codec, request_id: str, bits: np.ndarray, ids: np.ndarray, pin: bytes,
                  layers_per_chunk: int = 2, model: str = MODEL, version: int = ct.FORMAT_VERSION
                  ) -> tuple[dpb.TransferRequest, list[bytes]]:
    """A BF16 stored stream (format ``version``) built by hand: the TransferHeader request and
    the chunk records."""
    import dataclasses

    h = dataclasses.replace(codec.stream_header(True, bits.shape, ids, layers_per_chunk, stored=True), version=version)
    header = dpb.TransferRequest(header=dpb.TransferHeader(
        request_id=request_id, predictor_pin=pin, model_id=model, dtype=pb.DTYPE_BF16,
        shape=pb.KVShape(layers=bits.shape[0], kv=2, kv_heads=bits.shape[2], tokens=bits.shape[3],
                         head_dim=bits.shape[4]),
        prompt_token_ids=[int(t) for t in ids], header_record=ct.pack_header(h)))
    recs = []
    for i in range(h.n_chunks):
        start, count = h.chunk_layers(i)
        recs.append(ct.pack_chunk(stored_chunk(h, i, bits[start:start + count], None)))
    return header, recs


def trailer_request(bits: np.ndarray, digest: bytes | None = None, version: int = ct.FORMAT_VERSION
                    ) -> dpb.TransferRequest:
    """The TransferTrailer of a BF16 KV (its whole-transfer digest, as a format ``version``
    stream's, or the given one)."""
    from speckv.digests import KVDigest, algorithm_of

    d = KVDigest(algorithm_of(version))
    for layer in bits:
        d.update_layer(layer)
    return dpb.TransferRequest(trailer=dpb.TransferTrailer(raw_digest=digest or d.digest(), raw_bytes=d.raw_bytes))


def chunk_requests(recs: list[bytes], part_bytes: int = 1 << 20) -> list[dpb.TransferRequest]:
    out = []
    for i, rec in enumerate(recs):
        for off in range(0, len(rec), part_bytes):
            out.append(dpb.TransferRequest(chunk=dpb.Chunk(index=i, record=rec[off:off + part_bytes],
                                                           byte_offset=off, record_bytes=len(rec))))
    return out


def budgets_drain(pair: Pair, timeout: float = 10.0) -> None:
    """Both sidecars' in-flight byte budgets return to 0 (a handler may release its last
    bytes just after the client has seen the call end, hence the polling)."""
    for side in (pair.decoder, pair.encoder):
        wait_until(lambda side=side: side.service.budget.used == 0, timeout,
                   what=f"{side.config.role} budget.used == 0 (now {side.service.budget.used})")
