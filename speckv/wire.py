"""Messages <-> arrays: KV layers and chunk records split into parts, and put
back together with every size and order checked before anything is allocated.

A raw KV layer is ``kv[layer]`` of the canonical tensor, ``(2, kv_heads,
tokens, head_dim)`` little-endian; a record is one container record. Both
travel as parts of at most ``part_bytes`` so that no gRPC message nears the
4 MiB default limit, whatever the cache size (a 128k-token, 80-layer cache
is ~500 MB per layer: ~250 messages per layer, never one giant one).
Assemblers are used by both sides (sidecars and clients) and raise
``RpcError(INVALID_ARGUMENT)`` on any inconsistency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, cast

import grpc
import numpy as np

from speckv.v1 import common_pb2 as pb

from . import frames
from .errors import RpcError

if TYPE_CHECKING:
    from speckv.v1 import decoder_pb2 as dpb

    from .kv import Fp8Attention, HeadRange

DTYPES: dict[int, tuple[str, np.dtype[Any]]] = {pb.DTYPE_BF16: ("bf16", np.dtype("<u2")),
                                                 pb.DTYPE_FP8_E4M3: ("fp8", np.dtype("u1"))}
MAX_DIM = 1 << 24  # any one dimension; products are checked against the caller's limits
PART_BYTES = 2 << 20  # a client's default payload per message (parts of layers)
MAX_MESSAGE_BYTES = 4 << 20  # gRPC's default message limit, which every message stays under
FRAMING_BYTES = 64 << 10  # room a message keeps under the limit for everything but its payload
# A sidecar's default payload per message: as large as the limit allows, so that a record fits one
# message (a stored 2-layer record of 2048 tokens is 3 MiB) and the receiver checks it where gRPC
# put it, instead of reassembling it (a copy of every byte). NOTE: a client keeps PART_BYTES: a
# sidecar may run with a smaller max_receive_bytes than a client can know of.
SIDECAR_PART_BYTES = MAX_MESSAGE_BYTES - FRAMING_BYTES


def fresh_buffer(n: int) -> memoryview:
    """A writable buffer of n bytes for parts to fill, not zeroed first: every byte is written
    before it is read (the assemblers hand a buffer on only once its parts covered it).
    NOTE: ``bytearray(n)`` zeroes it, a pass over every received byte that is then overwritten
    (~60% of reassembling a 3 MB record here)."""
    return np.empty(n, np.uint8).data


def bad(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def dtype_of(d: int) -> tuple[str, np.dtype[Any]]:
    if d not in DTYPES:
        raise bad(f"dtype {d} is not one of DTYPE_BF16, DTYPE_FP8_E4M3")
    return DTYPES[d]


def shape_of(s: pb.KVShape) -> tuple[int, int, int, int, int]:
    shape = (s.layers, s.kv, s.kv_heads, s.tokens, s.head_dim)
    if s.kv != 2 or min(s.layers, s.kv_heads, s.head_dim) < 1 or max(shape) > MAX_DIM:
        raise bad(f"shape {shape} is not a KV shape (layers >= 1, kv = 2, heads >= 1, head_dim >= 1)")
    return shape


def fp8_attention_of(m: pb.Fp8Attention, layers: int, dtype: int) -> "Fp8Attention | None":
    """A header's ``fp8_attention`` (None when unset), checked: FP8 KV only, one finite positive
    scale per layer for K and for V, a rounding set (INVALID_ARGUMENT otherwise)."""
    from .kv import Fp8Attention

    if not (m.k_scales or m.v_scales or m.rounding):
        return None
    if dtype != pb.DTYPE_FP8_E4M3:
        raise bad("fp8_attention is for FP8 KV only")
    if m.rounding not in (pb.FP8_ROUNDING_NEAREST, pb.FP8_ROUNDING_TOWARD_ZERO):
        raise bad(f"fp8_attention.rounding must be set (NEAREST or TOWARD_ZERO), not {m.rounding}")
    if not len(m.k_scales) == len(m.v_scales) == layers:
        raise bad(f"fp8_attention needs {layers} K and {layers} V scales, not {len(m.k_scales)} and {len(m.v_scales)}")
    try:
        return Fp8Attention(tuple(m.k_scales), tuple(m.v_scales), m.rounding == pb.FP8_ROUNDING_TOWARD_ZERO,
                            m.amx_tiles)
    except ValueError as e:
        raise bad(str(e)) from None


def fp8_attention_msg(fa: "Fp8Attention | None") -> pb.Fp8Attention | None:
    """``fp8_attention`` as the headers carry it (None: unset)."""
    if fa is None:
        return None
    return pb.Fp8Attention(k_scales=fa.k_scales, v_scales=fa.v_scales, rounding=(
        pb.FP8_ROUNDING_TOWARD_ZERO if fa.toward_zero else pb.FP8_ROUNDING_NEAREST), amx_tiles=fa.amx)


def heads_of(m: pb.HeadRange, kv_heads: int | None = None) -> "HeadRange | None":
    """A message's ``heads`` (None when unset), checked, and against its shape's ``kv_heads``
    where it has one (INVALID_ARGUMENT otherwise)."""
    from .kv import HeadRange

    if not (m.start or m.count or m.total):
        return None
    if kv_heads is not None and m.count != kv_heads:
        raise bad(f"heads.count {m.count} differs from shape.kv_heads {kv_heads}")
    try:
        return HeadRange(m.start, m.count, m.total)
    except ValueError as e:
        raise bad(str(e)) from None


def heads_msg(r: "HeadRange | None") -> pb.HeadRange | None:
    """A head range as the messages carry it (None: unset, all heads)."""
    return None if r is None else pb.HeadRange(start=r.start, count=r.count, total=r.total)


def kv_shape(shape: tuple[int, ...]) -> pb.KVShape:
    L, two, H, T, D = (int(v) for v in shape)
    return pb.KVShape(layers=L, kv=two, kv_heads=H, tokens=T, head_dim=D)


def layer_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    return math.prod(int(v) for v in shape[1:]) * itemsize  # NOTE: Python ints: exact, and no numpy call per part


def parts(n: int, part_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of the parts of ``n`` bytes (one empty part when n == 0)."""
    if n == 0:
        yield 0, 0
    for off in range(0, n, part_bytes):
        yield off, min(part_bytes, n - off)


