"""The live sidecars the server targets run against: a real decoder and encoder
(``LocalPair``, loopback), channels reused across inputs, valid Transfer streams of
a real KV, a logging tap for errors, and the checks every input ends with."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from speckv.client.client import DecoderClient, RpcFailed
from speckv.coder import container as ct
from speckv.coder.codec import Codec, CodecConfig, Fp8KV, bf16_bits
from speckv.digests import KVDigest, algorithm_of
from speckv.predictor.fp8 import kv_to_fp8
from speckv.server.local import LocalPair
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import decoder_pb2_grpc as dgrpc
from speckv.v1 import encoder_pb2 as epb
from speckv.v1 import encoder_pb2_grpc as egrpc

from .coder_env import same_kv, stored_records
from .findings import Finding
from .mutate import record_fields

MODEL = "SmolLM2-135M-Instruct"
# method path -> its kind: (client) s(tream) / u(nary), then (server) s / u
RAW_METHODS = {"/speckv.v1.DecoderService/Transfer": "ss", "/speckv.v1.DecoderService/FetchKV": "us",
               "/speckv.v1.DecoderService/GetTransferStatus": "uu",
               "/speckv.v1.DecoderService/CancelTransfer": "uu", "/speckv.v1.EncoderService/Submit": "su"}
REQUEST_TYPES = {"Transfer": dpb.TransferRequest, "FetchKV": dpb.FetchKVRequest,
                 "GetTransferStatus": dpb.GetTransferStatusRequest,
                 "CancelTransfer": dpb.CancelTransferRequest, "Submit": epb.SubmitRequest}
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 8 << 20), ("grpc.max_receive_message_length", 8 << 20)]


@dataclass
class TBase:
    """A valid Transfer stream: header fields, records, trailer; and the KV it carries."""

    name: str
    header: dpb.TransferHeader
    records: list[bytes]  # chunk records (the header record is in ``header``)
    trailer: dpb.TransferTrailer
    bits: np.ndarray
    scales: np.ndarray | None
    fields: list[list[tuple[int, int]]]  # per record, header record first


@dataclass
class Call:
    """How one RPC ended."""

    code: grpc.StatusCode
    details: str
    elapsed: float
    responses: list = field(default_factory=list)


class ErrorTap(logging.Handler):
    """Collects ERROR records logged in this process (the sidecars log internal errors)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []
        self.total = 0
        self._guard = threading.Lock()
        logging.getLogger().addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()[:300]}"
        if record.exc_info and record.exc_info[1] is not None:
            e = record.exc_info[1]
            text += f" [{type(e).__name__}: {str(e)[:200]}]"
        with self._guard:
            self.total += 1
            if len(self.records) < 50:
                self.records.append(text)

    def take(self) -> list[str]:
        """The records collected since the last call."""
        with self._guard:
            out, self.records = self.records, []
            return out

    def close(self) -> None:
        logging.getLogger().removeHandler(self)
        super().close()


def _trailer(bits: np.ndarray, scales: np.ndarray | None) -> dpb.TransferTrailer:
    d = KVDigest(algorithm_of(ct.FORMAT_VERSION))  # the streams here are the codec's: its version
    for layer in range(bits.shape[0]):
        d.update_layer(bits[layer], None if scales is None else scales[layer])
    return dpb.TransferTrailer(raw_digest=d.digest(), raw_bytes=d.raw_bytes)


def transfer_bases(codec: Codec, pin: str, ids: np.ndarray, mu: np.ndarray,
                   kvs: dict[str, tuple[np.ndarray, np.ndarray | None]]) -> dict[str, TBase]:
    """Stored and speckv Transfer streams of each KV of ``kvs`` (name -> bits, scales)."""
    out = {}
    for dname, (bits, sc) in kvs.items():
        shape = bits.shape
        for enc in ("stored", "speckv"):
            if enc == "speckv":
                recs = list(codec.encode(bits if sc is None else Fp8KV(bits, sc), ids, mu))
            else:
                recs = stored_records(codec, bits, sc, ids, layers_per_chunk=4)
            hdr = dpb.TransferHeader(
                request_id="", predictor_pin=bytes.fromhex(pin), model_id=MODEL,
                dtype=pb.DTYPE_BF16 if sc is None else pb.DTYPE_FP8_E4M3,
                shape=pb.KVShape(layers=shape[0], kv=2, kv_heads=shape[2], tokens=shape[3], head_dim=shape[4]),
                prompt_token_ids=[int(t) for t in ids], header_record=recs[0])
            name = f"{enc}-{dname}"
            out[name] = TBase(name, hdr, recs[1:], _trailer(bits, sc), bits, sc, record_fields(recs))
    return out


