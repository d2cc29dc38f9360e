"""End to end through real sidecars: the engine submits a KV to its encoder, the
encoder codes and streams it to the decoder, the decode engine fetches it;
every KV that arrives is compared with the submitted one bit for bit."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from server_helpers import MODEL, WAIT, assert_same_kv, budgets_drain, kv_nbytes, rid

from speckv.client.client import RpcFailed
from speckv.coder import container as ct
from speckv.coder.codec import bf16_bits
from speckv.v1 import decoder_pb2 as dpb

S = dpb.TransferState


def test_bf16_speckv_bit_exact(pair, prompts):
    ids, kv = prompts("medium")
    r = rid("bf16")
    res = pair.roundtrip(r, kv, ids)
    assert res.raw_bytes == kv.numel() * 2 == kv_nbytes(kv)
    assert ct.HEADER_LEN < res.wire_bytes < res.raw_bytes  # speckv compresses
    assert res.chunks == 15  # 30 layers, 2 per chunk (default layers_per_chunk)
    st = pair.dec.status(r)
    assert st.state == S.TRANSFER_STATE_FETCHED
    assert (st.chunks_received, st.chunks_total, st.chunks_decoded) == (15, 15, 15)
    assert (st.wire_bytes, st.raw_bytes) == (res.wire_bytes, res.raw_bytes)


def test_fp8_bit_exact_with_scales(pair, fp8_kv):
    ids, kv = fp8_kv("medium")
    assert kv.codes.dtype == np.uint8 and kv.scales.shape == (30, 2)
    res = pair.roundtrip(rid("fp8"), kv, ids)  # codes and scales compared bit for bit
    assert res.raw_bytes == kv.codes.nbytes
    assert ct.HEADER_LEN < res.wire_bytes < res.raw_bytes


def test_fp8_stored_bit_exact(pair, fp8_kv):
    ids, kv = fp8_kv("short")
    res = pair.roundtrip(rid("fp8-stored"), kv, ids, encoding="stored")
    assert res.wire_bytes > res.raw_bytes == kv.codes.nbytes


def test_stored_bit_exact(pair, prompts):
    ids, kv = prompts("medium")
    res = pair.roundtrip(rid("stored"), kv, ids, encoding="stored")
    assert res.raw_bytes == kv_nbytes(kv)
    # stored: the raw bytes plus framing (header record, per-chunk overhead and digests)
    assert res.raw_bytes < res.wire_bytes < res.raw_bytes + 4096
    assert res.predictor_seconds == 0.0


def test_expected_pin_matching_is_accepted(pair, prompts, embedded_session):
    ids, kv = prompts("short")
    pair.roundtrip(rid("pin-ok"), kv, ids, expected_pin=embedded_session.predictor.pin)


def test_fetch_as_torch_and_by_layer(pair, prompts):
    ids, kv = prompts("short")
    _, got = pair.transfer(rid("torch"), kv, ids, fetch=lambda d, r: d.fetch(r, wait=WAIT, as_torch=True))
    assert got.dtype == torch.bfloat16 and tuple(got.shape) == tuple(kv.shape)
    assert torch.equal(got.view(torch.int16), kv.view(torch.int16))

    layers = []
    _, _ = pair.transfer(rid("layers"), kv, ids,
                         fetch=lambda d, r: layers.extend(d.fetch_layers(r, wait=WAIT, timeout=WAIT)))
    want = bf16_bits(kv)
    assert [k for k, _, _ in layers] == list(range(30))
    for k, arr, scales in layers:
        assert scales is None
        assert np.array_equal(arr, want[k])


def test_eight_concurrent_transfers(pair, prompts, fp8_kv):
    jobs = []
    for k in range(8):
        if k % 4 == 3:
            ids, kv = fp8_kv("short")
        else:
            ids, kv = prompts("short" if k % 2 else "medium")
        jobs.append((rid(f"conc{k}"), kv, ids))
    with ThreadPoolExecutor(16) as pool:
        fetches = [pool.submit(pair.dec.fetch, r, WAIT, WAIT) for r, _, _ in jobs]
        submits = [pool.submit(pair.enc.submit, r, kv, ids, pair.daddr, MODEL, timeout=WAIT)
                   for r, kv, ids in jobs]
        results = [f.result(timeout=WAIT) for f in submits]
        got = [f.result(timeout=WAIT) for f in fetches]
    for (r, kv, _), res, g in zip(jobs, results, got, strict=True):
        assert res.raw_bytes == kv_nbytes(kv), r
        assert_same_kv(g, kv)
        assert pair.dec.status(r).state == S.TRANSFER_STATE_FETCHED
    budgets_drain(pair)


def test_same_request_id_twice_is_already_exists(pair, prompts):
    ids, kv = prompts("short")
    r = rid("dup")
    pair.roundtrip(r, kv, ids)
    with pytest.raises(RpcFailed) as ei:
        pair.enc.submit(r, kv, ids, pair.daddr, MODEL, timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert ei.value.details.startswith("decoder: ") and r in ei.value.details
    budgets_drain(pair)


def test_second_fetch_of_a_fetched_transfer_fails(pair, prompts):
    ids, kv = prompts("short")
    r = rid("refetch")
    pair.roundtrip(r, kv, ids)
    with pytest.raises(RpcFailed) as ei:
        pair.dec.fetch(r, wait=1, timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "fetched" in ei.value.details