# NOTE: proto float fields pass through Python floats, which quiet a signalling NaN
# (0x7f800001 -> 0x7fc00001): NaN scales are refused rather than altered in transit
NAN_SCALES = "fp8_scales must not be NaN (a NaN payload cannot cross a proto float field bit-exact)"


def scale_bits(values: Iterable[float]) -> tuple[int, ...]:
    """fp32 bit patterns of scales (compared as bits: -0.0 is not 0.0)."""
    return tuple(np.asarray(list(values), np.float32).view(np.uint32).tolist())


def layer_messages(index: int, layer: np.ndarray, dtype: int, shape: pb.KVShape, part_bytes: int,
                   scales: np.ndarray | None = None, token_start: int | None = None) -> Iterator[pb.KVLayer]:
    """The KVLayer parts of one layer ``(2, heads, tokens, dim)`` (no copy of the array
    beyond each part's bytes); with ``token_start``, of that layer's token range
    ``(2, heads, count, dim)`` starting there (KVLayer.token_start)."""
    for head, data, tail in _layer_parts(index, layer, dtype, shape, part_bytes, scales, token_start):
        head.data = bytes(data)
        if tail is not None:
            head.MergeFrom(tail)
        yield head


def layer_frames(index: int, layer: np.ndarray, dtype: int, shape: pb.KVShape, part_bytes: int,
                 scales: np.ndarray | None = None, token_start: int | None = None) -> Iterator[frames.Pieces]:
    """``layer_messages`` pre-serialised (``frames.layer_part``): each part's bytes are read
    where they lie in ``layer`` and copied once, when the frame is joined."""
    for head, data, tail in _layer_parts(index, layer, dtype, shape, part_bytes, scales, token_start):
        yield frames.layer_part(head, data, tail)