class ServerEnv:
    """A real decoder + encoder (LocalPair) and what the server targets need: channels
    reused across inputs, valid streams of a real KV, a logging tap for errors.
    ``config`` overrides the sidecars' settings."""

    def __init__(self, predictor: Any, target: Any, seed: int = 0, text: str = "Hello world, fuzz",
                 **config: Any) -> None:
        self.seed = seed
        self._ids = 0
        self.errors = ErrorTap()
        # small in-flight cap (random record sizes are allocated up to it), short default wait,
        # 10 layers per chunk (3 chunks: fewer messages per input)
        self.config = {"fetch_wait_s": 0.1, "max_inflight_bytes": 16 << 20, "layers_per_chunk": 10, **config}
        self.pair = LocalPair(predictor, metrics=False, **self.config).start()
        self.daddr, self.eaddr = self.pair.decoder_address, self.pair.encoder_address
        self._connect()
        # the real KV of a short prompt, BF16 and FP8
        self.ids = np.asarray(target.tokenize(text), np.int64)
        kv = target.kv(self.ids)
        self.kv_bf16 = bf16_bits(kv).copy()
        codes, scales = kv_to_fp8(kv)
        self.fp8 = Fp8KV(codes.cpu().numpy().astype(np.uint8), scales.cpu().numpy().astype(np.float32))
        self.pin = predictor.pin
        codec = Codec.from_predictor(predictor, CodecConfig(elems_per_lane=16, layers_per_chunk=10, threads=1,
                                                            coder="numpy"))
        self.bases = transfer_bases(codec, self.pin, self.ids, bf16_bits(predictor.mu(self.ids)),
                                    {"bf16": (self.kv_bf16, None), "fp8": (self.fp8.codes, self.fp8.scales)})
        self.donors = [r for b in self.bases.values() for r in b.records]
        self._check_bases()

    def _connect(self) -> None:
        self.dch = grpc.insecure_channel(self.daddr, options=CHANNEL_OPTIONS)
        self.ech = grpc.insecure_channel(self.eaddr, options=CHANNEL_OPTIONS)
        self.dstub, self.estub = dgrpc.DecoderServiceStub(self.dch), egrpc.EncoderServiceStub(self.ech)
        self.dclient = DecoderClient(self.daddr, channel=self.dch)
        self.health = {"decoder": health_pb2_grpc.HealthStub(self.dch),
                       "encoder": health_pb2_grpc.HealthStub(self.ech)}
        self.raw: dict[str, tuple[str, Callable]] = {}  # method path -> (kind, bytes-in bytes-out callable)
        for path, kind in RAW_METHODS.items():
            ch = self.ech if "Encoder" in path else self.dch
            make = {"ss": ch.stream_stream, "us": ch.unary_stream, "uu": ch.unary_unary, "su": ch.stream_unary}[kind]
            self.raw[path] = (kind, make(path, request_serializer=bytes, response_deserializer=bytes))

    def _check_bases(self) -> None:
        """The harness must start from streams the decoder accepts."""
        for b in self.bases.values():
            rid = self.new_id("base")
            call = self.transfer(self.transfer_messages(b, rid, 1 << 20), 60)
            if call.code != grpc.StatusCode.OK:
                raise RuntimeError(f"base stream {b.name} was rejected: {call.code} {call.details}")
            self.fetch_and_check(rid, b.bits, b.scales, "base")
        self.check_drained()

    # -- plumbing --
    def new_id(self, prefix: str = "fz") -> str:
        """A request id not used before."""
        self._ids += 1
        return f"{prefix}-{self.seed}-{self._ids}"

    def close(self) -> None:
        self.dch.close()
        self.ech.close()
        self.pair.stop()
        self.errors.close()

    def service(self, role: str) -> Any:
        """The servicer object of the decoder or the encoder."""
        return self.pair.sidecars[role][0].service

    def on_loop(self, fn: Callable[[], Any], timeout: float = 10) -> Any:
        """``fn()`` run on the sidecars' event loop."""
        async def run() -> Any:
            return fn()
        return self.pair._run(run(), timeout)

    def used(self) -> tuple[int, int]:
        """In-flight bytes held: (decoder, encoder)."""
        return self.on_loop(lambda: (self.service("decoder").budget.used, self.service("encoder").budget.used))

    def live(self) -> int:
        """Transfers the decoder holds."""
        return self.on_loop(lambda: len(self.service("decoder").table))

    def fetch_wait(self, wait_ms: int) -> float:
        """How long FetchKV waits for a transfer (``wait_timeout_ms``; 0: the server's default)."""
        return wait_ms / 1000 if wait_ms else self.config["fetch_wait_s"]

    def healthy(self) -> dict[str, str]:
        """Each sidecar's health status name (or the error of the check)."""
        out = {}
        for role, stub in self.health.items():
            try:
                st = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                out[role] = health_pb2.HealthCheckResponse.ServingStatus.Name(st)
            except grpc.RpcError as e:
                out[role] = f"error {e.code().name}"
        return out

    # -- the checks after every input --
    def check_drained(self, timeout: float = 10.0) -> None:
        """Both budgets back to 0 and no live transfer within ``timeout`` (Finding leak)."""
        deadline = time.monotonic() + timeout
        while True:
            used, live, active = self.used(), self.live(), self.service("encoder").active
            if used == (0, 0) and live == 0 and active == 0:
                return
            if time.monotonic() > deadline:
                raise Finding("leak", f"after {timeout} s: budgets (decoder, encoder) used {used}, "
                                      f"{live} live transfers, {active} active submits")
            time.sleep(0.002)

    def check_errors(self) -> None:
        """No sidecar logged an error (Finding crash)."""
        got = self.errors.take()
        if got:
            raise Finding("crash", f"a sidecar logged an error: {got[0]}")

    def check_clean(self) -> None:
        """What every input ends with: budgets drained, no error logged."""
        self.check_drained()
        self.check_errors()

    def reset(self) -> None:
        """After a finding: cancel whatever an input left live, so it does not count
        against the next one."""
        for rid in self.on_loop(lambda: [t.request_id for t in self.service("decoder").table.live()]):
            with contextlib.suppress(grpc.RpcError):
                self.dstub.CancelTransfer(dpb.CancelTransferRequest(request_id=rid), timeout=5)
        with contextlib.suppress(Finding):
            self.check_drained(30)
        self.errors.take()

    # -- calls --
    def call(self, fn: Callable[[], Any], deadline: float, expect_timeout: bool = False) -> Call:
        """Run the RPC ``fn``: its status must not be UNKNOWN or INTERNAL (crash), and it
        must end before ``deadline`` unless ``expect_timeout`` (hang)."""
        t0 = time.perf_counter()
        try:
            res = fn()
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            res, code, details = [], e.code(), e.details() or ""
        el = time.perf_counter() - t0
        if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
            raise Finding("crash", f"status {code.name}: {details[:200]}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and el >= 0.9 * deadline and not expect_timeout:
            raise Finding("hang", f"no answer within the {deadline} s deadline ({details[:100]})")
        return Call(code, details, el, res if isinstance(res, list) else [res])

    def raw_call(self, path: str, reqs: list[bytes], timeout: float) -> Any:
        """Call the method ``path`` (of RAW_METHODS) with serialized requests: the messages
        of a client stream, or the one request of a unary call."""
        kind, fn = self.raw[path]
        out = fn(iter(reqs) if kind[0] == "s" else reqs[0], timeout=timeout)
        return list(out) if kind[1] == "s" else out

    def transfer(self, msgs: Iterable[dpb.TransferRequest], deadline: float = 20.0) -> Call:
        return self.call(lambda: list(self.dstub.Transfer(iter(msgs), timeout=deadline)), deadline)

    def status(self, rid: str) -> Call:
        return self.call(lambda: self.dstub.GetTransferStatus(dpb.GetTransferStatusRequest(request_id=rid),
                                                              timeout=5), 5)

    def cancel(self, rid: str) -> Call:
        return self.call(lambda: self.dstub.CancelTransfer(dpb.CancelTransferRequest(request_id=rid), timeout=5), 5)

    def transfer_messages(self, b: TBase, rid: str, part: int, header: dpb.TransferHeader | None = None,
                          records: list[bytes] | None = None,
                          trailer: dpb.TransferTrailer | None = None) -> list[dpb.TransferRequest]:
        """The TransferRequest stream of ``b`` under ``rid`` (unless another ``header`` is
        given), records in parts of ``part`` bytes; ``records`` / ``trailer`` replace b's."""
        hdr = dpb.TransferHeader()
        hdr.CopyFrom(header if header is not None else b.header)
        if header is None:
            hdr.request_id = rid
        msgs = [dpb.TransferRequest(header=hdr)]
        for i, rec in enumerate(b.records if records is None else records):
            for off in range(0, max(len(rec), 1), part):
                msgs.append(dpb.TransferRequest(chunk=dpb.Chunk(index=i, record=rec[off:off + part], byte_offset=off,
                                                                record_bytes=len(rec))))
        msgs.append(dpb.TransferRequest(trailer=trailer if trailer is not None else b.trailer))
        return msgs

    def fetch_and_check(self, rid: str, bits: np.ndarray, scales: np.ndarray | None, what: str,
                        verified_only: bool = False) -> None:
        """A transfer reported OK must come back bit for bit (else lost / corrupt)."""
        try:
            out = self.dclient.fetch(rid, wait=10, timeout=30, verified_only=verified_only)
        except RpcFailed as e:
            raise Finding("lost", f"{what}: {rid!r} was reported OK but FetchKV failed: {e}") from None
        if not same_kv(out, bits, scales):
            raise Finding("corrupt", f"{what}: {rid!r} fetched other bits than were sent")

    def consume(self, rid: str, bits: np.ndarray, scales: np.ndarray | None, what: str,
                rng: random.Random) -> None:
        """Fetch (and check) or cancel a transfer the decoder reported complete."""
        if rng.random() < 0.75:
            self.fetch_and_check(rid, bits, scales, what, verified_only=rng.random() < 0.3)
        else:
            self.cancel(rid)
