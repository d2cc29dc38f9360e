"""Tensor parallelism through the sidecars: each rank submits its heads under one request
id (SubmitHeader.heads), the decoder keeps one transfer per range, and FetchKV serves any
range the decode engine's ranks ask for: one range as sent, several side by side, or a
slice of a wider one; every layer bit for bit, every head handed out once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from server_helpers import FETCH_WAIT, MODEL, WAIT, budgets_drain, raw_submit, rid, submit_list, wait_until

from speckv.client.client import RpcFailed
from speckv.coder.codec import Fp8KV, bf16_bits
from speckv.kv import HeadRange
from speckv.v1 import common_pb2 as pb
from speckv.v1 import decoder_pb2 as dpb

H = 3  # SmolLM2-135M's KV heads


def _part(kv, heads: HeadRange):
    if isinstance(kv, Fp8KV):
        return Fp8KV(np.ascontiguousarray(kv.codes[:, :, heads.start:heads.stop]), kv.scales)
    return kv[:, :, heads.start:heads.stop]


def _bits(kv) -> np.ndarray:
    return kv.codes if isinstance(kv, Fp8KV) else bf16_bits(kv)


def _submit_ranks(pair, r: str, kv, ids, ranges: list[HeadRange], **kw):
    """Every rank's Submit at once (as TP ranks do); their SubmitResults."""
    with ThreadPoolExecutor(len(ranges)) as pool:
        futs = [pool.submit(pair.enc.submit, r, _part(kv, h), ids, pair.daddr, MODEL, timeout=WAIT, heads=h, **kw)
                for h in ranges]
        return [f.result(timeout=WAIT) for f in futs]


def _passes(pair, side: str) -> tuple[float, float]:
    """(misses, hits) of one sidecar's mu cache so far (speckv_mu_cache_lookups_total)."""
    reg = getattr(pair, side).service.metrics.registry
    return tuple(sum(s.value for m in reg.collect() for s in m.samples
                     if s.name == "speckv_mu_cache_lookups_total" and s.labels.get("result") == r)
                 for r in ("miss", "hit"))


def _pad(kv):
    """``kv`` with one more token (a copy of its last): the KV of a prompt one token longer, for
    a pass of its own. The KV need not be the model's: coding is lossless on any KV."""
    if isinstance(kv, Fp8KV):
        return Fp8KV(np.concatenate([kv.codes, kv.codes[:, :, :, -1:]], axis=3), kv.scales)
    import torch

    return torch.cat([kv, kv[:, :, :, -1:]], dim=3)


def _fetch(pair, r: str, heads: HeadRange | None):
    return pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT, heads=heads)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_three_ranks_assembled_for_one_decode_rank(pair, prompts, fp8_kv, dtype):
    ids, kv = fp8_kv("medium") if dtype == "fp8" else prompts("medium")
    ids = np.concatenate([ids, [7 if dtype == "fp8" else 8]])  # a prompt no other test ran: its own pass
    kv = _pad(kv)
    r = rid(f"tp3-{dtype}")
    ranges = [HeadRange(h, 1, H) for h in range(H)]
    before = {side: _passes(pair, side) for side in ("encoder", "decoder")}
    results = _submit_ranks(pair, r, kv, ids, ranges)
    assert all(res.encoding == "speckv" and res.stored_chunks == 0 for res in results)
    assert sum(res.raw_bytes for res in results) == _bits(kv).nbytes
    got = _fetch(pair, r, None)
    assert _bits(got).tobytes() == _bits(kv).tobytes()
    if dtype == "fp8":
        assert got.scales.tobytes() == np.asarray(kv.scales, np.float32).tobytes()
    for h in ranges:
        st = pair.dec.status(r, heads=h)
        assert st.state == dpb.TRANSFER_STATE_FETCHED and (st.heads.start, st.heads.count) == (h.start, 1)
    for side in ("encoder", "decoder"):  # the ranks' transfers share one predictor pass per side
        miss, hit = (a - b for a, b in zip(_passes(pair, side), before[side], strict=True))
        assert (miss, hit) == (1, H - 1), side


def test_two_ranks_sliced_for_three_decode_ranks(pair, prompts):
    ids, kv = prompts("medium")
    r = rid("tp2-3")
    sent = [HeadRange(0, 1, H), HeadRange(1, 2, H)]
    _submit_ranks(pair, r, kv, ids, sent)
    bits = bf16_bits(kv)
    for h in (2, 0, 1):  # head 2 first: a slice of the wider range while its other head waits
        got = _fetch(pair, r, HeadRange(h, 1, H))
        assert got.shape[2] == 1 and got.tobytes() == np.ascontiguousarray(bits[:, :, h:h + 1]).tobytes()
        if h == 2:
            assert pair.dec.status(r, heads=sent[1]).state == dpb.TRANSFER_STATE_READY  # head 1 not out yet
    assert [pair.dec.status(r, heads=s).state for s in sent] == [dpb.TRANSFER_STATE_FETCHED] * 2
    budgets_drain(pair)