def _layer_parts(index: int, layer: np.ndarray, dtype: int, shape: pb.KVShape, part_bytes: int,
                 scales: np.ndarray | None, token_start: int | None = None,
                 ) -> Iterator[tuple[pb.KVLayer, memoryview, pb.KVLayer | None]]:
    """Each part's KVLayer fields before ``data`` (1-7), its data (a view), and the fields
    after it (``fp8_scales``, the token range; None when unset)."""
    _, dt = dtype_of(dtype)
    buf = np.ascontiguousarray(layer, dt).reshape(-1).data.cast("B")  # 1-D: a 0-token layer casts too
    n = buf.nbytes
    sp = [] if scales is None else [float(v) for v in np.asarray(scales, np.float32).ravel()]
    if any(v != v for v in sp):
        raise ValueError(NAN_SCALES)
    tail = None
    if sp or token_start is not None:
        tail = pb.KVLayer(fp8_scales=sp)
        if token_start is not None:
            tail.token_start, tail.token_count = token_start, layer.shape[2]
    pieces = list(parts(n, part_bytes))
    for k, (off, ln) in enumerate(pieces):
        yield (pb.KVLayer(layer=index, dtype=dtype, shape=shape, part_index=k, part_count=len(pieces),
                          byte_offset=off, layer_bytes=n), buf[off:off + ln], tail)


@dataclass
class LayerAssembler:
    """Rebuilds layers 0, 1, ... from KVLayer parts sent in order.

    Where the layers go: by default each into a fresh buffer (a writable array); with
    ``out`` (the whole KV, ``shape`` and the dtype's wire dtype), straight into
    ``out[layer]``; with ``borrow``, a layer sent in one part is its message's own bytes
    (a read-only array, nothing copied)."""

    dtype: int
    shape: tuple[int, int, int, int, int]
    next_layer: int = 0
    _buf: bytes | memoryview | None = None
    _part: int = 0
    _count: int = 0
    _scales: tuple[int, ...] = ()  # fp32 bit patterns of the layer's fp8_scales
    _filled: int = 0
    borrow: bool = False
    out: np.ndarray | None = None
    layer_size: int = field(init=False)  # bytes of one layer (read for every part)

    def __post_init__(self) -> None:
        self.layer_size = layer_bytes(self.shape, dtype_of(self.dtype)[1].itemsize)
        want = (self.shape, dtype_of(self.dtype)[1])
        if self.out is not None and (self.out.shape, self.out.dtype) != want:
            raise ValueError(f"out must be {want}, not {(self.out.shape, self.out.dtype)}")

    @property
    def done(self) -> bool:
        return self.next_layer == self.shape[0] and self._buf is None

    @property
    def starting(self) -> bool:
        """True when the next part must begin a new layer (nothing half-received)."""
        return self._buf is None

    def add(self, m: pb.KVLayer, payload: memoryview | None = None) -> tuple[int, np.ndarray, np.ndarray | None] | None:
        """Take one part (its data ``m.data``, or ``payload`` where the message was parsed
        without it: ``frames.Parsed``); returns ``(layer, array (2, H, T, D), scales (2,) | None)``
        when the layer is complete."""
        if m.dtype != self.dtype or shape_of(m.shape) != self.shape:
            raise bad(f"layer {m.layer}: dtype/shape differ from the header's")
        if m.layer != self.next_layer:
            raise bad(f"got layer {m.layer}, expected layer {self.next_layer} (layers are sent in order)")
        if m.layer_bytes != self.layer_size:
            raise bad(f"layer {m.layer}: layer_bytes {m.layer_bytes} != {self.layer_size} for this shape")
        data = m.data if payload is None else payload  # NOTE: read once: upb copies a bytes field on every access
        if self._buf is None:
            if m.part_index != 0 or not 1 <= m.part_count <= max(1, self.layer_size):
                raise bad(f"layer {m.layer}: first part has index {m.part_index} of {m.part_count}")
            self._buf, self._part, self._count = self._target(m, data), 0, m.part_count
            self._filled = 0
            self._scales = scale_bits(m.fp8_scales)
            if any(v != v for v in m.fp8_scales):
                raise bad(f"layer {m.layer}: {NAN_SCALES}")
        filled = self._fill(m, data)
        if filled < self.layer_size and self._part < self._count:
            return None
        if filled != self.layer_size or self._part != self._count:
            raise bad(f"layer {m.layer}: parts cover {filled} of {self.layer_size} bytes "
                      f"in {self._part} of {self._count} parts")
        return self._finish()

    def _target(self, m: pb.KVLayer, data: bytes | memoryview) -> bytes | memoryview:
        """Where the layer's parts go (see the class docstring)."""
        if self.out is not None:
            return memoryview(self.out[self.next_layer].reshape(-1).view(np.uint8))
        if self.borrow and m.part_count == 1 and m.byte_offset == 0 and len(data) == self.layer_size:
            return data  # NOTE: the message's own bytes: no copy
        return fresh_buffer(self.layer_size)

    def _fill(self, m: pb.KVLayer, data: bytes | memoryview) -> int:
        if m.part_index != self._part or m.part_count != self._count:
            raise bad(f"layer {m.layer}: part {m.part_index}/{m.part_count}, expected "
                      f"{self._part}/{self._count}")
        if m.byte_offset != self._filled or m.byte_offset + len(data) > self.layer_size:
            raise bad(f"layer {m.layer}: part at offset {m.byte_offset} (+{len(data)}) does not "
                      f"continue the layer")
        if scale_bits(m.fp8_scales) != self._scales:
            raise bad(f"layer {m.layer}: fp8_scales differ between parts")
        assert self._buf is not None
        if self._buf is not data:
            cast(memoryview, self._buf)[m.byte_offset:m.byte_offset + len(data)] = data
        self._filled = m.byte_offset + len(data)
        self._part += 1
        return self._filled

    def _finish(self) -> tuple[int, np.ndarray, np.ndarray | None]:
        name, dt = dtype_of(self.dtype)
        assert self._buf is not None
        if self.out is not None:
            arr = self.out[self.next_layer]
        else:
            arr = np.frombuffer(self._buf, dt).astype(dt.newbyteorder("="), copy=False).reshape(self.shape[1:])
        scales = None
        if name == "fp8":
            if len(self._scales) != 2:
                raise bad(f"layer {self.next_layer}: FP8 layers need 2 fp8_scales, got {len(self._scales)}")
            scales = np.array(self._scales, np.uint32).view(np.float32)
        elif self._scales:
            raise bad(f"layer {self.next_layer}: BF16 layers carry no fp8_scales")
        out = (self.next_layer, arr, scales)
        self.next_layer += 1
        self._buf, self._filled = None, 0
        return out


