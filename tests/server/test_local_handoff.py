"""The encoder's local KV hand-off (server/handoff.py, client/local.py) through a real
encoder + decoder pair: the KV goes as a sealed memfd over the encoder's Unix socket and
arrives at the decode side bit for bit (whole submit, layer by layer, FP8, stored and
speckv), the encoder maps it without copying and closes it when the call ends (its
fds and mappings counted in /proc/self), and every bad hand-off is refused with its own
status: an unsealed or half-sealed fd FAILED_PRECONDITION, a uid outside the allow-list
PERMISSION_DENIED, an unknown, expired, reused or foreign handle and a byte range past
the memfd INVALID_ARGUMENT, over the limits RESOURCE_EXHAUSTED. A sealed memfd cannot be
truncated by its own creator. The bytes path keeps working beside it."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time

import grpc
import numpy as np
import pytest
from server_helpers import MODEL, WAIT, Pair, assert_same_kv, budgets_drain, raw_submit, rid, wait_until

from speckv import handoff as proto
from speckv.client.client import EncoderClient, RpcFailed
from speckv.client.local import LocalHandoff, memfd_with
from speckv.coder.codec import bf16_bits
from speckv.v1 import encoder_pb2 as epb

MEMFD = f"/memfd:{proto.MEMFD_NAME}"


def memfds() -> int:
    """This process's open fds on speckv memfds (the sidecars run in it)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(MEMFD)
        except OSError:
            pass
    return n


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(MEMFD in line for line in f)


SHORT_TTL_S = 2.0  # local_handle_ttl_s of the pair that watches a handle expire


def _local_pair(sidecars, tmp_path, ttl_s: float):
    path = str(tmp_path / "enc.sock")
    p = Pair.start(sidecars, encoder={"local_socket": path, "local_handle_ttl_s": ttl_s})
    p.enc.close()
    p.enc = EncoderClient(p.eaddr, timeout=WAIT, local_socket=path)
    p.path = path  # type: ignore[attr-defined]
    return p


@pytest.fixture()
def local(sidecars, tmp_path):
    """A pair whose encoder listens on a local socket; its EncoderClient uses it. The default
    handle lease (30 s). NOTE: a speckv Submit reads its layers (and claims their handles) only
    after the decoder's first predictor check: a short lease would expire handles on a slow,
    loaded machine."""
    p = _local_pair(sidecars, tmp_path, 30.0)
    yield p
    p.stop()


@pytest.fixture()
def local_short_ttl(sidecars, tmp_path):
    """As ``local``, with handles that expire unclaimed after SHORT_TTL_S."""
    p = _local_pair(sidecars, tmp_path, SHORT_TTL_S)
    yield p
    p.stop()


def clean(p: Pair) -> None:
    """Every handle and mapping closed, every budget back to 0."""
    h = p.encoder.service.handoffs
    wait_until(lambda: h.handles == 0 and h.mapped_bytes == 0, what=f"handles closed ({h.handles} open)")
    wait_until(lambda: (gc.collect(), memfds() + mappings())[1] == 0, what="memfd fds and maps closed")
    budgets_drain(p)


@pytest.mark.parametrize("encoding", ["stored", "speckv"])
def test_whole_kv_bit_exact_and_closed(local, prompts, encoding):
    ids, kv = prompts("medium")
    m = local.encoder.service.metrics
    counted = m.local_bytes.labels(m.role, m.model)
    before = counted._value.get()
    res = local.roundtrip(rid("local"), kv, ids, encoding=encoding)
    assert res.encoding == encoding and res.raw_bytes == bf16_bits(kv).nbytes
    assert counted._value.get() - before == res.raw_bytes  # speckv_local_bytes_total
    clean(local)


def test_fp8_bit_exact(local, fp8_kv):
    ids, kv = fp8_kv("short")
    res, got = local.transfer(rid("local-fp8"), kv, ids, encoding="stored")
    assert_same_kv(got, kv)
    assert res.raw_bytes == kv.codes.nbytes
    clean(local)


