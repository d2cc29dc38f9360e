"""The local KV hand-off's protocol, shared by the client and the encoder sidecar.

A client on the encoder's host puts raw KV bytes in a memfd, seals it against
every change of size or content (``REQUIRED_SEALS``) and sends it, with
SCM_RIGHTS, over the encoder's Unix socket (SOCK_SEQPACKET: one datagram per
hand-off, connection kept for more). The encoder checks the peer's credentials
(SO_PEERCRED), the seals and the size, maps the memfd read-only and answers with
a handle, which the gRPC Submit then names in ``LocalLayer`` messages instead of
sending the bytes. Both directions are one small JSON object per datagram:

* request: ``{"v": 1, "bytes": N}`` with exactly one fd (N: its size);
* reply: ``{"handle": "...", "bytes": N, "ttl_s": T}``, or on refusal
  ``{"code": "PERMISSION_DENIED", "reason": "LOCAL_PEER_DENIED", "message": "..."}``
  (``code``: a gRPC status code name), after which the encoder closes the connection.

The decoder's local socket runs the other direction, for an engine that fetches
(``FetchKVRequest.local_mailbox``): the client connects, asks for a mailbox and
keeps the connection; each local fetch's memfd then comes to it as one datagram:

* request: ``{"v": 1, "mailbox": true}`` (no fd); reply: ``{"mailbox": "..."}``
  (the token the FetchKV names) or a refusal as above;
* then, per local fetch: ``{"memfd": "<id>", "bytes": N}`` with exactly one fd,
  the id that fetch's ``LocalFetchLayer.memfd_id`` names.

Imports nothing of the client or the server (both use it).
"""

from __future__ import annotations

import fcntl
import json
from typing import Any

VERSION = 1
MAX_DATAGRAM = 4096  # a request or reply is far smaller
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
ALL_SEALS = REQUIRED_SEALS | fcntl.F_SEAL_SEAL  # what the client sets: nothing can be changed or added after
MEMFD_NAME = "speckv-kv"  # shown as /memfd:speckv-kv in /proc/PID/fd and maps

# ErrorInfo reasons of hand-off refusals (speckv.status lists the Submit-side ones)
PEER_DENIED = "LOCAL_PEER_DENIED"
UNSEALED = "LOCAL_FD_UNSEALED"
BAD_REQUEST = "LOCAL_BAD_REQUEST"
OVER_LIMIT = "LOCAL_OVER_LIMIT"
MAILBOX_UNKNOWN = "LOCAL_MAILBOX_UNKNOWN"
MAILBOX_GONE = "LOCAL_MAILBOX_GONE"
SOCKET_OFF = "LOCAL_SOCKET_OFF"  # a local request to a sidecar without a local socket


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    """A datagram's object; ValueError when it is not one."""
    obj = json.loads(data.decode())
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def refusal(code: str, reason: str, message: str) -> bytes:
    return encode({"code": code, "reason": reason, "message": message})
