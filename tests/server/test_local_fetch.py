"""The decoder's local fetch (server/mailbox.py, client/local.py LocalMailbox and
LocalLayers) through a real encoder + decoder pair: the layers come as one sealed memfd
over the decoder's Unix socket and match the submitted KV bit for bit (whole fetch,
layer by layer, FP8, a token range and a head slice; stored and speckv); the whole KV is
a writable array over a private mapping (nothing copied) and layer views are read-only;
no memfd fd stays open in the sidecars or the client. Bad use gets its own status: an
unknown mailbox FAILED_PRECONDITION, a decoder without a socket INVALID_ARGUMENT, a uid
outside the allow-list PERMISSION_DENIED, a second mailbox on one connection refused,
and a memfd the decoder did not seal DATA_LOSS at the client."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket

import grpc
import numpy as np
import pytest
from server_helpers import FETCH_WAIT, MODEL, WAIT, Pair, assert_same_kv, budgets_drain, rid, wait_until

from speckv import handoff as proto
from speckv.client.client import AsyncDecoderClient, DecoderClient, RpcFailed
from speckv.client.core import fetch_request
from speckv.client.local import LocalMailbox
from speckv.coder.codec import bf16_bits
from speckv.kv import HeadRange
from speckv.server import mailbox
from speckv.server.local_socket import parse_uids

MEMFD = f"/memfd:{proto.MEMFD_NAME}"


def memfd_fds() -> int:
    """This process's open fds on speckv memfds (the sidecars and the client run in it)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(MEMFD)
        except OSError:
            pass
    return n


def local_bytes(sidecar) -> float:
    """speckv_local_bytes_total of a sidecar so far."""
    return sidecar.service.metrics.local_bytes.labels(sidecar.service.metrics.role,
                                                      sidecar.service.metrics.model)._value.get()


@pytest.fixture()
def local(sidecars, tmp_path):
    """A pair whose decoder listens on a local socket; its DecoderClient fetches through it."""
    path = str(tmp_path / "dec.sock")
    p = Pair.start(sidecars, decoder={"local_socket": path})
    p.dec.close()
    p.dec = DecoderClient(p.daddr, timeout=WAIT, local_socket=path)
    p.path = path  # type: ignore[attr-defined]
    yield p
    p.stop()


def clean(p: Pair) -> None:
    wait_until(lambda: (gc.collect(), memfd_fds())[1] == 0, what="memfd fds closed")
    budgets_drain(p)


@pytest.mark.parametrize("encoding", ["stored", "speckv"])
def test_whole_kv_bit_exact_writable_and_closed(local, prompts, encoding):
    ids, kv = prompts("medium")
    before = local_bytes(local.decoder)
    res, got = local.transfer(rid("lfetch"), kv, ids, encoding=encoding)
    assert_same_kv(got, kv)
    assert res.encoding == encoding and res.raw_bytes == bf16_bits(kv).nbytes
    assert got.flags.writeable and not got.flags.owndata  # a private mapping: copy on write only
    got[0, 0, 0, 0, 0] ^= 1  # NOTE: writing is allowed (and touches no one else's pages)
    assert local.decoder.service.mailboxes.mailboxes == 1
    assert local_bytes(local.decoder) - before == bf16_bits(kv).nbytes
    del got  # NOTE: Python's mmap keeps a dup of the fd while the array over it lives
    clean(local)


def test_layers_stream_read_only(local, prompts):
    ids, kv = prompts("short")
    bits = bf16_bits(kv)
    r = rid("lfetch-layers")
    seen = []

    def fetch(dec, r):
        for layer, arr, scales in dec.fetch_layers(r, wait=FETCH_WAIT, timeout=WAIT):
            assert not arr.flags.writeable and scales is None
            seen.append(layer)
            assert np.array_equal(arr, bits[layer])
        return None

    local.transfer(r, kv, ids, encoding="stored", fetch=fetch)
    assert seen == list(range(bits.shape[0]))
    clean(local)


