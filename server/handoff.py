"""The encoder's local KV hand-off: sealed memfds received over a Unix socket.

An engine on this host hands its KV over as a memfd instead of pushing the bytes
through protobuf on loopback (protocol: ``speckv/handoff.py``). ``Handoffs``
listens on ``config.local_socket`` (SOCK_SEQPACKET) in one thread and, per datagram:

* checks the peer's credentials (SO_PEERCRED) against ``config.local_uids`` (by
  default this process's own uid): PERMISSION_DENIED otherwise;
* checks the fd is a memfd sealed against shrinking, growing and writing
  (F_GET_SEALS): FAILED_PRECONDITION otherwise, so no client can truncate the pages
  under the sidecar (a SIGBUS) or change bytes already digested;
* checks the size it declared and the limits: at most ``local_max_handles`` mapped fds
  and ``max_inflight_bytes`` mapped bytes in all (RESOURCE_EXHAUSTED);
* maps it read-only (MAP_SHARED: the client's pages, nothing copied) and answers a
  random 128-bit handle.

A Submit claims the handles its ``LocalLayer`` messages name (``claim``) and reads its
layers as views of the mapping; the call's end releases them (``release``). A handle
no Submit claimed within ``local_handle_ttl_s`` is closed. Every refusal is one reply
naming a gRPC status code and an ErrorInfo reason; the connection is closed after it.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass

import grpc

from speckv import handoff as proto
from speckv.errors import RpcError

from .local_socket import LocalListener, Refused, parse_uids

__all__ = ["Handoffs", "Mapping", "Refused", "check_fd", "parse_uids"]

logger = logging.getLogger(__name__)
UNKNOWN_HANDLE = "LOCAL_HANDLE_UNKNOWN"


@dataclass
class Mapping:
    """One received memfd, mapped read-only."""

    handle: str
    mm: mmap.mmap
    size: int
    created: float
    owner: object | None = None  # the Submit (its Job) that claimed it

    def view(self, offset: int, n: int) -> memoryview:
        if offset + n > self.size:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"bytes [{offset}, {offset + n}) lie outside the "
                           f"{self.size} bytes of local handle {self.handle[:8]}...", reason="LOCAL_RANGE")
        return memoryview(self.mm)[offset:offset + n]

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # NOTE: a view still alive (a record in flight): unmapped when it dies
            logger.debug("local handle %s: views alive, unmapped by the garbage collector", self.handle[:8])


class Handoffs(LocalListener):
    """The Unix socket, its thread, and the handles it gave out."""

    what = "local hand-off"
    denied_as = "hand KV to this encoder"

    def __init__(self, path: str, uids: frozenset[int], ttl_s: float, max_handles: int, max_bytes: int) -> None:
        super().__init__(path, uids)
        self.ttl_s, self.max_handles, self.max_bytes = ttl_s, max_handles, max_bytes
        self._lock = threading.Lock()
        self._maps: dict[str, Mapping] = {}
        self._mapped = 0

    @property
    def mapped_bytes(self) -> int:
        return self._mapped

    @property
    def handles(self) -> int:
        return len(self._maps)

    def stop(self) -> None:
        super().stop()
        with self._lock:
            for m in self._maps.values():
                m.close()
            self._maps.clear()
            self._mapped = 0

    # -- the socket thread ------------------------------------------------------

    def handle(self, conn: socket.socket, data: bytes, fds: list[int]) -> tuple[bytes, bool]:
        return self._register(data, fds), True

    def tick(self) -> None:
        self.expire()

    def _register(self, data: bytes, fds: list[int]) -> bytes:
        try:
            size = int(proto.decode(data)["bytes"])
        except (ValueError, KeyError, TypeError):
            raise Refused("INVALID_ARGUMENT", proto.BAD_REQUEST, "a hand-off is {\"v\": 1, \"bytes\": N}") from None
        if len(fds) != 1:
            raise Refused("INVALID_ARGUMENT", proto.BAD_REQUEST, f"a hand-off carries one fd, not {len(fds)}")
        check_fd(fds[0], size)
        with self._lock:
            if len(self._maps) >= self.max_handles:
                raise Refused("RESOURCE_EXHAUSTED", proto.OVER_LIMIT,
                              f"{len(self._maps)} local handles open (local_max_handles)")
            if self._mapped + size > self.max_bytes:
                raise Refused("RESOURCE_EXHAUSTED", proto.OVER_LIMIT, f"{size} bytes over the {self.max_bytes} "
                              f"bytes of mapped hand-offs ({self._mapped} mapped; max_inflight_bytes)")
            mm = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            handle = secrets.token_hex(16)
            self._maps[handle] = Mapping(handle, mm, size, time.monotonic())
            self._mapped += size
        return proto.encode({"handle": handle, "bytes": size, "ttl_s": self.ttl_s})

    # -- the Submit side (the event loop's thread) --------------------------------

    def claim(self, handle: str, owner: object) -> Mapping:
        """The mapping of ``handle`` for the Submit ``owner`` (INVALID_ARGUMENT when it is
        unknown, expired or claimed by another Submit)."""
        with self._lock:
            m = self._maps.get(handle)
            if m is not None and m.owner is None and time.monotonic() - m.created <= self.ttl_s:
                m.owner = owner
            if m is None or m.owner is not owner:
                raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"local handle {handle[:8]}... is unknown, "
                               "expired or used by another submit", reason=UNKNOWN_HANDLE)
            return m

    def release(self, owner: object) -> None:
        """Close every mapping ``owner`` claimed (its Submit ended)."""
        with self._lock:
            for h in [h for h, m in self._maps.items() if m.owner is owner]:
                self._drop(h)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for h in [h for h, m in self._maps.items() if m.owner is None and now - m.created > self.ttl_s]:
                logger.info("local handle %s expired unclaimed", h[:8])
                self._drop(h)

    def _drop(self, handle: str) -> None:
        m = self._maps.pop(handle)
        self._mapped -= m.size
        m.close()


def check_fd(fd: int, size: int) -> None:
    """Refused unless ``fd`` is a sealed memfd of ``size`` bytes."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Refused("INVALID_ARGUMENT", proto.BAD_REQUEST, "the fd is not a memfd")
    try:
        seals = fcntl_seals(fd)
    except OSError:
        raise Refused("FAILED_PRECONDITION", proto.UNSEALED, "the fd does not support seals: send a memfd "
                      "created with MFD_ALLOW_SEALING") from None
    missing = proto.REQUIRED_SEALS & ~seals
    if missing:
        raise Refused("FAILED_PRECONDITION", proto.UNSEALED, f"the memfd lacks seals {missing:#x}: seal it with "
                      "F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE before handing it over")
    if st.st_size != size or size <= 0:
        raise Refused("INVALID_ARGUMENT", proto.BAD_REQUEST, f"the memfd holds {st.st_size} bytes, the hand-off "
                      f"declares {size} (must be equal and > 0)")


def fcntl_seals(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GET_SEALS)