def test_layer_by_layer_one_memfd_per_layer(local, prompts):
    ids, kv = prompts("medium")
    bits = bf16_bits(kv)
    r = rid("local-stream")
    s = local.enc.open_submit(r, tuple(bits.shape), ids, local.daddr, MODEL, encoding="stored", timeout=WAIT)
    for i in range(bits.shape[0]):
        s.send_layer(i, bits[i])
    got = local.dec.fetch(r, wait=WAIT, timeout=WAIT)
    assert s.result(timeout=WAIT).raw_bytes == bits.nbytes
    assert_same_kv(got, kv)
    clean(local)


def test_bytes_path_beside_it(local, prompts):
    """A client without the socket on the same encoder: the bytes path, bit for bit."""
    ids, kv = prompts("short")
    plain = Pair(local.sidecars, local.decoder, local.daddr, local.encoder, local.eaddr, local.dec,
                 EncoderClient(local.eaddr, timeout=WAIT))
    plain.roundtrip(rid("bytes"), kv, ids, encoding="stored")
    plain.enc.close()


def _raw_handoff(path: str, fd: int, size: int) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(WAIT)
        s.connect(path)
        socket.send_fds(s, [proto.encode({"v": 1, "bytes": size})], [fd])
        return json.loads(s.recv(proto.MAX_DATAGRAM))


@pytest.mark.parametrize("seals", [0, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW, None])
def test_unsealed_fd_refused(local, seals):
    if seals is None:  # a plain file: no seals at all
        fd = os.open(local.path + ".file", os.O_RDWR | os.O_CREAT)
    else:
        fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.write(fd, b"\0" * 4096)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    try:
        reply = _raw_handoff(local.path, fd, 4096)
    finally:
        os.close(fd)
    assert (reply["code"], reply["reason"]) == ("FAILED_PRECONDITION", proto.UNSEALED), reply
    assert local.encoder.service.handoffs.handles == 0


def test_declared_size_must_match(local):
    fd = memfd_with([b"\1" * 100])
    try:
        reply = _raw_handoff(local.path, fd, 99)
    finally:
        os.close(fd)
    assert (reply["code"], reply["reason"]) == ("INVALID_ARGUMENT", proto.BAD_REQUEST), reply


def test_sealed_memfd_cannot_be_truncated_or_written():
    fd = memfd_with([b"\7" * 8192])
    try:
        for attempt in (lambda: os.ftruncate(fd, 0), lambda: os.ftruncate(fd, 1 << 20),
                        lambda: os.pwrite(fd, b"x", 0)):
            with pytest.raises(PermissionError):
                attempt()
        with pytest.raises(PermissionError):  # nor unsealed or re-sealed
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
        assert os.fstat(fd).st_size == 8192 and os.pread(fd, 8192, 0) == b"\7" * 8192
    finally:
        os.close(fd)


def test_peer_uid_outside_allow_list(sidecars, tmp_path, prompts):
    path = str(tmp_path / "deny.sock")
    p = Pair.start(sidecars, encoder={"local_socket": path, "local_uids": str(os.getuid() + 4242)})
    try:
        ids, kv = prompts("short")
        with EncoderClient(p.eaddr, timeout=WAIT, local_socket=path) as enc, pytest.raises(RpcFailed) as e:
            enc.submit(rid("deny"), kv, ids, p.daddr, MODEL)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED, e.value
        assert e.value.reason == proto.PEER_DENIED
        assert p.encoder.service.handoffs.handles == 0
    finally:
        p.stop()


CHILD = """
import fcntl, os, socket, sys
fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
os.write(fd, b"\\0" * 64)
fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(30)
s.connect(sys.argv[1])
socket.send_fds(s, [b'{"v":1,"bytes":64}'], [fd])
print(s.recv(4096).decode())
"""


# NOTE: a system interpreter (the child imports nothing of speckv): the venv's may not be
# executable by another uid
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.mark.skipif(os.getuid() != 0 or SYSTEM_PYTHON is None,
                    reason="needs root (to start a process of another uid) and /usr/bin/python3")
