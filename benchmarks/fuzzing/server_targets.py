"""The stream targets of the sidecars: mutated and random Transfer streams to the
decoder, mutated and random Submit streams to the encoder (which forwards to the
decoder), random bytes as the serialized requests of every method.

Every call must end with a gRPC status other than UNKNOWN and INTERNAL within its
deadline; a transfer reported OK must be fetchable and bit-exact; after every input
both in-flight byte budgets must drain back to 0 and no sidecar may have logged an
error.
"""

from __future__ import annotations

import contextlib
import random
from typing import Callable

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from speckv.client.client import submit_requests
from speckv.coder.codec import Fp8KV
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import encoder_pb2 as epb

from .findings import Finding
from .mutate import flip_bit, mutate_record, mutate_record_list
from .query_targets import t_decoder_fetch, t_decoder_query
from .server_env import MODEL, REQUEST_TYPES, ServerEnv, TBase
from .server_mutate import (
    mutate_layer,
    mutate_messages,
    mutate_submit_header,
    mutate_trailer,
    mutate_transfer_header,
    random_layer,
    random_transfer_message,
    raw_payload,
    tweak_transfer_message,
)

OK = grpc.StatusCode.OK


def _mutated_transfer(env: ServerEnv, rng: random.Random, b: TBase, rid: str, part: int) -> list:
    """The Transfer stream of ``b`` with one thing changed: a record's bytes, the record
    list, header fields, the trailer, or the message sequence (5 %: unchanged)."""
    header = records = trailer = None
    r = rng.random()
    if r < 0.3:
        k = rng.randrange(len(b.records))
        records = list(b.records)
        records[k] = mutate_record(rng, records[k], env.donors, b.fields[1 + k], 0.7)
    elif r < 0.4:
        records = mutate_record_list(rng, b.records, env.donors, b.fields[1:], 0.7)
    elif r < 0.6:
        header = dpb.TransferHeader()
        header.CopyFrom(b.header)
        header.request_id = rid
        for _ in range(rng.randint(1, 2)):
            mutate_transfer_header(rng, header, env.donors)
    elif r < 0.7:
        trailer = dpb.TransferTrailer()
        trailer.CopyFrom(b.trailer)
        mutate_trailer(rng, trailer)
    msgs = env.transfer_messages(b, rid, part, header, records, trailer)
    if 0.7 <= r < 0.95:
        msgs = mutate_messages(rng, msgs, lambda m: tweak_transfer_message(rng, m, env.donors),
                               lambda: random_transfer_message(rng, env.donors))
    return msgs


def t_decoder_transfer(env: ServerEnv, rng: random.Random) -> str:
    """Mutated valid Transfer streams (stored 92 %, speckv 8 %: the decoder runs its
    predictor, ~0.1-0.2 s, on every speckv stream whose header passes)."""
    speckv = rng.random() >= 0.92
    name = rng.choice(("speckv-bf16", "speckv-fp8") if speckv else ("stored-bf16", "stored-fp8"))
    b = env.bases[name]
    part = rng.choices((1 << 20, 4096, 700), weights=(70, 20, 10))[0]
    msgs = _mutated_transfer(env, rng, b, env.new_id("tr"), part)
    call = env.transfer(msgs)
    if call.code == OK:
        if not call.responses or call.responses[-1].WhichOneof("kind") != "result":
            raise Finding("crash", "Transfer OK without a final TransferResult")
        env.consume(msgs[0].header.request_id, b.bits, b.scales, f"{name} transfer", rng)
    env.check_clean()
    return call.code.name


def t_decoder_transfer_random(env: ServerEnv, rng: random.Random) -> str:
    """Random TransferRequest sequences (sometimes behind a valid header)."""
    msgs = []
    if rng.random() < 0.4:
        b = env.bases[rng.choice(("stored-bf16", "stored-fp8")) if rng.random() < 0.9 else "speckv-bf16"]
        msgs = env.transfer_messages(b, env.new_id("trr"), 1 << 20)[:1]
    msgs += [random_transfer_message(rng, env.donors) for _ in range(rng.randint(0 if msgs else 1, 6))]
    call = env.transfer(msgs)
    if call.code == OK:
        raise Finding("corrupt", "a random Transfer stream was accepted")
    env.check_clean()
    return call.code.name