def test_a_range_as_sent_and_one_across_two(pair, prompts):
    ids, kv = prompts("short")
    r = rid("tp3-2")
    _submit_ranks(pair, r, kv, ids, [HeadRange(h, 1, H) for h in range(H)])
    bits = bf16_bits(kv)
    a = _fetch(pair, r, HeadRange(0, 2, H))  # two transfers side by side
    b = _fetch(pair, r, HeadRange(2, 1, H))  # one as sent
    assert np.concatenate([a, b], axis=2).tobytes() == bits.tobytes()


def test_heads_are_handed_out_once(pair, prompts):
    ids, kv = prompts("short")
    r = rid("tp-once")
    _submit_ranks(pair, r, kv, ids, [HeadRange(0, 2, H), HeadRange(2, 1, H)])
    _fetch(pair, r, HeadRange(1, 1, H))
    with pytest.raises(RpcFailed) as ei:
        _fetch(pair, r, HeadRange(0, 2, H))  # head 1 is gone
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and ei.value.reason == "ALREADY_FETCHED"
    got = _fetch(pair, r, HeadRange(0, 1, H))  # head 0 still is not
    assert got.tobytes() == np.ascontiguousarray(bf16_bits(kv)[:, :, :1]).tobytes()
    assert pair.dec.status(r, heads=HeadRange(0, 2, H)).state == dpb.TRANSFER_STATE_FETCHED
    assert pair.dec.cancel(r, heads=HeadRange(2, 1, H)).state == dpb.TRANSFER_STATE_CANCELLED  # its budget back
    budgets_drain(pair)


def test_overlapping_ranges_are_refused(pair, prompts):
    ids, kv = prompts("short")
    r = rid("tp-overlap")
    _submit_ranks(pair, r, kv, ids, [HeadRange(0, 2, H)])
    with pytest.raises(RpcFailed) as ei:
        pair.enc.submit(r, _part(kv, HeadRange(1, 2, H)), ids, pair.daddr, MODEL, timeout=WAIT,
                        heads=HeadRange(1, 2, H))
    assert ei.value.code == grpc.StatusCode.ALREADY_EXISTS
    pair.enc.submit(r, _part(kv, HeadRange(2, 1, H)), ids, pair.daddr, MODEL, timeout=WAIT,
                    heads=HeadRange(2, 1, H))
    with pytest.raises(RpcFailed) as ei:  # two ranges: which status is meant?
        pair.dec.status(r)
    assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
    pair.dec.cancel(r)  # every range of the request
    wait_until(lambda: all(pair.dec.status(r, heads=h).state != dpb.TRANSFER_STATE_READY
                           for h in (HeadRange(0, 2, H), HeadRange(2, 1, H))), what="both ranges cancelled")


def test_a_missing_range_is_not_found(pair, prompts):
    ids, kv = prompts("short")
    r = rid("tp-missing")
    _submit_ranks(pair, r, kv, ids, [HeadRange(0, 1, H), HeadRange(2, 1, H)])
    with pytest.raises(RpcFailed) as ei:
        pair.dec.fetch(r, wait=0.3, timeout=WAIT)  # head 1 never comes
    assert ei.value.code == grpc.StatusCode.NOT_FOUND
    got = _fetch(pair, r, HeadRange(2, 1, H))  # what did come is served
    assert got.tobytes() == np.ascontiguousarray(bf16_bits(kv)[:, :, 2:]).tobytes()
    pair.dec.cancel(r)  # head 0's transfer, never fetched
    budgets_drain(pair)


@pytest.mark.parametrize("start, count, total, kv_heads, why", [
    (0, 2, H, 1, "differs from shape.kv_heads"),
    (0, 1, 4, 1, "has 3 KV heads"),
    (2, 2, H, 2, "does not fit 3 heads"),
    (0, 0, H, 1, "differs from shape.kv_heads"),
])
def test_bad_ranges_are_invalid(pair, prompts, start, count, total, kv_heads, why):
    """Sent raw: the client refuses a range that does not match its KV before any call."""
    ids, kv = prompts("short")
    reqs = submit_list(rid("tp-bad"), kv[:, :, :kv_heads], ids, pair.daddr)
    reqs[0].header.heads.CopyFrom(pb.HeadRange(start=start, count=count, total=total))
    e = raw_submit(pair.eaddr, reqs)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.details(), e.details()
    with pytest.raises(ValueError, match="heads"):
        pair.enc.submit("x", kv[:, :, :1], ids, pair.daddr, MODEL, heads=HeadRange(0, 2, H))


