"""Pre-serialised messages for the bulk streams: each payload byte is copied once.

Building a message with a large bytes field (a part of a layer or a record, up to 4 MiB)
makes upb copy the payload into the message, and serialising it copies it again,
after the sender has already cut it out of its buffer (a third copy). Here the
serialised message is written directly: the fields before the payload as upb
writes them, the payload's tag and length, the payload gathered from the buffers
where it lies (one copy, in ``b"".join``), then the fields after it. Protobuf
writes the fields of a message in field-number order, so the result is exactly
``SerializeToString()`` of the same message (tests/test_frames.py checks it):
receivers, and the bytes on the wire, cannot tell. gRPC takes these bytes through
``serialize``, a request or response serializer that passes bytes through.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence, Union

from google.protobuf.message import Message

from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb

Buffer = Union[bytes, bytearray, memoryview]
Pieces = tuple[list[Buffer], int]  # buffers whose concatenation is a serialised message, and its length


def serialize(m: "Message | bytes") -> bytes:
    """A gRPC serializer for messages and pre-serialised frames alike."""
    return m if isinstance(m, bytes) else m.SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, n: int) -> bytes:
    """Tag and length of length-delimited field ``number`` holding ``n`` bytes."""
    return _varint(number << 3 | 2) + _varint(n)


def bytes_field(head: Message, number: int, payload: Sequence[Buffer], tail: Message | None = None) -> Pieces:
    """A message: ``head``'s fields (all numbered below ``number``), bytes field ``number``
    = the concatenation of ``payload`` (omitted when empty, as proto3 does), ``tail``'s fields
    (all numbered above it)."""
    n = _length(payload)
    out: list[Buffer] = [head.SerializeToString()]
    if n:
        out += [_field(number, n), *payload]
    if tail is not None:
        out.append(tail.SerializeToString())
    return out, _length(out)


def _length(out: Sequence[Buffer]) -> int:
    return sum(len(b) if isinstance(b, (bytes, bytearray)) else memoryview(b).nbytes for b in out)


def submessage(number: int, inner: Pieces, tail: Message | None = None) -> Pieces:
    """A message whose field ``number`` (a submessage, set: a oneof member) is ``inner``,
    followed by ``tail``'s fields (all numbered above it)."""
    pieces, n = inner
    out: list[Buffer] = [_field(number, n), *pieces]
    if tail is not None:
        out.append(tail.SerializeToString())
    return out, _length(out)


def join(p: Pieces) -> bytes:
    return b"".join(p[0])


def record_slices(pieces: Sequence[memoryview], part_bytes: int) -> Iterator[tuple[int, int, list[memoryview]]]:
    """``(offset, length, views)`` of each part of the record ``pieces`` hold (parts of at
    most ``part_bytes``; one empty part when it is empty): views into the pieces, no copy."""
    total = sum(len(p) for p in pieces)
    if total == 0:
        yield 0, 0, []
        return
    k, skip = 0, 0  # the piece the next part starts in, and how far into it
    for off in range(0, total, part_bytes):
        want, views = min(part_bytes, total - off), []
        while want:
            take = min(want, len(pieces[k]) - skip)
            views.append(pieces[k][skip:skip + take])
            want -= take
            skip += take
            if skip == len(pieces[k]):
                k, skip = k + 1, 0
        yield off, min(part_bytes, total - off), views


def chunk_part(index: int, views: Sequence[Buffer], offset: int, record_bytes: int, stored_reason: str) -> bytes:
    """``TransferRequest(chunk=Chunk(index, record=join(views), byte_offset, record_bytes,
    stored_reason)).SerializeToString()``."""
    inner = bytes_field(dpb.Chunk(index=index), 2, views,
                        dpb.Chunk(byte_offset=offset, record_bytes=record_bytes, stored_reason=stored_reason))
    return join(submessage(2, inner))


def layer_part(head: pb.KVLayer, data: Buffer, tail: pb.KVLayer | None) -> Pieces:
    """A KVLayer: ``head``'s fields 1-7, ``data``, then ``tail``'s (``fp8_scales``, the token
    range)."""
    return bytes_field(head, 8, [data], tail)


