"""The decoder's local fetch: layers handed to an engine on this host as one memfd,
not as bytes through protobuf and loopback TCP (protocol: ``speckv/handoff.py``).

``Mailboxes`` listens on ``config.local_socket``. A client connects (its uid checked
against ``config.local_uids``), asks for a mailbox and keeps the connection; the token
it gets back goes in ``FetchKVRequest.local_mailbox``. A local FetchKV then:

1. ``LocalKV``: makes a memfd of the bytes it will hand out (the pages
   allocated at once, ``fallocate``), and ``send`` puts the fd on
   the mailbox connection (SCM_RIGHTS; a read-only reopening of it; never blocking: a client that does not read its
   mailbox fails the fetch, RESOURCE_EXHAUSTED) before the first LocalFetchLayer;
2. ``write``: copies each verified layer where its LocalFetchLayer says (one copy, by
   ``pwritev``, which the bytes path pays several times: framing, gRPC, the kernel, the client);
3. ``seal``: seals the memfd against every change (F_SEAL_WRITE |
   GROW | SHRINK | SEAL) before FetchKVDone, so the bytes the client verifies are
   the bytes it keeps; then closes the decoder's fd (the client's holds the memory).

A mailbox ends with its connection. NOTE: the memfd's pages are charged to the
decoder's memory cgroup (it allocates them) until the client drops its mapping; a
decode engine copies the layers into its own cache and lets go at once.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import threading

import grpc
import numpy as np

from speckv import handoff as proto
from speckv.errors import RpcError

from .local_socket import LocalListener, Refused


class Mailboxes(LocalListener):
    """The decoder's local socket and the mailboxes its clients hold (module docstring)."""

    what = "local fetch socket"
    denied_as = "fetch KV from this decoder"

    def __init__(self, path: str, uids: frozenset[int]) -> None:
        super().__init__(path, uids)
        self._lock = threading.Lock()
        self._boxes: dict[str, socket.socket] = {}

    @property
    def mailboxes(self) -> int:
        return len(self._boxes)

    def handle(self, conn: socket.socket, data: bytes, fds: list[int]) -> tuple[bytes, bool]:
        try:
            ok = proto.decode(data).get("mailbox") is True and not fds
        except ValueError:
            ok = False
        with self._lock:
            if not ok or conn in self._boxes.values():
                raise Refused("INVALID_ARGUMENT", proto.BAD_REQUEST,
                              "a mailbox is asked for once per connection, as {\"v\": 1, \"mailbox\": true}")
            token = secrets.token_hex(16)
            self._boxes[token] = conn
        return proto.encode({"mailbox": token}), True

    def gone(self, conn: socket.socket) -> None:
        with self._lock:
            for token in [t for t, c in self._boxes.items() if c is conn]:
                del self._boxes[token]

    def check(self, token: str) -> None:
        """FAILED_PRECONDITION unless mailbox ``token`` is open (a fetch asks before it claims anything)."""
        with self._lock:
            if token not in self._boxes:
                raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, f"local mailbox {token[:8]}... is unknown or "
                               "its connection closed", reason=proto.MAILBOX_UNKNOWN)

    def send(self, token: str, fd: int, memfd_id: str, size: int) -> None:
        """Put ``fd`` on mailbox ``token``'s connection (the event loop's thread; never blocks)."""
        with self._lock:  # NOTE: the socket thread closes a connection only after gone() took this lock
            conn = self._boxes.get(token)
            if conn is None:  # NOTE: it closed after the fetch began: the client went away
                raise RpcError(grpc.StatusCode.UNAVAILABLE, f"local mailbox {token[:8]}... closed",
                               reason=proto.MAILBOX_GONE)
            msg = proto.encode({"memfd": memfd_id, "bytes": size})
            # NOTE: a read-only file: the client's shared mapping of it cannot be made writable, so it
            # does not keep seal() from adding F_SEAL_WRITE (EBUSY where a mapping may write)
            ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                socket.send_fds(conn, [msg], [ro], socket.MSG_DONTWAIT)
            except BlockingIOError:
                raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"local mailbox {token[:8]}... is full: its "
                               "client does not read it", reason=proto.OVER_LIMIT) from None
            except OSError as e:
                raise RpcError(grpc.StatusCode.UNAVAILABLE, f"local mailbox {token[:8]}...: {e}",
                               reason=proto.MAILBOX_GONE) from None
            finally:
                os.close(ro)


IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024  # buffers a pwritev takes
MIN_PIECE_BYTES = 64 << 10  # smaller contiguous pieces of a layer are gathered into one first (LocalKV.write)


class LocalKV:
    """One local fetch's memfd, written by the decoder (module docstring)."""

    def __init__(self, size: int) -> None:
        self.id, self.size = secrets.token_hex(8), size
        self.fd = os.memfd_create(proto.MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            if size:
                os.posix_fallocate(self.fd, 0, size)  # NOTE: the pages now: no memory fails a fetch before it claims
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, offset: int, arr: np.ndarray) -> None:
        """``arr``'s bytes (C order) at ``offset``: one copy, by the kernel (two where ``arr``'s
        contiguous pieces are small: ``_contiguous``).
        NOTE: pwritev, not a mapping: a mapping's page faults and its unmapping cost the decoder
        more than the copy itself (a 47 MB fetch maps 11,500 pages)."""
        if offset < 0 or offset + arr.nbytes > self.size:  # NOTE: a write past the end would grow the memfd
            raise ValueError(f"local memfd {self.id}: {arr.nbytes} bytes at {offset} overrun its {self.size}")
        views = _contiguous(arr)
        for i in range(0, len(views), IOV_MAX):
            batch = views[i:i + IOV_MAX]
            while batch:
                n = os.pwritev(self.fd, batch, offset)
                if n <= 0:  # pragma: no cover -- a memfd whose pages fallocate made
                    raise OSError(f"local memfd {self.id}: pwritev wrote nothing at {offset}")
                offset += n
                while batch and n >= len(batch[0]):  # NOTE: a short write resumes mid-buffer
                    n -= len(batch[0])
                    batch = batch[1:]
                if batch:
                    batch = [batch[0][n:]] + batch[1:]

    def seal(self) -> None:
        """Seal against every change (a client's read-only mapping does not stop it)."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, proto.ALL_SEALS)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _contiguous(arr: np.ndarray) -> list[memoryview]:
    """``arr``'s bytes in C order as contiguous pieces: the whole array when it is contiguous, else
    its sub-arrays along the first axis, recursively (a token range of a layer: one piece per (kv,
    head)); a sub-array whose pieces would be smaller than MIN_PIECE_BYTES is copied into one."""
    if arr.flags.c_contiguous:
        return [memoryview(arr.data).cast("B")] if arr.nbytes else []
    if arr.ndim < 2 or arr[0].nbytes < MIN_PIECE_BYTES or arr.strides[-1] != arr.itemsize:
        return [memoryview(np.ascontiguousarray(arr).data).cast("B")]  # NOTE: one copy, not a syscall per row
    return [v for sub in arr for v in _contiguous(sub)]