def test_ranges_compress_as_the_whole(pair, prompts):
    """Each rank's stream codes its heads under the same model: the ranks' bytes together are
    within 1% of one whole transfer's (three headers, three times the chunk records and their final
    rANS states; `pytest -s -k compress` prints the figure)."""
    ids, kv = prompts("long")
    whole = pair.roundtrip(rid("tp-whole"), kv, ids)
    r = rid("tp-bytes")
    parts = _submit_ranks(pair, r, kv, ids, [HeadRange(h, 1, H) for h in range(H)])
    _fetch(pair, r, None)
    wire = sum(p.wire_bytes for p in parts)
    print(f"\nthree head ranges: {wire} wire bytes; one whole transfer: {whole.wire_bytes} "
          f"({wire / whole.wire_bytes - 1:+.2%})")
    assert abs(wire / whole.wire_bytes - 1) < 0.01, (wire, whole.wire_bytes)


def test_a_failed_range_fails_the_assembled_fetch_before_any_claim(pair, prompts):
    """A fetch across a failed range fails at once (TRANSFER_FAILED) and claims nothing: the
    other range is still fetched alone."""
    ids, kv = prompts("short")
    r = rid("tp-failed")
    _submit_ranks(pair, r, kv, ids, [HeadRange(0, 1, H), HeadRange(1, 2, H)])
    pair.dec.cancel(r, heads=HeadRange(1, 2, H))
    with pytest.raises(RpcFailed) as ei:
        pair.dec.fetch(r, wait=0.3, timeout=WAIT)  # no retry replaces the cancelled range
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and ei.value.reason == "TRANSFER_FAILED"
    got = _fetch(pair, r, HeadRange(0, 1, H))
    assert got.tobytes() == np.ascontiguousarray(bf16_bits(kv)[:, :, :1]).tobytes()
    budgets_drain(pair)


def test_ranges_with_other_fp8_scales_end_and_free_their_memory(pair, fp8_kv):
    """Ranks whose FP8 scales differ cannot be handed out as one layer: the fetch fails
    (RANGES_DIFFER) and both transfers end, their memory back; each alone still decodes."""
    ids, kv = fp8_kv("short")
    r = rid("tp-scales")
    ranges = [HeadRange(0, 1, H), HeadRange(1, 2, H)]
    other = Fp8KV(kv.codes, np.asarray(kv.scales, np.float32) * 2)
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(pair.enc.submit, r, _part(x, h), ids, pair.daddr, MODEL, timeout=WAIT, heads=h)
                for x, h in zip((kv, other), ranges, strict=True)]
        [f.result(timeout=WAIT) for f in futs]
    with pytest.raises(RpcFailed) as ei:
        _fetch(pair, r, None)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and ei.value.reason == "RANGES_DIFFER"
    assert {pair.dec.status(r, heads=h).state for h in ranges} == {dpb.TRANSFER_STATE_FAILED}
    budgets_drain(pair)


def test_an_assembled_fetch_larger_than_the_cap_is_refused(sidecars, prompts):
    """Under a 256 KiB cap a 1.3 MB KV in three ranges is not assembled (one range could fill
    the cap while another lags): RESOURCE_EXHAUSTED at once; fetched range by range, it flows."""
    from server_helpers import Pair

    ids, kv = prompts("long")
    p = Pair.start(sidecars, max_inflight_bytes=256 << 10, message_bytes=64 << 10)
    r = rid("tp-cap")
    ranges = [HeadRange(h, 1, H) for h in range(H)]
    try:
        with ThreadPoolExecutor(2 * H) as pool:
            subs = [pool.submit(p.enc.submit, r, _part(kv, h), ids, p.daddr, MODEL, timeout=WAIT, heads=h)
                    for h in ranges]
            wait_until(lambda: len(p.decoder.service.table.parts(r)) == H, WAIT, what="three ranges at the decoder")
            with pytest.raises(RpcFailed) as ei:
                p.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT)
            assert ei.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "each range alone" in ei.value.details
            got = [pool.submit(p.dec.fetch, r, wait=FETCH_WAIT, timeout=WAIT, heads=h) for h in ranges]
            parts = [f.result(timeout=WAIT) for f in got]
            [f.result(timeout=WAIT) for f in subs]
        assert np.concatenate(parts, axis=2).tobytes() == bf16_bits(kv).tobytes()
        budgets_drain(p)
    finally:
        p.stop()