def test_fp8_bit_exact(local, fp8_kv):
    ids, kv = fp8_kv("short")
    res, got = local.transfer(rid("lfetch-fp8"), kv, ids, encoding="stored")
    assert_same_kv(got, kv)
    del got
    clean(local)


def test_token_range_and_heads(local, prompts):
    ids, kv = prompts("short")
    bits = bf16_bits(kv)
    r = rid("lfetch-range")
    res, got = local.transfer(r, kv, ids, encoding="stored", fetch=lambda dec, r: dec.fetch(
        r, wait=FETCH_WAIT, timeout=WAIT, heads=HeadRange(1, 2, 3), tokens=(2, 7)))
    assert np.array_equal(got, bits[:, :, 1:3, 2:7])
    token = local.dec.mailbox.token()
    rest = local.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT, heads=HeadRange(0, 1, 3))  # the rest, whole
    assert np.array_equal(rest, bits[:, :, :1])
    assert local.dec.mailbox.token() == token  # one mailbox for every fetch of a live connection
    del got, rest
    clean(local)


def test_unknown_mailbox(local, prompts):
    ids, kv = prompts("short")
    r = rid("lfetch-unknown")
    local.enc.submit(r, kv, ids, local.daddr, MODEL, encoding="stored", timeout=WAIT)
    with pytest.raises(grpc.RpcError) as e:
        list(local.dec._fetch(fetch_request(r, FETCH_WAIT, False, mailbox="0" * 32), timeout=WAIT))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown" in e.value.details()
    assert_same_kv(local.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT), kv)  # a failed fetch of a mailbox
    clean(local)


def test_decoder_without_socket(pair, prompts):
    ids, kv = prompts("short")
    r = rid("lfetch-nosock")
    pair.enc.submit(r, kv, ids, pair.daddr, MODEL, encoding="stored", timeout=WAIT)
    with pytest.raises(grpc.RpcError) as e:
        list(pair.dec._fetch(fetch_request(r, FETCH_WAIT, False, mailbox="0" * 32), timeout=WAIT))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "local socket" in e.value.details()
    assert proto.SOCKET_OFF in str(e.value.trailing_metadata())
    assert_same_kv(pair.dec.fetch(r, wait=FETCH_WAIT, timeout=WAIT), kv)  # refused before it claimed anything
    budgets_drain(pair)


def test_uid_outside_allow_list(sidecars, tmp_path):
    path = str(tmp_path / "deny.sock")
    p = Pair.start(sidecars, decoder={"local_socket": path, "local_uids": str(os.getuid() + 4242)})
    try:
        with DecoderClient(p.daddr, timeout=WAIT, local_socket=path) as dec, pytest.raises(RpcFailed) as e:
            dec.fetch(rid("deny"), wait=0.1, timeout=WAIT)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and e.value.reason == proto.PEER_DENIED
        assert p.decoder.service.mailboxes.mailboxes == 0
    finally:
        p.stop()


def test_one_mailbox_per_connection(local):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(WAIT)
        s.connect(local.path)
        s.send(proto.encode({"v": 1, "mailbox": True}))
        assert "mailbox" in json.loads(s.recv(proto.MAX_DATAGRAM))
        s.send(proto.encode({"v": 1, "mailbox": True}))
        reply = json.loads(s.recv(proto.MAX_DATAGRAM))
        assert (reply["code"], reply["reason"]) == ("INVALID_ARGUMENT", proto.BAD_REQUEST)
        assert s.recv(proto.MAX_DATAGRAM) == b""  # closed after the refusal
    wait_until(lambda: local.decoder.service.mailboxes.mailboxes == 0, what="the mailbox gone with its connection")


