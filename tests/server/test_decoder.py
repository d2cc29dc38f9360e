"""DecoderService.Transfer driven directly (as a foreign encoder would): a
hand-built stored stream in many record parts is acknowledged and rebuilt bit
for bit; malformed headers and records, corruption, duplicate ids, the
transfer-count limit and the lease each end with their precise status."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from server_helpers import (
    MODEL,
    WAIT,
    Gate,
    Pair,
    assert_same_kv,
    chunk_requests,
    raw_transfer,
    rid,
    status_or_none,
    stored_stream,
    trailer_request,
    wait_until,
)

from speckv.client.client import RpcFailed
from speckv.coder import container as ct
from speckv.coder.codec import bf16_bits
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb
from speckv.v1 import decoder_pb2_grpc as dgrpc

S = dpb.TransferState
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def stream(pair, prompts, embedded_session):
    """``(request id, header request, chunk records, bits, ids)`` of a stored stream of the short prompt."""
    ids, kv = prompts("short")
    bits = bf16_bits(kv)
    r = rid("raw")
    header, recs = stored_stream(pair.decoder.service.rt.codec, r, bits, ids,
                                 bytes.fromhex(embedded_session.predictor.pin))
    return r, header, recs, bits, ids


def _transfer_fails(pair, reqs, code=INVALID, *words: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        raw_transfer(pair.daddr, reqs)
    e = ei.value
    assert e.code() == code, (e.code(), e.details())
    for w in words:
        assert w in e.details(), (w, e.details())
    return e


def test_stored_stream_in_record_parts_is_acked_and_bit_exact(pair, stream):
    r, header, recs, bits, _ = stream
    assert len(recs) == 15 and all(len(rec) > 7000 for rec in recs)
    reqs = [header] + chunk_requests(recs, part_bytes=7000) + [trailer_request(bits)]  # records in 3-5 parts
    resps = raw_transfer(pair.daddr, reqs)
    acks = [m.chunk_ack for m in resps[:-1]]
    assert all(m.WhichOneof("kind") == "chunk_ack" for m in resps[:-1])
    assert [a.index for a in acks] == list(range(15))
    wire = ct.HEADER_LEN + sum(len(rec) for rec in recs)
    running = ct.HEADER_LEN
    for a, rec in zip(acks, recs, strict=True):
        running += len(rec)
        assert a.bytes_received == running
    result = resps[-1].result
    assert resps[-1].WhichOneof("kind") == "result"
    assert result.status.code == pb.STATUS_CODE_OK
    assert (result.raw_bytes, result.wire_bytes, result.chunks) == (bits.nbytes, wire, 15)
    assert pair.dec.status(r).state == S.TRANSFER_STATE_READY
    assert_same_kv(pair.dec.fetch(r, wait=WAIT, timeout=WAIT), bits)


def test_empty_stream(pair):
    _transfer_fails(pair, [], INVALID, "first message", "TransferHeader")


def test_first_message_not_a_header(pair, stream):
    _, _, recs, _, _ = stream
    _transfer_fails(pair, chunk_requests(recs), INVALID, "first message", "TransferHeader")


def test_header_record_garbage(pair, stream):
    r, header, _, _, _ = stream
    header.header.header_record = b"\x00garbage" * 10
    _transfer_fails(pair, [header], INVALID)
    assert status_or_none(pair.dec, r) is None


def test_header_record_with_trailing_bytes(pair, stream):
    _, header, _, _, _ = stream
    header.header.header_record += b"\x00"
    _transfer_fails(pair, [header], INVALID, "trailing")


def test_header_record_disagrees_with_the_header(pair, stream, prompts):
    _, header, _, _, _ = stream
    ids, kv = prompts("medium")  # a header record of another shape
    h = pair.decoder.service.rt.codec.stream_header(True, kv.shape, ids, 2, stored=True)
    header.header.header_record = ct.pack_header(h)
    _transfer_fails(pair, [header], INVALID, "disagrees")


def test_prompt_other_than_the_header_records(pair, stream):
    _, header, _, _, _ = stream
    ids = header.header.prompt_token_ids
    ids[0] = ids[0] + 1  # same length, another prompt: its digest differs
    _transfer_fails(pair, [header], INVALID)


def test_bad_header_fields(pair, stream):
    _, header, _, _, _ = stream
    for mutate, code, word in [
        (lambda h: setattr(h, "request_id", ""), INVALID, "request_id"),
        (lambda h: setattr(h, "dtype", pb.DTYPE_UNSPECIFIED), INVALID, "dtype"),
        (lambda h: setattr(h.shape, "kv", 3), INVALID, "KV shape"),
    ]:
        bad = dpb.TransferRequest()
        bad.CopyFrom(header)
        mutate(bad.header)
        _transfer_fails(pair, [bad], code, word)


def test_header_only_is_cut_short(pair, stream):
    r, header, _, _, _ = stream
    _transfer_fails(pair, [header], INVALID, "stream ended after 0 of 15 chunk records")
    st = pair.dec.status(r)
    assert st.state == S.TRANSFER_STATE_FAILED and st.status.code == pb.STATUS_CODE_INVALID_ARGUMENT
    wait_until(lambda: pair.decoder.service.budget.used == 0)


def test_chunks_out_of_order(pair, stream):
    r, header, recs, _, _ = stream
    second = [m for m in chunk_requests(recs[:2]) if m.chunk.index == 1]
    _transfer_fails(pair, [header] + second, INVALID, "got chunk 1, expected chunk 0")
    assert pair.dec.status(r).state == S.TRANSFER_STATE_FAILED


def test_second_header(pair, stream):
    _, header, recs, _, _ = stream
    _transfer_fails(pair, [header] + chunk_requests(recs[:2]) + [header], INVALID, "only chunk messages")


def test_record_parts_not_contiguous(pair, stream):
    _, header, recs, _, _ = stream
    parts = chunk_requests(recs[:1], part_bytes=4096)
    parts[1].chunk.byte_offset += 1
    _transfer_fails(pair, [header] + parts, INVALID, "does not continue record")


def test_record_part_overruns_its_record(pair, stream):
    _, header, recs, _, _ = stream
    parts = chunk_requests(recs[:1], part_bytes=4096)
    parts[-1].chunk.record += b"\x00"
    _transfer_fails(pair, [header] + parts, INVALID, "overruns")


def test_record_larger_than_the_limit(pair, stream):
    _, header, _, _, _ = stream
    huge = dpb.TransferRequest(chunk=dpb.Chunk(index=0, record=b"\x00" * 16, byte_offset=0,
                                               record_bytes=2 << 30))
    _transfer_fails(pair, [header, huge], INVALID, "limit")


def test_record_of_the_wrong_length(pair, stream):
    """A whole record sent as a longer one: its own length field disagrees."""
    _, header, recs, _, _ = stream
    rec = recs[0] + b"\x00" * 8
    reqs = [header, dpb.TransferRequest(chunk=dpb.Chunk(index=0, record=rec, byte_offset=0,
                                                        record_bytes=len(rec)))]
    _transfer_fails(pair, reqs, INVALID)


def test_corrupted_record_is_data_loss(pair, stream):
    r, header, recs, _, _ = stream
    bad = bytearray(recs[3])
    bad[len(bad) // 2] ^= 0x10  # one bit flipped in transit
    before = pair.decoder.metrics.registry.get_sample_value(
        "speckv_integrity_failures_total", {"role": "decoder", "model": MODEL, "kind": "crc32"}) or 0
    _transfer_fails(pair, [header] + chunk_requests(recs[:3] + [bytes(bad)] + recs[4:]),
                    grpc.StatusCode.DATA_LOSS)
    st = pair.dec.status(r)
    assert st.state == S.TRANSFER_STATE_FAILED and st.status.code == pb.STATUS_CODE_CHECKSUM_ERROR
    after = pair.decoder.metrics.registry.get_sample_value(
        "speckv_integrity_failures_total", {"role": "decoder", "model": MODEL, "kind": "crc32"})
    assert after == before + 1
    wait_until(lambda: pair.decoder.service.budget.used == 0)


class _Held:
    """A raw Transfer that sent its header and ``sent`` chunks and then waits (a thread
    drains its responses); ``finish()`` lets the rest go and returns the responses or error."""

    def __init__(self, daddr: str, header, recs, sent: int, trailer=None) -> None:
        self.gate = Gate([header] + chunk_requests(recs) + ([trailer] if trailer else []), after=1 + sent)
        self.channel = grpc.insecure_channel(daddr)
        self.call = dgrpc.DecoderServiceStub(self.channel).Transfer(iter(self.gate), timeout=WAIT)
        self.out: list = []
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()
        assert self.gate.reached.wait(WAIT)

    def _drain(self) -> None:
        try:
            self.out.extend(self.call)
        except grpc.RpcError as e:
            self.out.append(e)

    def finish(self, timeout: float = WAIT):
        self.gate.open()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the held transfer did not end"
        self.channel.close()
        return self.out


def test_same_id_while_live_is_already_exists(pair, stream):
    r, header, recs, bits, _ = stream
    held = _Held(pair.daddr, header, recs, sent=2, trailer=trailer_request(bits))
    try:
        wait_until(lambda: (s := status_or_none(pair.dec, r)) and s.chunks_received == 2)
        _transfer_fails(pair, [header], grpc.StatusCode.ALREADY_EXISTS, "already in progress")
    finally:
        out = held.finish()
    assert out[-1].result.status.code == pb.STATUS_CODE_OK  # the first one is unharmed
    assert_same_kv(pair.dec.fetch(r, wait=WAIT, timeout=WAIT), bits)


def test_max_transfers_is_resource_exhausted(sidecars, prompts, embedded_session):
    p = Pair.start(sidecars, decoder={"max_transfers": 1})
    try:
        ids, kv = prompts("short")
        bits = bf16_bits(kv)
        pin = bytes.fromhex(embedded_session.predictor.pin)
        codec = p.decoder.service.rt.codec
        h1, recs = stored_stream(codec, rid("slot1"), bits, ids, pin)
        h2, _ = stored_stream(codec, rid("slot2"), bits, ids, pin)
        held = _Held(p.daddr, h1, recs, sent=1, trailer=trailer_request(bits))
        try:
            wait_until(lambda: status_or_none(p.dec, h1.header.request_id))
            _transfer_fails(p, [h2], grpc.StatusCode.RESOURCE_EXHAUSTED, "max_transfers")
        finally:
            out = held.finish()
        assert out[-1].result.status.code == pb.STATUS_CODE_OK
        assert_same_kv(p.dec.fetch(h1.header.request_id, wait=WAIT, timeout=WAIT), bits)
    finally:
        p.stop()


def test_lease_expires_idle_transfers(sidecars, prompts, embedded_session):
    """An unfetched READY transfer and a stalled RECEIVING one both expire after the
    lease; the stalled sender hears DEADLINE_EXCEEDED at once, not at its own deadline."""
    p = Pair.start(sidecars, decoder={"lease_s": 0.6})
    try:
        ids, kv = prompts("short")
        bits = bf16_bits(kv)
        pin = bytes.fromhex(embedded_session.predictor.pin)
        codec = p.decoder.service.rt.codec
        h1, recs = stored_stream(codec, rid("lease-ready"), bits, ids, pin)
        reqs = [h1] + chunk_requests(recs) + [trailer_request(bits)]
        assert raw_transfer(p.daddr, reqs)[-1].result.status.code == pb.STATUS_CODE_OK
        assert p.dec.status(h1.header.request_id).state == S.TRANSFER_STATE_READY

        h2, recs2 = stored_stream(codec, rid("lease-stalled"), bits, ids, pin)
        held = _Held(p.daddr, h2, recs2, sent=3)
        try:
            for h in (h1, h2):
                st = wait_until(lambda h=h: (s := p.dec.status(h.header.request_id)).state == S.TRANSFER_STATE_FAILED
                                and s, timeout=10, what="the lease to expire")
                assert st.status.code == pb.STATUS_CODE_DEADLINE_EXCEEDED and "lease" in st.status.message
            held.thread.join(10)
            assert not held.thread.is_alive(), "the stalled sender was not told"
            err = held.out[-1]
            assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "lease" in err.details()
        finally:
            held.finish()
        wait_until(lambda: p.decoder.service.budget.used == 0)
        wait_until(lambda: p.decoder.metrics.registry.get_sample_value(
            "speckv_inflight_transfers", {"role": "decoder", "model": MODEL}) == 0, what="the gauge to drop")
        with pytest.raises(RpcFailed) as ei:
            p.dec.fetch(h1.header.request_id, wait=1, timeout=WAIT)
        assert ei.value.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
    finally:
        p.stop()


# -- the whole-transfer digest (TransferTrailer) ------------------------------------

def _renamed(header: dpb.TransferRequest, request_id: str) -> dpb.TransferRequest:
    """A copy of a (shared fixture's) header request under another request id."""
    out = dpb.TransferRequest()
    out.CopyFrom(header)
    out.header.request_id = request_id
    return out


def test_stream_without_trailer_is_refused(pair, stream):
    r, header, recs, _, _ = stream
    r2 = rid("no-trailer")
    header = _renamed(header, r2)
    _transfer_fails(pair, [header] + chunk_requests(recs), INVALID, "TransferTrailer")
    assert pair.dec.status(r2).state == S.TRANSFER_STATE_FAILED


def test_wrong_whole_transfer_digest_is_data_loss_and_never_served(pair, stream):
    _, header, recs, bits, _ = stream
    r2 = rid("bad-trailer")
    header = _renamed(header, r2)
    bad = trailer_request(bits, digest=bytes(16))  # every chunk is intact; the whole is not
    _transfer_fails(pair, [header] + chunk_requests(recs) + [bad], grpc.StatusCode.DATA_LOSS,
                    "whole-transfer digest")
    with pytest.raises(RpcFailed) as e:
        pair.dec.fetch(r2, wait=1, timeout=WAIT)  # no retry replaced it within the wait
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_trailer_must_come_last(pair, stream):
    _, header, recs, bits, _ = stream
    header = _renamed(header, rid("early-trailer"))
    _transfer_fails(pair, [header] + chunk_requests(recs[:2]) + [trailer_request(bits)], INVALID,
                    "trailer after 2 of 15")


def test_verified_only_fetch_waits_for_the_whole_transfer(pair, stream):
    _, header, recs, bits, _ = stream
    r2 = rid("verified-only")
    header = _renamed(header, r2)
    gate = Gate([header] + chunk_requests(recs) + [trailer_request(bits)], after=1 + 14)
    with ThreadPoolExecutor(2) as pool:
        fut = pool.submit(lambda: list(pair.dec.fetch_layers(r2, wait=WAIT, timeout=WAIT, verified_only=True)))
        xfer = pool.submit(raw_transfer, pair.daddr, gate)
        wait_until(lambda: status_or_none(pair.dec, r2) is not None
                   and status_or_none(pair.dec, r2).chunks_decoded == 14, WAIT, what="14 chunks decoded")
        time.sleep(0.3)
        assert not fut.done()  # 14 of 15 chunks decoded, still nothing handed out
        gate.open()
        assert xfer.result(WAIT)[-1].result.status.code == pb.STATUS_CODE_OK
        layers = fut.result(WAIT)
    assert [k for k, _, _ in layers] == list(range(bits.shape[0]))
    assert all(np.array_equal(a, bits[k]) for k, a, _ in layers)


def test_max_transfers_per_peer(sidecars, prompts, embedded_session):
    p = Pair.start(sidecars, decoder={"max_transfers_per_peer": 1})
    try:
        ids, kv = prompts("short")
        bits = bf16_bits(kv)
        pin = bytes.fromhex(embedded_session.predictor.pin)
        codec = p.decoder.service.rt.codec
        h1, recs = stored_stream(codec, rid("peer1"), bits, ids, pin)
        h2, _ = stored_stream(codec, rid("peer2"), bits, ids, pin)
        held = _Held(p.daddr, h1, recs, sent=1, trailer=trailer_request(bits))
        try:
            wait_until(lambda: status_or_none(p.dec, h1.header.request_id))
            _transfer_fails(p, [h2], grpc.StatusCode.RESOURCE_EXHAUSTED, "max_transfers_per_peer")
        finally:
            out = held.finish()
        assert out[-1].result.status.code == pb.STATUS_CODE_OK  # the first one is unharmed
    finally:
        p.stop()


def test_a_decode_trims_the_heap_only_beside_a_predictor_pass(monkeypatch):
    from speckv import heap
    from speckv.server.decoder import _decode_run

    class Codec:
        def decode_run(self, h, chunks, mu):
            return np.zeros(1, np.uint16)

    trims: list[int] = []
    monkeypatch.setattr(heap, "release_free", lambda: trims.append(heap.passes_running()))
    monkeypatch.setattr(heap, "_passes", 0)  # NOTE: another test's sidecar may still be ending a pass
    _decode_run(Codec(), None, [], None)
    assert trims == []  # a warm transfer's decode keeps its freed blocks for the next buffers
    with heap.predictor_pass():
        _decode_run(Codec(), None, [], None)
    assert trims == [1]
