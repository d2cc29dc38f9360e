"""One Submit in progress on the encoder (``Job``), and what it writes on its Transfer
call: the TransferHeader and each message, timed (flow control is the decoder's
backpressure)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from speckv.coder import container as ct
from speckv.digests import KVDigest, algorithm_of
from speckv.kv import Fp8Attention, HeadRange
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import encoder_pb2 as epb
from speckv.wire import fp8_attention_msg, heads_msg

from .budget import Holding
from .handoff import Handoffs

if TYPE_CHECKING:  # pragma: no cover
    from .layer_mu import LayerMu
    from .replies import Checks


@dataclass
class Job:
    """One Submit in progress."""

    header: epb.SubmitHeader
    h: ct.StreamHeader
    ids: np.ndarray
    labels: tuple[str, str]  # (dtype, encoding)
    holding: Holding
    layers: dict[int, tuple[np.ndarray, np.ndarray | None]] = field(default_factory=dict)
    raw_bytes: int = 0
    wire_bytes: int = 0
    chunks: int = 0
    predictor_s: float = 0.0
    encode_s: float = 0.0
    first_send: float | None = None
    message_bytes: int = 0  # serialized TransferRequests written
    fallback: bool = False  # a chunk went stored after a predictor mismatch on its layers
    stream_fallback: str = ""  # why the whole stream went stored though speckv was asked (replies.STORED_ON)
    stored_chunks: int = 0  # chunks of a speckv stream sent stored (mismatch or size guard)
    stored_reasons: set[str] = field(default_factory=set)  # why they went stored (fallback_transfers_total)
    mu_wait_s: float = 0.0  # the sender waiting for mu (ours, or the decoder's check)
    wire_wait_s: float = 0.0  # inside call.write: flow control
    mu_hit: bool = False  # mu came from the cache (or a pass another transfer started)
    mu: "LayerMu | None" = None  # the predictor pass the chunks are coded under (None: a stored stream)
    rechecked: bool = False  # a second pass ran after a disagreement (server/mu_recheck.py)
    fp8_attention: Fp8Attention | None = None  # SubmitHeader.fp8_attention: the mu both predictors compute
    heads: HeadRange | None = None  # SubmitHeader.heads: one tensor-parallel rank's heads (None: all)
    codec: Any = None  # the runtime's codec, of those heads (coder/heads.py)
    span: Any = None  # its OpenTelemetry span (server/tracing.py), None when tracing is off
    t0: float = 0.0  # the header's arrival (perf_counter): the origin of the chunk timings
    timeline: dict[int, epb.ChunkTiming] = field(default_factory=dict)  # chunk -> when its stages ended
    digest: KVDigest = field(init=False)  # whole-transfer digest, layer by layer

    def __post_init__(self) -> None:
        self.digest = KVDigest(algorithm_of(self.h.version))  # the stream version's digest

    def mark(self, chunks: "int | list[int]", stage: str) -> None:
        """The chunks' ``stage`` (a ChunkTiming field) ended now."""
        now = time.perf_counter() - self.t0
        for c in [chunks] if isinstance(chunks, int) else chunks:
            t = self.timeline.get(c)
            if t is None:
                t = self.timeline[c] = epb.ChunkTiming(chunk=c)
            setattr(t, stage, now)

    def ready(self, chunk: int, mu_at: float, peer_at: float) -> None:
        """Chunk ``chunk`` of a speckv stream is about to be coded; its layers' mu existed here at
        ``mu_at`` and the decoder's check of it arrived at ``peer_at`` (perf_counter; NOTE: apart
        from when the sender got to them; 0 when before the Submit)."""
        self.mark(chunk, "ready_seconds")
        t = self.timeline[chunk]
        t.mu_seconds, t.peer_mu_seconds = max(0.0, mu_at - self.t0), max(0.0, peer_at - self.t0)


async def write(job: Job, call, req: "dpb.TransferRequest | bytes") -> None:
    job.message_bytes += len(req) if isinstance(req, bytes) else req.ByteSize()
    t0 = time.perf_counter()
    await call.write(req)  # NOTE: awaits HTTP/2 flow control: the decoder's backpressure
    job.wire_wait_s += time.perf_counter() - t0


async def mismatched_chunks(job: Job, mu: "LayerMu", batch: list[int], checks: "Checks") -> set[int]:
    """The chunks of ``batch`` whose layers' mu differs between this encoder and the decoder; each
    chunk's ready time is recorded.

    NOTE: the one wait on the predictors: chunk i waits for both sides' mu of its own layers only,
    never for the whole mu."""
    bad = set()
    for i in batch:
        start, count = job.h.chunk_layers(i)
        if await mu.digest_of(start, start + count, algorithm_of(job.h.version)) != await checks.get(i):
            bad.add(i)
        job.ready(i, mu.ready_time(start, start + count), checks.arrived[i])
    return bad


def local_part(job: Job, m: epb.LocalLayer, handoffs: Handoffs) -> tuple[pb.KVLayer, memoryview]:
    """A LocalLayer as the one-part KVLayer it stands for, and its bytes: a view of the
    claimed memfd (the assembler checks layer, size and scales as for any part)."""
    view = handoffs.claim(m.handle, job).view(m.byte_offset, m.layer_bytes)
    hdr = job.header
    return pb.KVLayer(layer=m.layer, dtype=hdr.dtype, shape=hdr.shape, part_index=0, part_count=1,
                      byte_offset=0, layer_bytes=m.layer_bytes, fp8_scales=m.fp8_scales), view


TRANSFER = "/speckv.v1.DecoderService/Transfer"
STORED_VERSION = 3  # the version stored streams are written in (versions 3 to 5 read them alike)


def transfer_header(job: Job) -> dpb.TransferHeader:
    hdr = job.header
    return dpb.TransferHeader(request_id=hdr.request_id, predictor_pin=job.h.pin,
                              model_id=hdr.model_id, dtype=hdr.dtype, shape=hdr.shape,
                              prompt_token_ids=hdr.prompt_token_ids, header_record=ct.pack_header(job.h),
                              fp8_attention=fp8_attention_msg(job.fp8_attention), heads=heads_msg(job.heads))