def test_other_uid_refused_by_default(sidecars, prompts):
    """A real peer of another uid (a process run as nobody) against the default allow-list."""
    d = tempfile.mkdtemp()
    os.chmod(d, 0o755)  # NOTE: the socket itself is 0666: the uid check is SO_PEERCRED's
    path = os.path.join(d, "enc.sock")
    p = Pair.start(sidecars, encoder={"local_socket": path})
    try:
        out = subprocess.run([str(SYSTEM_PYTHON), "-I", "-c", CHILD, path], user=65534, capture_output=True,
                             text=True, timeout=WAIT)
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout)
        assert (reply["code"], reply["reason"]) == ("PERMISSION_DENIED", proto.PEER_DENIED), reply
        assert "uid 65534" in reply["message"]
        assert p.encoder.service.handoffs.handles == 0
        ids, kv = prompts("short")  # this process's own uid is allowed
        with EncoderClient(p.eaddr, timeout=WAIT, local_socket=path) as enc:
            p.enc.close()
            p.enc = enc
            p.roundtrip(rid("own-uid"), kv, ids, encoding="stored")
    finally:
        p.stop()
        os.rmdir(d)


def _header(local, r: str, bits: np.ndarray, ids) -> epb.SubmitRequest:
    from speckv.client.core import submit_header
    from speckv.wire import kv_shape

    return submit_header(r, 1, kv_shape(bits.shape), ids, local.daddr, MODEL, "stored", None)


def _layers(handle: str, bits: np.ndarray, offset: int = 0) -> list[epb.SubmitRequest]:
    lb = bits[0].nbytes
    return [epb.SubmitRequest(local_layer=epb.LocalLayer(handle=handle, layer=i, byte_offset=offset + i * lb,
                                                         layer_bytes=lb)) for i in range(bits.shape[0])]


def test_unknown_expired_reused_and_out_of_range_handles(local_short_ttl, prompts):
    local = local_short_ttl
    ids, kv = prompts("short")
    bits = bf16_bits(kv)
    e = raw_submit(local.eaddr, [_header(local, rid("unknown"), bits, ids), *_layers("0" * 32, bits)])
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown, expired" in e.details()

    handoff = LocalHandoff(local.path)
    handle, _ = handoff.share([bits])
    e = raw_submit(local.eaddr, [_header(local, rid("range"), bits, ids), *_layers(handle, bits, offset=2)])
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside" in e.details(), e.details()
    e = raw_submit(local.eaddr, [_header(local, rid("reused"), bits, ids), *_layers(handle, bits)])
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, "a handle is closed with the call that claimed it"

    handle, _ = handoff.share([bits])
    assert local.encoder.service.handoffs.handles == 1
    # NOTE: a failed call's views may live in traceback cycles until the collector runs
    wait_until(lambda: (gc.collect(), memfds())[1] == 1, what="only the new handle's memfd open")
    time.sleep(SHORT_TTL_S + 0.1)  # the socket thread expires it within ~0.5 s
    wait_until(lambda: local.encoder.service.handoffs.handles == 0, what="the unclaimed handle expired")
    e = raw_submit(local.eaddr, [_header(local, rid("expired"), bits, ids), *_layers(handle, bits)])
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    handoff.close()
    clean(local)


def test_limits(sidecars, tmp_path):
    path = str(tmp_path / "lim.sock")
    p = Pair.start(sidecars, encoder={"local_socket": path, "local_max_handles": 1,
                                      "max_inflight_bytes": 256 << 10, "message_bytes": 64 << 10})
    try:
        h = LocalHandoff(path)
        with pytest.raises(RpcFailed) as e:
            h.share([b"\0" * (300 << 10)])
        assert (e.value.code, e.value.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, proto.OVER_LIMIT)
        h.share([b"\0" * 64])
        with pytest.raises(RpcFailed) as e:
            h.share([b"\0" * 64])
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "local_max_handles" in e.value.details
        h.close()
    finally:
        p.stop()
    assert memfds() == 0 and mappings() == 0, "stopping the encoder closes what it held"


def test_local_layer_without_socket(pair, prompts):
    ids, kv = prompts("short")
    bits = bf16_bits(kv)
    e = raw_submit(pair.eaddr, [_header(pair, rid("nosock"), bits, ids), *_layers("0" * 32, bits)])
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "local_socket" in e.details()