@dataclass
class RecordAssembler:
    """Rebuilds chunk records 0, 1, ... from Chunk parts sent in order."""

    n_chunks: int
    max_record: int
    next_index: int = 0
    _buf: memoryview | None = None
    _filled: int = 0

    @property
    def pending(self) -> int:
        """Bytes of the record being received (0 between records)."""
        return 0 if self._buf is None else len(self._buf)

    def first_part_size(self, c: dpb.Chunk) -> int | None:
        """The record size a first part announces (to reserve memory before copying)."""
        if self._buf is not None:
            return None
        if c.index != self.next_index or self.next_index >= self.n_chunks:
            raise bad(f"got chunk {c.index}, expected chunk {self.next_index} of {self.n_chunks}")
        if c.byte_offset != 0 or not 0 < c.record_bytes <= self.max_record:
            raise bad(f"chunk {c.index}: first part at offset {c.byte_offset} of a "
                      f"{c.record_bytes}-byte record (limit {self.max_record})")
        return int(c.record_bytes)

    def add(self, c: dpb.Chunk, payload: memoryview | None = None) -> bytes | memoryview | None:
        """Take one part (after ``first_part_size``; its bytes ``c.record``, or ``payload``: see
        LayerAssembler.add); returns the record when complete (a record sent in one part is
        that part's own bytes: nothing copied)."""
        data: bytes | memoryview = c.record if payload is None else payload  # NOTE: read once (upb copies)
        if self._buf is None:
            whole = c.byte_offset == 0 and 0 < len(data) == c.record_bytes and c.index == self.next_index
            if whole:
                self.next_index += 1
                return data
            self._buf, self._filled = fresh_buffer(c.record_bytes), 0
        if c.index != self.next_index or c.record_bytes != len(self._buf) or c.byte_offset != self._filled:
            raise bad(f"chunk {c.index}: part at offset {c.byte_offset} does not continue record "
                      f"{self.next_index} ({self._filled} of {len(self._buf)} bytes)")
        end = self._filled + len(data)
        if end > len(self._buf) or not data:
            raise bad(f"chunk {c.index}: part overruns its {len(self._buf)}-byte record or is empty")
        self._buf[self._filled:end] = data
        self._filled = end
        if end < len(self._buf):
            return None
        rec, self._buf = self._buf, None
        self.next_index += 1
        return rec
