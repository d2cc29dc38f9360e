"""Who may call what: an optional allow-list of client identities per RPC.

Identities are the client certificate's common name or DNS subject alternative
names, so an allow-list needs mutual TLS (``tls_ca``). The spec, from
``--allow`` / ``SPECKV_ALLOW``, is ``RPC=ID[,ID...][;RPC=...]`` with RPC one of
Transfer, FetchKV, GetTransferStatus, CancelTransfer, Submit, or ``*`` for
every RPC not named; an RPC the spec does not cover (and no ``*``) is open to
every client that passed mTLS. A refused call ends with PERMISSION_DENIED.
"""

from __future__ import annotations

import grpc

from speckv.errors import RpcError
from speckv.status import abort

RPCS = ("Transfer", "FetchKV", "GetTransferStatus", "CancelTransfer", "Submit")


def parse_allow(spec: str | None) -> dict[str, frozenset[str]]:
    """``RPC=ID,ID;RPC=ID`` -> {rpc: identities}; ValueError on anything else."""
    out: dict[str, frozenset[str]] = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(";"))):
        rpc, eq, ids = part.partition("=")
        rpc = rpc.strip()
        names = frozenset(i.strip() for i in ids.split(",") if i.strip())
        if not eq or (rpc not in RPCS and rpc != "*") or not names:
            raise ValueError(f"allow entry {part!r} is not RPC=ID[,ID...] with RPC in {RPCS} or *")
        if rpc in out:
            raise ValueError(f"allow names {rpc} twice")
        out[rpc] = names
    return out


def identities(context: grpc.aio.ServicerContext) -> set[str]:
    """The caller's certificate names (common name, DNS SANs); empty without mTLS."""
    ctx = context.auth_context() or {}
    names: set[str] = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for v in ctx.get(key, []):
            names.add(v.decode() if isinstance(v, bytes) else str(v))
    return names


async def authorize(context: grpc.aio.ServicerContext, rpc: str, allow: dict[str, frozenset[str]]) -> None:
    """Abort the call with PERMISSION_DENIED unless the caller may call ``rpc``."""
    allowed = allow.get(rpc, allow.get("*"))
    if allowed is None:
        return
    who = identities(context)
    if not who & allowed:
        await abort(context, RpcError(grpc.StatusCode.PERMISSION_DENIED,
                                      f"{rpc}: client {sorted(who) or '(no certificate)'} is not in the allow-list",
                                      reason="NOT_ALLOWED"))
