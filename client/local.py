"""The client side of the local KV hand-off (protocol: ``speckv/handoff.py``).

On the encoder's own host the raw KV need not go through protobuf and loopback TCP:
``LocalHandoff.share`` writes it into a memfd (one copy, by the kernel), seals it
(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL: no one, this process
included, can change its size or bytes after that), sends the fd over the encoder's
Unix socket and gets a handle back; this process's own fd is closed at once, so the
encoder's mapping holds the only reference and the memory goes when the encoder
closes it (after the Submit, or ``ttl_s`` unclaimed). The Submit then names the
handle in ``LocalLayer`` messages (``local_submit_requests``).

Refusals raise :class:`RpcFailed` with the code and reason the encoder named
(PERMISSION_DENIED for a uid not in its ``local_uids``, RESOURCE_EXHAUSTED over its
limits); a socket that cannot be reached raises UNAVAILABLE.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from typing import Any, Iterator, Sequence

import grpc
import numpy as np

from speckv import handoff as proto
from speckv.errors import RpcFailed
from speckv.v1 import encoder_pb2 as epb

UNREACHABLE = "LOCAL_SOCKET_UNAVAILABLE"


class LocalHandoff:
    """One connection to an encoder's local socket (opened on first use, reopened after a refusal)."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.path, self.timeout = path, timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except OSError as e:
                sock.close()
                raise RpcFailed(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e}", UNREACHABLE) from None
            self._sock = sock
        return self._sock

    def share(self, buffers: Sequence[Any]) -> tuple[str, int]:
        """Hand ``buffers`` (bytes-like, concatenated) to the encoder as one sealed memfd;
        returns ``(handle, size)``."""
        fd = memfd_with(buffers)
        try:
            size = os.fstat(fd).st_size
            with self._lock:
                return self._send(fd, size), size
        finally:
            os.close(fd)

    def _send(self, fd: int, size: int) -> str:
        sock = self._connect()
        try:
            socket.send_fds(sock, [proto.encode({"v": proto.VERSION, "bytes": size})], [fd])
            data = sock.recv(proto.MAX_DATAGRAM)
        except OSError as e:
            self.close()
            raise RpcFailed(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e}", UNREACHABLE) from None
        if not data:  # NOTE: a refusal at accept (the peer check) may come before our datagram is read
            self.close()
            raise RpcFailed(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path} closed the connection",
                            UNREACHABLE)
        reply = proto.decode(data)
        if "code" in reply:
            self.close()
            raise RpcFailed(getattr(grpc.StatusCode, str(reply["code"]), grpc.StatusCode.UNKNOWN),
                            f"local hand-off refused: {reply.get('message', '')}", str(reply.get("reason", "")))
        return str(reply["handle"])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def memfd_with(buffers: Sequence[Any]) -> int:
    """A new memfd holding ``buffers`` concatenated, sealed against any change."""
    fd = os.memfd_create(proto.MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        total = sum(memoryview(b).nbytes for b in buffers)
        os.ftruncate(fd, total)
        off = 0
        for b in buffers:
            view = memoryview(b).cast("B")
            while view:
                n = os.pwrite(fd, view, off)
                view, off = view[n:], off + n
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, proto.ALL_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def local_layers(handle: str, bits: np.ndarray, scales: np.ndarray | None,
                 first: int = 0, base: int = 0) -> Iterator[epb.SubmitRequest]:
    """The LocalLayer messages of layers ``first..`` of ``bits`` (their bytes at ``base`` +
    the layer's offset within ``bits`` in the memfd ``handle``)."""
    lb = bits[0].nbytes if len(bits) else 0
    for i in range(bits.shape[0]):
        sc = [] if scales is None else [float(v) for v in scales[i]]
        yield epb.SubmitRequest(local_layer=epb.LocalLayer(handle=handle, layer=first + i, byte_offset=base + i * lb,
                                                           layer_bytes=lb, fp8_scales=sc))


def local_submit_requests(handoff: LocalHandoff, header: epb.SubmitRequest, bits: np.ndarray,
                          scales: np.ndarray | None) -> Iterator[epb.SubmitRequest]:
    """A whole KV's Submit through the hand-off: shared now (one memfd; a refusal raises
    here, before any call starts), then the header and one LocalLayer per layer."""
    handle, _ = handoff.share([np.ascontiguousarray(bits)])
    return _stream(header, local_layers(handle, bits, scales))


def _stream(header: epb.SubmitRequest, layers: Iterator[epb.SubmitRequest]) -> Iterator[epb.SubmitRequest]:
    yield header
    yield from layers


__all__ = ["LocalHandoff", "local_submit_requests", "local_layers", "memfd_with"]
