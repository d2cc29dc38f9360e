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
import mmap
import os
import socket
import threading
import time
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
            self._sock = _connect(self.path, self.timeout)
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




# -- the decoder side: a mailbox for local fetches (FetchKVRequest.local_mailbox) --------

class LocalMailbox:
    """One connection to a decoder's local socket, holding a mailbox: the memfds of this
    client's local fetches arrive on it, one datagram each (``speckv/handoff.py``). Several
    fetches may share it (each takes its own memfd by id); a memfd no fetch took within
    ``STALE_S`` (its fetch failed first) is closed."""

    STALE_S = 60.0

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.path, self.timeout = path, timeout
        self._sock: socket.socket | None = None
        self._token = ""
        self._lock = threading.Lock()
        self._stash: dict[str, tuple[int, int, float]] = {}  # memfd id -> (fd, bytes, when it came)

    def token(self) -> str:
        """The mailbox's token (connected and asked for on first use, again after a failure or
        once the decoder closed the connection: a restarted decoder knows no old token)."""
        with self._lock:
            if self._sock is not None and _closed(self._sock):
                self._reset()
            if self._sock is None:
                sock = _connect(self.path, self.timeout)
                try:
                    sock.send(proto.encode({"v": proto.VERSION, "mailbox": True}))
                    reply = proto.decode(sock.recv(proto.MAX_DATAGRAM) or b"{}")
                except (OSError, ValueError) as e:
                    sock.close()
                    raise RpcFailed(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e}",
                                    UNREACHABLE) from None
                if "mailbox" not in reply:
                    sock.close()
                    raise _refused(reply, self.path)
                self._sock, self._token = sock, str(reply["mailbox"])
            return self._token

    def take(self, memfd_id: str, size: int) -> int:
        """The fd of memfd ``memfd_id`` (the caller closes it), waiting up to ``timeout`` for it;
        UNAVAILABLE when the connection ends, INTERNAL when its size is not ``size``."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while memfd_id not in self._stash:
                self._receive(deadline)
            fd, n, _ = self._stash.pop(memfd_id)
        if n != size or os.fstat(fd).st_size != size:
            os.close(fd)
            raise RpcFailed(grpc.StatusCode.INTERNAL, f"local memfd {memfd_id}: {n} bytes declared, "
                            f"{size} expected")
        return fd

    def _receive(self, deadline: float) -> None:
        sock = self._sock
        if sock is None:
            raise RpcFailed(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: not connected", UNREACHABLE)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            data, fds, _flags, _ = socket.recv_fds(sock, proto.MAX_DATAGRAM, 4, socket.MSG_CMSG_CLOEXEC)
        except socket.timeout:  # NOTE: the connection stays: other fetches share it
            raise RpcFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"local socket {self.path}: no memfd within "
                            f"{self.timeout} s", UNREACHABLE) from None
        except OSError as e:
            self._reset()
            raise RpcFailed(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e}", UNREACHABLE) from None
        try:
            msg = proto.decode(data) if data else {}
            key, n = str(msg["memfd"]), int(msg["bytes"])
        except (ValueError, KeyError, TypeError):
            for fd in fds:
                os.close(fd)
            self._reset()
            what = "sent a malformed datagram" if data else "closed the mailbox"
            raise RpcFailed(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path} {what}", UNREACHABLE) from None
        for fd in fds[1:]:
            os.close(fd)
        now = time.monotonic()
        for old in [k for k, (_, _, t) in self._stash.items() if now - t > self.STALE_S]:
            os.close(self._stash.pop(old)[0])
        if fds:
            self._stash[key] = (fds[0], n, now)

    def reset(self) -> None:
        """Drop the connection (and so the token): the next fetch asks for a new mailbox."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock, self._token = None, ""

    def close(self) -> None:
        with self._lock:
            self._reset()
            for fd, _, _ in self._stash.values():
                os.close(fd)
            self._stash.clear()


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (an empty read pending), without taking a datagram."""
    timeout = sock.gettimeout()
    sock.setblocking(False)  # NOTE: with a timeout set, Python waits for data first, MSG_DONTWAIT or not
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)


def _connect(path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise RpcFailed(grpc.StatusCode.UNAVAILABLE, f"local socket {path}: {e}", UNREACHABLE) from None
    return sock


def _refused(reply: dict[str, Any], path: str) -> RpcFailed:
    if "code" not in reply:
        return RpcFailed(grpc.StatusCode.UNAVAILABLE, f"local socket {path} closed the connection", UNREACHABLE)
    return RpcFailed(getattr(grpc.StatusCode, str(reply["code"]), grpc.StatusCode.UNKNOWN),
                     f"local socket {path} refused: {reply.get('message', '')}", str(reply.get("reason", "")))


class LocalLayers:
    """A local fetch's layers, read where the decoder wrote them: the memfd its mailbox
    received. Streamed (``whole`` False), each layer is a read-only view of a shared
    mapping; ``whole``, nothing is mapped until ``finish``, which maps it private and
    writable (copy on write: nothing is copied unless the caller writes). Either way the
    whole-transfer digest is computed in ``finish``, after the memfd's seals are checked,
    over the bytes the caller keeps."""

    def __init__(self, mailbox: LocalMailbox, part: Any, whole: bool) -> None:
        from speckv.wire import dtype_of, layer_bytes, shape_of

        self.shape, self.dtype, self.whole = shape_of(part.shape), part.dtype, whole
        self.dt = dtype_of(part.dtype)[1]
        self.id, self.size = part.memfd_id, int(part.memfd_bytes)
        self.layer_bytes = layer_bytes(self.shape, self.dt.itemsize)
        if self.size != self.shape[0] * self.layer_bytes:
            raise ValueError(f"a memfd of {self.size} bytes for KV of shape {self.shape}")
        self.fd = mailbox.take(self.id, self.size)
        try:
            self.mm = None if whole or not self.size else mmap.mmap(
                self.fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        except BaseException:
            self.close()
            raise
        self.next = 0
        self.scales: list[np.ndarray | None] = []

    @property
    def done(self) -> bool:
        return self.next == self.shape[0]

    def add(self, part: Any) -> tuple[int, np.ndarray | None, np.ndarray | None]:
        """Layer ``part.layer`` (in order): its view (None when ``whole``) and scales."""
        from speckv.wire import shape_of

        i = self.next
        if (part.memfd_id, part.layer, part.dtype, shape_of(part.shape)) != (self.id, i, self.dtype, self.shape) or \
                (part.byte_offset, part.layer_bytes) != (i * self.layer_bytes, self.layer_bytes):
            raise ValueError(f"local layer {part.layer} does not follow layer {i - 1} of memfd {self.id}")
        scales = np.asarray(part.fp8_scales, np.float32) if len(part.fp8_scales) else None
        if (scales is None) != (self.dt.itemsize == 2) or (scales is not None and scales.shape != (2,)):
            raise ValueError(f"local layer {i}: {len(part.fp8_scales)} FP8 scales for a {self.dt} layer")
        self.scales.append(scales)
        self.next += 1
        return i, None if self.whole else self._view(self.mm)[i], scales

    def _view(self, mm: mmap.mmap | None) -> np.ndarray:
        if mm is None:
            return np.empty(self.shape, self.dt)  # NOTE: no bytes at all (an empty memfd cannot be mapped)
        return np.frombuffer(mm, self.dt).reshape(self.shape)

    def finish(self, digest: Any) -> np.ndarray:
        """After the last layer: ValueError unless the memfd is sealed against every change;
        the whole-transfer digest updated over the final bytes; the whole KV."""
        seals = fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)
        if proto.ALL_SEALS & ~seals:
            raise ValueError(f"the decoder did not seal memfd {self.id} (seals {seals:#x})")
        mm = self.mm if not self.whole or not self.size else mmap.mmap(
            self.fd, self.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        out = self._view(mm)
        for i in range(self.shape[0]):
            digest.update_layer(out[i], self.scales[i])
        self.close()
        return out

    def close(self) -> None:
        """The fd goes; mappings stay as long as the arrays over them (NOTE: each with a duplicate
        of the fd, which Python's mmap keeps until it is unmapped)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


__all__ = ["LocalHandoff", "LocalLayers", "LocalMailbox", "local_submit_requests", "local_layers", "memfd_with"]