def _submit_kv(env: ServerEnv, rng: random.Random, fp8: bool, mutate: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Copies of the real KV's bits (and FP8 scales), with a few bits flipped and an odd
    scale when ``mutate`` (then that is the KV that must arrive)."""
    bits = (env.fp8.codes if fp8 else env.kv_bf16).copy()
    scales = env.fp8.scales.copy() if fp8 else None
    if mutate:
        for _ in range(rng.randint(1, 3)):
            bits = flip_bit(rng, bits)
        if fp8 and rng.random() < 0.5:
            # NOTE: no NaN: the client refuses NaN scales before any call (a proto float
            # cannot carry a NaN's payload); the layer mutations send them to the encoder
            scales[rng.randrange(scales.shape[0]), rng.randrange(2)] = rng.choice(
                (0.0, -1.0, float("inf"), 1e-45, 3.4e38, -0.0))
    return bits, scales


def _mutated_submit(env: ServerEnv, rng: random.Random, msgs: list, r: float) -> list:
    """Header fields (r < 0.45), the message sequence (r < 0.75), or random layers."""
    addresses = (env.daddr + "0", env.eaddr)

    def tweak(m: epb.SubmitRequest) -> None:
        if m.WhichOneof("kind") == "layer":
            mutate_layer(rng, m.layer)
        else:
            mutate_submit_header(rng, m.header, addresses, env.pin)

    if r < 0.45:
        hdr = epb.SubmitRequest()
        hdr.CopyFrom(msgs[0])
        for _ in range(rng.randint(1, 2)):
            mutate_submit_header(rng, hdr.header, addresses, env.pin)
        return [hdr] + msgs[1:]
    if r < 0.75:
        return mutate_messages(rng, msgs, tweak)
    return msgs[:rng.randint(0, 1)] + [random_layer(rng) for _ in range(rng.randint(0, 4))]


def _scales_as_sent(msgs: list, scales: np.ndarray) -> None:
    """A layer sent whole with two other valid scales is another KV, not a broken one:
    ``scales`` becomes what the first part of each layer carries."""
    seen = set()
    for m in msgs:
        lay = m.layer
        if m.WhichOneof("kind") == "layer" and lay.part_index == 0 and lay.layer < len(scales) \
                and lay.layer not in seen:
            seen.add(lay.layer)
            if len(lay.fp8_scales) == 2:
                scales[lay.layer] = np.array(lay.fp8_scales, np.float32)


def t_encoder_submit(env: ServerEnv, rng: random.Random) -> str:
    """Mutated and random Submit streams to the encoder (which forwards to the decoder)."""
    fp8 = rng.random() < 0.3
    encoding = "speckv" if rng.random() < 0.08 else "stored"
    r = rng.random()
    bits, scales = _submit_kv(env, rng, fp8, r < 0.15)
    kv = Fp8KV(bits, scales) if fp8 else bits
    part = rng.choices((2 << 20, 4096, 333), weights=(70, 25, 5))[0]
    msgs = list(submit_requests(env.new_id("sb"), kv, env.ids, env.daddr, MODEL, encoding, part_bytes=part))
    if 0.15 <= r < 0.85:
        msgs = _mutated_submit(env, rng, msgs, r)
    if fp8:
        _scales_as_sent(msgs, scales)
    # an unreachable decoder address may legitimately run into the deadline
    may_timeout = any(m.WhichOneof("kind") == "header" and m.header.decoder_address != env.daddr for m in msgs)
    call = env.call(lambda: env.estub.Submit(iter(msgs), timeout=30.0), 30.0, expect_timeout=may_timeout)
    if call.code == OK:
        env.consume(msgs[0].header.request_id, bits, scales, f"{encoding} submit", rng)
    env.check_clean()
    return call.code.name


def _valid_request(env: ServerEnv, rng: random.Random, method: str) -> Message:
    """A valid request message of ``method`` (one message of a stream)."""
    if method == "Transfer":
        return rng.choice(env.transfer_messages(env.bases["stored-bf16"], env.new_id("raw"), 1 << 20))
    if method == "Submit":
        return epb.SubmitRequest(header=epb.SubmitHeader(request_id=env.new_id("raw"), decoder_address=env.daddr,
                                                         model_id=MODEL, dtype=1))
    return REQUEST_TYPES[method](request_id=env.new_id("raw"))


def _fetch_outlasts(env: ServerEnv, req: bytes, deadline: float) -> bool:
    """Whether the FetchKV request ``req`` (if it parses) asks to wait past ``deadline``."""
    with contextlib.suppress(DecodeError):
        w = dpb.FetchKVRequest.FromString(req).wait_timeout_ms
        return env.fetch_wait(w) >= 0.9 * deadline
    return False


def t_raw_bytes(env: ServerEnv, rng: random.Random) -> str:
    """Random bytes as the serialized request(s) of every method."""
    path = rng.choice(list(env.raw))
    method = path.rsplit("/", 1)[1]
    streaming = env.raw[path][0][0] == "s"
    reqs = [raw_payload(rng, lambda: _valid_request(env, rng, method))
            for _ in range(rng.randint(0, 3) if streaming else 1)]
    deadline = 5.0
    expect_timeout = method == "FetchKV" and _fetch_outlasts(env, reqs[0], deadline)
    call = env.call(lambda: env.raw_call(path, reqs, deadline), deadline, expect_timeout)
    env.check_clean()
    return f"{method}:{call.code.name}"


SERVER_TARGETS: dict[str, Callable[[ServerEnv, random.Random], str]] = {
    "decoder.transfer": t_decoder_transfer, "decoder.transfer_random": t_decoder_transfer_random,
    "encoder.submit": t_encoder_submit, "decoder.fetch": t_decoder_fetch, "decoder.query": t_decoder_query,
    "raw.bytes": t_raw_bytes,
}