def test_unsealed_memfd_is_data_loss(local, prompts, monkeypatch):
    monkeypatch.setattr(mailbox.LocalKV, "seal", lambda self: None)
    ids, kv = prompts("short")
    with pytest.raises(RpcFailed) as e:
        local.transfer(rid("lfetch-unsealed"), kv, ids, encoding="stored")
    assert e.value.code == grpc.StatusCode.DATA_LOSS and "did not seal" in str(e.value)
    clean(local)


def test_a_changed_memfd_is_data_loss(local, prompts, monkeypatch):
    """The client's digest is over the memfd's bytes: one bit changed after the decoder verified
    the layer (and computed its own digest from it) fails the fetch."""
    write = mailbox.LocalKV.write

    def flip(self, offset, arr):
        write(self, offset, arr)
        if offset == 0:
            b = os.pread(self.fd, 1, 5)
            os.pwrite(self.fd, bytes([b[0] ^ 1]), 5)

    monkeypatch.setattr(mailbox.LocalKV, "write", flip)
    ids, kv = prompts("short")
    with pytest.raises(RpcFailed) as e:
        local.transfer(rid("lfetch-changed"), kv, ids, encoding="stored")
    assert e.value.code == grpc.StatusCode.DATA_LOSS and "digest" in str(e.value)
    clean(local)


def test_async_client(local, prompts):
    ids, kv = prompts("short")
    r = rid("lfetch-async")
    local.enc.submit(r, kv, ids, local.daddr, MODEL, encoding="stored", timeout=WAIT)

    async def fetch():
        dec = AsyncDecoderClient(local.daddr, timeout=WAIT, local_socket=local.path)
        try:
            return await dec.fetch(r, wait=FETCH_WAIT)
        finally:
            await dec.close()

    got = asyncio.run(fetch())
    assert_same_kv(got, kv)
    del got
    clean(local)


def test_a_restarted_decoder_gets_a_new_mailbox(tmp_path):
    """The client's mailbox outlives a decoder: its next token comes from the new one."""
    path = str(tmp_path / "restart.sock")
    first = mailbox.Mailboxes(path, parse_uids(None))
    first.start()
    box = LocalMailbox(path, timeout=WAIT)
    try:
        old = box.token()
        first.check(old)
        first.stop()
        second = mailbox.Mailboxes(path, parse_uids(None))
        second.start()
        try:
            new = box.token()
            assert new != old
            second.check(new)
        finally:
            second.stop()
    finally:
        box.close()
        first.stop()


@pytest.mark.parametrize("short", [False, True])
def test_localkv_writes_any_strides_in_c_order(monkeypatch, short):
    """``LocalKV.write`` puts an array's C-order bytes at its offset: a contiguous one, a token
    range (one piece per (kv, head)) and a transposed one, also when every pwritev is short."""
    if short:  # and at most 5 buffers a call
        pwritev = os.pwritev
        monkeypatch.setattr(mailbox.os, "pwritev", lambda fd, bufs, off: pwritev(fd, [bytes(bufs[0][:7])], off))
        monkeypatch.setattr(mailbox, "IOV_MAX", 5)
    monkeypatch.setattr(mailbox, "MIN_PIECE_BYTES", 16)  # pieces of a few rows: the recursion runs
    rng = np.random.default_rng(1)
    a = rng.integers(0, 1 << 16, (2, 3, 9, 8), dtype=np.uint16)
    parts = [a, a[:, :, 2:7], a.transpose(0, 1, 3, 2), a[:, :, :0], a[:, :, :1]]
    kv = mailbox.LocalKV(sum(p.nbytes for p in parts))
    try:
        at = 0
        for p in parts:
            kv.write(at, p)
            at += p.nbytes
        kv.seal()
        assert os.pread(kv.fd, kv.size, 0) == b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
        with pytest.raises(ValueError, match="overrun"):  # never past the end: it would grow the memfd
            mailbox.LocalKV.write(kv, kv.size - 1, a)
    finally:
        kv.close()
