"""Mutation of the sidecars' request messages: TransferHeader and SubmitHeader
fields, chunk parts, trailers, KV layers, random TransferRequests, and message
sequences (dropped, duplicated, swapped, cut off, inserted, tweaked)."""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

from google.protobuf.message import Message

from speckv.coder import container as ct
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import encoder_pb2 as epb

from .mutate import (
    HEADER_FIELDS,
    INTERESTING,
    SMALL_INTERESTING,
    fix_crcs,
    mutate_bytes,
    mutate_record,
    odd_string,
    rand_bytes,
    random_wire_message,
    restructure,
)
from .server_env import MODEL

ODD_ENUMS = (0, 1, 2, 3, 255, 2**31 - 1, -1)
ODD_TOKENS = (-1, 0, 7, 49151, 49152, 2**31, 2**63 - 1, -(2**63))
SHAPE_FIELDS = ("layers", "kv", "kv_heads", "tokens", "head_dim")
COMMON = ("request_id", "model_id", "dtype", "shape", "prompt")  # fields both headers have


def mutate_shape(rng: random.Random, shape: pb.KVShape) -> None:
    """One dimension of a KVShape: an interesting value, or one more."""
    name = rng.choice(SHAPE_FIELDS)
    setattr(shape, name, rng.choice(SMALL_INTERESTING) if rng.random() < 0.7
            else (getattr(shape, name) + 1) % 2**32)


def mutate_prompt(rng: random.Random, field: Any) -> None:
    """A repeated prompt_token_ids field: an odd token, another prompt of the same
    length, one token more or less, or a new prompt (empty, or over the limits)."""
    ids = list(field)
    r = rng.random()
    if r < 0.3 and ids:
        ids[rng.randrange(len(ids))] = rng.choice(ODD_TOKENS)
    elif r < 0.5 and ids:
        ids[rng.randrange(len(ids))] ^= 1
    elif r < 0.7:
        ids.append(rng.choice((1, 5)))
    elif r < 0.85:
        ids = ids[:-1]
    else:
        n = rng.choice((0, 1, 2, 131073, 200_000))
        ids = [rng.randrange(49152) for _ in range(n)] if n < 10 else [1] * n
    del field[:]
    field.extend(ids)


def _mutate_common(rng: random.Random, hdr: Any, name: str) -> None:
    """A field both TransferHeader and SubmitHeader have."""
    if name == "request_id":
        hdr.request_id = odd_string(rng)
    elif name == "model_id":
        hdr.model_id = rng.choice(("", MODEL.lower(), MODEL.upper(), MODEL + " ", odd_string(rng)))
    elif name == "dtype":
        hdr.dtype = rng.choice(ODD_ENUMS)
    elif name == "shape":
        mutate_shape(rng, hdr.shape)
    else:
        mutate_prompt(rng, hdr.prompt_token_ids)


def mutate_transfer_header(rng: random.Random, hdr: dpb.TransferHeader, donors: Sequence[bytes]) -> None:
    """One field of a TransferHeader."""
    name = rng.choice(COMMON + ("pin", "record", "record", "clear"))
    if name in COMMON:
        _mutate_common(rng, hdr, name)
    elif name == "pin":
        hdr.predictor_pin = rng.choice((b"", rng.randbytes(32), bytes(hdr.predictor_pin)[:31], bytes(33)))
    elif name == "record":
        hdr.header_record = mutate_record(rng, bytes(hdr.header_record), donors, HEADER_FIELDS, 0.7)
    else:
        hdr.ClearField(rng.choice(("shape", "header_record", "prompt_token_ids", "predictor_pin")))