# -- reading: the payload as a view of the bytes received ----------------------------

class Parsed:
    """A received message parsed without its payload, and the payload: a read-only view
    into the bytes gRPC delivered (upb would copy it on parsing and again on every
    access). Attributes are the message's; ``payload`` is None when the message was
    parsed whole (then its own field holds the bytes)."""

    __slots__ = ("msg", "payload")

    def __init__(self, msg: Message, payload: memoryview | None) -> None:
        self.msg, self.payload = msg, payload

    def __getattr__(self, name: str) -> Any:
        return getattr(self.msg, name)


def payload_of(m: object) -> memoryview | None:
    """The payload a ``Parsed`` carries (None for a plain message)."""
    return m.payload if isinstance(m, Parsed) else None


def _varint_at(b: memoryview, i: int, hi: int) -> tuple[int, int] | None:
    n = shift = 0
    while i < hi and shift < 64:
        c = b[i]
        i += 1
        n |= (c & 0x7F) << shift
        if c < 0x80:
            return n, i
        shift += 7
    return None


def _skip(b: memoryview, wire: int, i: int, hi: int) -> tuple[int, int] | None:
    """(value start, end) of a field whose tag ends at ``i``; None when malformed or a group."""
    if wire == 0:
        v = _varint_at(b, i, hi)
        return None if v is None else (i, v[1])
    if wire in (1, 5):
        return i, i + (8 if wire == 1 else 4)
    if wire == 2:
        v = _varint_at(b, i, hi)
        return None if v is None else (v[1], v[1] + v[0])
    return None


def _locate(b: memoryview, lo: int, hi: int, number: int) -> tuple[int, int, int] | None:
    """(tag start, value start, end) of the one length-delimited field ``number`` in the
    message ``b[lo:hi]``; None when it is absent, repeated, of another wire type, or the
    message is malformed (the caller then lets upb parse it, and judge it)."""
    found, i = None, lo
    while i < hi:
        tag = _varint_at(b, i, hi)
        span = None if tag is None else _skip(b, tag[0] & 7, tag[1], hi)
        if tag is None or span is None or span[1] > hi:
            return None
        if tag[0] >> 3 == number:
            if tag[0] & 7 != 2 or found is not None:
                return None
            found = (i, span[0], span[1])
        i = span[1]
    return found


# the bulk messages: their submessage field and, in it, the payload (a bytes field)
PAYLOADS = {"speckv.v1.SubmitRequest": (2, 8), "speckv.v1.TransferRequest": (2, 2),
            "speckv.v1.FetchKVResponse": (1, 8)}


def parse(cls: type[Message], data: bytes) -> Any:
    """``cls.FromString(data)``; a bulk message (``PAYLOADS``) as a :class:`Parsed`."""
    spec = PAYLOADS.get(cls.DESCRIPTOR.full_name)
    return cls.FromString(data) if spec is None else split(cls, data, *spec)


def deserializer(cls: type[Message]) -> Any:
    """A gRPC response deserializer: ``parse`` for ``cls``."""
    return lambda data: parse(cls, data)


def split(cls: type[Message], data: bytes, path: int, number: int) -> Parsed:
    """``data`` (a serialised ``cls``) parsed without bytes field ``number`` of its submessage
    field ``path``, which comes back as a view: upb judges everything else (and the whole
    message, unsplit, when it is not of that plain form)."""
    b = memoryview(data)
    outer = _locate(b, 0, len(b), path)
    inner = None if outer is None else _locate(b, outer[1], outer[2], number)
    if outer is None or inner is None:
        return Parsed(cls.FromString(data), None)
    rest = (inner[0] - outer[1]) + (outer[2] - inner[2])  # the submessage less the payload field
    msg = cls.FromString(b"".join((b[:outer[0]], _field(path, rest), b[outer[1]:inner[0]], b[inner[2]:])))
    return Parsed(msg, b[inner[1]:inner[2]])
