"""A sidecar's local Unix socket (SOCK_SEQPACKET), served by one thread: the encoder's
memfd hand-offs (``handoff.py``) and the decoder's fetch mailboxes (``mailbox.py``).

``LocalListener`` owns the socket and its thread. At accept it reads the peer's
credentials (SO_PEERCRED) and checks its uid against ``uids``; a peer not allowed gets
one PERMISSION_DENIED reply to its first datagram and the connection is closed. Every
other datagram goes to the subclass's ``handle``, which returns the reply and whether
the connection stays open; a ``Refused`` it raises is sent as the reply and closes the
connection. Fds that come with a datagram are closed after ``handle`` (one that keeps
the file maps or dups it first). ``gone(conn)`` tells the subclass a connection ended.

Protocol of both directions: ``speckv/handoff.py``.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import stat
import struct
import threading

from speckv import handoff as proto

logger = logging.getLogger(__name__)


class Refused(Exception):
    """A request refused: the reply's code, reason and message."""

    def __init__(self, code: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def parse_uids(text: str | None) -> frozenset[int]:
    """``"1000,10001"`` -> the uids allowed on the socket; None or empty: this process's uid."""
    if not text:
        return frozenset({os.getuid()})
    try:
        uids = frozenset(int(u) for u in text.split(",") if u.strip())
    except ValueError:
        raise ValueError(f"local_uids must be comma-separated uids, not {text!r}") from None
    if not uids or min(uids) < 0:
        raise ValueError(f"local_uids must be comma-separated uids, not {text!r}")
    return uids


class LocalListener:
    """The socket at ``path``, its thread and the peer check (module docstring)."""

    what = "local socket"  # for log lines
    denied_as = "use this sidecar's local socket"  # the refusal's message: "uid N may not <denied_as>"

    def __init__(self, path: str, uids: frozenset[int]) -> None:
        self.path, self.uids = path, uids
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if os.path.exists(self.path) and stat.S_ISSOCK(os.stat(self.path).st_mode):
            os.unlink(self.path)  # a previous sidecar's socket (a file of another kind is an error below)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(self.path)
        # NOTE: anyone may connect; SO_PEERCRED against the uids is the access check
        os.chmod(self.path, 0o666)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, daemon=True, name="speckv-local")
        self._thread.start()
        logger.info("%s on %s (uids %s)", self.what, self.path, sorted(self.uids))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
            if os.path.exists(self.path):
                os.unlink(self.path)

    # -- hooks --------------------------------------------------------------------

    def handle(self, conn: socket.socket, data: bytes, fds: list[int]) -> tuple[bytes, bool]:
        """The reply to one datagram of an allowed peer, and whether its connection stays open."""
        raise NotImplementedError

    def gone(self, conn: socket.socket) -> None:
        """``conn`` ended (the peer closed it, or it was refused)."""

    def tick(self) -> None:
        """Called at least twice a second from the socket's thread."""

    # -- the socket thread ------------------------------------------------------

    def _serve(self) -> None:
        assert self._sock is not None
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.5):
                    if key.fileobj is self._sock:
                        self._accept(sel)
                    elif not self._datagram(key.fileobj, key.data):  # type: ignore[arg-type]
                        sel.unregister(key.fileobj)
                        self.gone(key.fileobj)  # type: ignore[arg-type]
                        key.fileobj.close()  # type: ignore[union-attr]
                self.tick()
        finally:
            for key in list(sel.get_map().values()):
                if key.fileobj is not self._sock:
                    self.gone(key.fileobj)  # type: ignore[arg-type]
                    key.fileobj.close()  # type: ignore[union-attr]
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except BlockingIOError:
            return
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        denied = None
        if uid not in self.uids:
            logger.warning("%s: refused pid %d uid %d (allowed: %s)", self.what, pid, uid, sorted(self.uids))
            # NOTE: the refusal answers the peer's first datagram (its fds closed unread): sent at
            # once and closed, the peer's own send could meet a reset connection, not the reason
            denied = proto.refusal("PERMISSION_DENIED", proto.PEER_DENIED,
                                   f"uid {uid} may not {self.denied_as} (local_uids)")
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ, denied)

    def _datagram(self, conn: socket.socket, denied: bytes | None) -> bool:
        """Serve one datagram; False when the connection is done (closed or refused)."""
        try:
            data, fds, _flags, _ = socket.recv_fds(conn, proto.MAX_DATAGRAM, 4, socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data and not fds:
            return False  # the client closed
        try:
            if denied is not None:
                raise Refused("PERMISSION_DENIED", proto.PEER_DENIED, "")
            reply, ok = self.handle(conn, data, fds)
        except Refused as e:
            reply, ok = denied or proto.refusal(e.code, e.reason, e.message), False
        finally:
            for fd in fds:
                os.close(fd)  # NOTE: a mapping holds its own reference
        return send_reply(conn, reply) and ok


def send_reply(conn: socket.socket, reply: bytes) -> bool:
    try:
        conn.setblocking(True)
        conn.settimeout(1.0)  # NOTE: a client that does not read cannot stall the thread for long
        conn.send(reply)
        conn.setblocking(False)
        return True
    except OSError:
        return False