def mutate_submit_header(rng: random.Random, hdr: epb.SubmitHeader, addresses: Sequence[str], pin: str) -> None:
    """One field of a SubmitHeader (``addresses``: decoder addresses to try besides odd ones)."""
    name = rng.choice(COMMON + ("address", "scales", "expected_pin", "encoding", "clear"))
    if name in COMMON:
        _mutate_common(rng, hdr, name)
    elif name == "address":
        hdr.decoder_address = rng.choice(("", "nohost", "127.0.0.1:1", "[::1]:1", "localhost:1", ":", "a:b",
                                          "256.0.0.1:80", "x:1##", odd_string(rng), *addresses))
    elif name == "scales":
        del hdr.fp8_scales[:]
        hdr.fp8_scales.extend([rng.choice((0.0, 1.0, float("nan"), float("inf"), -1.0))
                               for _ in range(rng.choice((1, 2, 60, 61)))])
    elif name == "expected_pin":
        hdr.expected_predictor_pin = rng.choice((b"", rng.randbytes(32), bytes.fromhex(pin), b"\x00"))
    elif name == "encoding":
        hdr.encoding = rng.choice(ODD_ENUMS)
    else:
        hdr.ClearField(rng.choice(("shape", "decoder_address", "model_id", "dtype")))


def mutate_trailer(rng: random.Random, trailer: dpb.TransferTrailer) -> None:
    """The digest or the byte count of a TransferTrailer."""
    if rng.random() < 0.5:
        trailer.raw_digest = mutate_bytes(rng, trailer.raw_digest, max_ops=1)
    elif rng.random() < 0.5:
        trailer.raw_bytes = rng.choice(INTERESTING)
    else:
        trailer.raw_bytes = (trailer.raw_bytes + rng.choice((1, -1, 2**32))) % 2**64


def mutate_chunk(rng: random.Random, chunk: dpb.Chunk, donors: Sequence[bytes]) -> None:
    """One field of a chunk part: its index, offset, record size or bytes."""
    name = rng.choice(("index", "byte_offset", "record_bytes", "record"))
    if name == "record":
        chunk.record = mutate_bytes(rng, chunk.record, donors, max_ops=2)
    elif name == "index":
        chunk.index = rng.choice((chunk.index + 1, chunk.index - 1 if chunk.index else 5, 2**32 - 1))
    else:
        setattr(chunk, name, rng.choice(INTERESTING) if rng.random() < 0.6
                else (getattr(chunk, name) + rng.choice((1, -1))) % 2**64)


def mutate_layer(rng: random.Random, lay: pb.KVLayer) -> None:
    """One field of a KVLayer part."""
    f = rng.randrange(8)
    if f == 0:
        lay.layer = rng.choice(((lay.layer + 1) % 2**32, max(lay.layer - 1, 0), 2**32 - 1))
    elif f == 1:
        lay.dtype = rng.choice((0, 1, 2, 3))
    elif f == 2:
        mutate_shape(rng, lay.shape)
    elif f == 3:
        lay.part_index, lay.part_count = rng.choice((((lay.part_index + 1) % 2**32, lay.part_count), (0, 0),
                                                     (0, 2**32 - 1), (lay.part_index, (lay.part_count + 1) % 2**32)))
    elif f in (4, 5):
        name = ("byte_offset", "layer_bytes")[f - 4]
        setattr(lay, name, rng.choice(INTERESTING) if rng.random() < 0.5
                else (getattr(lay, name) + rng.choice((1, -1))) % 2**64)
    elif f == 6:
        d = bytes(lay.data)
        lay.data = rng.choice((d[:-1], d + b"\x00", b"", d[:len(d) // 2]))
    else:
        del lay.fp8_scales[:]
        lay.fp8_scales.extend([rng.choice((1.0, 0.0, float("nan"))) for _ in range(rng.choice((0, 1, 2, 3)))])


def random_layer(rng: random.Random) -> epb.SubmitRequest:
    """A SubmitRequest carrying a random KVLayer part."""
    return epb.SubmitRequest(layer=pb.KVLayer(
        layer=rng.randrange(3), dtype=rng.randrange(4), data=rng.randbytes(rng.randint(0, 100)),
        part_count=rng.randrange(3), layer_bytes=rng.choice(INTERESTING)))


def _random_transfer_header(rng: random.Random) -> dpb.TransferHeader:
    shape = pb.KVShape(layers=rng.choice((0, 1, 30, 31, 2**32 - 1)), kv=rng.choice((0, 2, 3)),
                       kv_heads=rng.choice((0, 3, 2**24)), tokens=rng.choice((0, 1, 5, 2**32 - 1)),
                       head_dim=rng.choice((0, 64, 2**24 + 1)))
    return dpb.TransferHeader(
        request_id=odd_string(rng), predictor_pin=rng.randbytes(rng.choice((0, 32))),
        model_id=rng.choice((MODEL, odd_string(rng))), dtype=rng.randrange(4), shape=shape,
        prompt_token_ids=[rng.randrange(-5, 60000) for _ in range(rng.randint(0, 6))],
        header_record=rng.choice((rng.randbytes(rng.randint(0, 120)), fix_crcs(ct.MAGIC + rng.randbytes(106)))))


def random_transfer_message(rng: random.Random, donors: Sequence[bytes]) -> dpb.TransferRequest:
    """A random TransferRequest of any kind (or none)."""
    k = rng.choice(("header", "chunk", "trailer", "fallback", "empty"))
    if k == "header":
        return dpb.TransferRequest(header=_random_transfer_header(rng))
    if k == "chunk":
        rec = rng.choice((rng.randbytes(rng.randint(0, 300)), rng.choice(donors), b""))
        return dpb.TransferRequest(chunk=dpb.Chunk(
            index=rng.choice((0, 1, 2, 14, 2**32 - 1)), record=rec,
            byte_offset=rng.choice((0, 0, 1, len(rec), 2**64 - 1)),
            record_bytes=rng.choice((len(rec), len(rec), 0, len(rec) + 1, 2**30, 2**64 - 1))))
    if k == "trailer":
        return dpb.TransferRequest(trailer=dpb.TransferTrailer(raw_digest=rng.randbytes(rng.choice((0, 16, 17))),
                                                               raw_bytes=rng.choice(INTERESTING)))
    if k == "fallback":
        return dpb.TransferRequest(fallback=dpb.Fallback(
            header_record=rng.choice((rng.randbytes(110), rng.choice(donors))), reason=odd_string(rng)))
    return dpb.TransferRequest()


def mutate_messages(rng: random.Random, msgs: Sequence[Message], tweak: Callable[[Message], None],
                    insert: Callable[[], Message] | None = None) -> list[Message]:
    """1..2 mutations of a message sequence: dropped, duplicated, swapped, cut off,
    one message tweaked in a copy (``tweak``), one inserted (``insert()``)."""
    out = list(msgs)
    for _ in range(rng.randint(1, 2)):
        op = rng.randrange(7 if insert is not None else 6)
        if op < 4:
            out = restructure(rng, out, op)
        elif op == 6:
            out.insert(rng.randrange(len(out) + 1), insert())
        elif out:
            k = rng.randrange(len(out))
            m = type(out[k])()
            m.CopyFrom(out[k])
            tweak(m)
            out[k] = m
    return out


def tweak_transfer_message(rng: random.Random, m: dpb.TransferRequest, donors: Sequence[bytes]) -> None:
    """One field of a TransferRequest, whatever its kind."""
    kind = m.WhichOneof("kind")
    if kind == "chunk":
        mutate_chunk(rng, m.chunk, donors)
    elif kind == "trailer":
        mutate_trailer(rng, m.trailer)
    elif kind == "header":
        mutate_transfer_header(rng, m.header, donors)


def raw_payload(rng: random.Random, valid: Callable[[], Message] | None) -> bytes:
    """Bytes sent as a serialized request: random, a mutated valid message
    (``valid()``), valid wire format of arbitrary fields, or over the 4 MiB limit."""
    r = rng.random()
    if r < 0.45:
        return rng.randbytes(rng.choice((0, 1, 2, 5, rng.randint(0, 300))))
    if r < 0.75 and valid is not None:
        return mutate_bytes(rng, valid().SerializeToString(), max_ops=2)
    if r < 0.98:
        return random_wire_message(rng)
    return rand_bytes(rng, 4_300_000)  # over the 4 MiB receive limit
