"""Errors of the sidecars as gRPC status codes (and their in-band twins).

Handlers raise typed exceptions; ``to_status`` maps each to one precise gRPC
code and a message, the one place where that mapping lives. ``RpcError``
carries a code chosen by a handler itself (e.g. NOT_FOUND for an unknown
request id).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from speckv.errors import (BudgetExceeded, CalibrationError, CheckpointError, ChecksumError, FormatError,
                           HoldingClosed, IntegrityError, MuMismatchError, RansDecodeError, RpcError,
                           TransferDigestError,
                                 PinMismatchError, PromptMismatchError)
from speckv.v1 import common_pb2 as pb


logger = logging.getLogger(__name__)
C = grpc.StatusCode




_BY_TYPE: tuple[tuple[type, grpc.StatusCode], ...] = (
    (ChecksumError, C.DATA_LOSS),
    (FormatError, C.INVALID_ARGUMENT),
    (PinMismatchError, C.FAILED_PRECONDITION),
    (MuMismatchError, C.FAILED_PRECONDITION),
    (PromptMismatchError, C.INVALID_ARGUMENT),
    (IntegrityError, C.DATA_LOSS),
    (RansDecodeError, C.DATA_LOSS),  # a corrupt rANS payload behind a valid crc32
    (CheckpointError, C.FAILED_PRECONDITION),
    (CalibrationError, C.FAILED_PRECONDITION),
    (BudgetExceeded, C.RESOURCE_EXHAUSTED),
    (HoldingClosed, C.CANCELLED),
    (asyncio.TimeoutError, C.DEADLINE_EXCEEDED),
)


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC code and message that report ``exc`` to a caller."""
    if isinstance(exc, RpcError):
        return exc.code, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):  # from our own call to a peer sidecar
        return exc.code(), f"decoder: {exc.details()}"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # GeneratorExit: the caller went away
        return C.CANCELLED, "cancelled"
    for typ, code in _BY_TYPE:
        if isinstance(exc, typ):
            return code, str(exc) or typ.__name__
    logger.error("internal error", exc_info=exc)
    return C.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def integrity_kind(exc: BaseException) -> str | None:
    """The ``kind`` label of speckv_integrity_failures_total for ``exc``, if it is one."""
    if isinstance(exc, ChecksumError):
        return "crc32"
    if isinstance(exc, MuMismatchError):
        return "mu_fingerprint"
    if isinstance(exc, TransferDigestError):
        return "transfer_digest"
    if isinstance(exc, IntegrityError):
        return "raw_digest"
    if isinstance(exc, RansDecodeError):
        return "rans"
    return None


def outcome(code: grpc.StatusCode) -> str:
    """The ``outcome`` label of a finished transfer: ``ok`` or the status name."""
    return code.name.lower()


_IN_BAND = {
    C.OK: pb.STATUS_CODE_OK, C.INVALID_ARGUMENT: pb.STATUS_CODE_INVALID_ARGUMENT,
    C.FAILED_PRECONDITION: pb.STATUS_CODE_PIN_MISMATCH, C.DATA_LOSS: pb.STATUS_CODE_INTEGRITY_ERROR,
    C.ALREADY_EXISTS: pb.STATUS_CODE_ALREADY_EXISTS, C.NOT_FOUND: pb.STATUS_CODE_NOT_FOUND,
    C.CANCELLED: pb.STATUS_CODE_CANCELLED, C.DEADLINE_EXCEEDED: pb.STATUS_CODE_DEADLINE_EXCEEDED,
    C.UNAVAILABLE: pb.STATUS_CODE_UNAVAILABLE, C.RESOURCE_EXHAUSTED: pb.STATUS_CODE_RESOURCE_EXHAUSTED,
}


def in_band(exc: BaseException | None) -> pb.Status:
    """The in-band Status (TransferStatus.status) of a transfer ended by ``exc`` (None: ok)."""
    if exc is None:
        return pb.Status(code=pb.STATUS_CODE_OK)
    code, message = to_status(exc)
    if isinstance(exc, MuMismatchError):
        sc = pb.STATUS_CODE_MU_MISMATCH
    elif isinstance(exc, PromptMismatchError):
        sc = pb.STATUS_CODE_PROMPT_MISMATCH
    elif isinstance(exc, ChecksumError):
        sc = pb.STATUS_CODE_CHECKSUM_ERROR
    elif isinstance(exc, FormatError):
        sc = pb.STATUS_CODE_FORMAT_ERROR
    else:
        sc = _IN_BAND.get(code, pb.STATUS_CODE_INTERNAL)
    return pb.Status(code=sc, message=message)


_FROM_IN_BAND = {
    pb.STATUS_CODE_INVALID_ARGUMENT: C.INVALID_ARGUMENT, pb.STATUS_CODE_PIN_MISMATCH: C.FAILED_PRECONDITION,
    pb.STATUS_CODE_MODEL_MISMATCH: C.FAILED_PRECONDITION, pb.STATUS_CODE_FORMAT_ERROR: C.INVALID_ARGUMENT,
    pb.STATUS_CODE_CHECKSUM_ERROR: C.DATA_LOSS, pb.STATUS_CODE_TRUNCATED: C.INVALID_ARGUMENT,
    pb.STATUS_CODE_MU_MISMATCH: C.FAILED_PRECONDITION, pb.STATUS_CODE_PROMPT_MISMATCH: C.INVALID_ARGUMENT,
    pb.STATUS_CODE_INTEGRITY_ERROR: C.DATA_LOSS, pb.STATUS_CODE_ALREADY_EXISTS: C.ALREADY_EXISTS,
    pb.STATUS_CODE_NOT_FOUND: C.NOT_FOUND, pb.STATUS_CODE_CANCELLED: C.CANCELLED,
    pb.STATUS_CODE_DEADLINE_EXCEEDED: C.DEADLINE_EXCEEDED, pb.STATUS_CODE_UNAVAILABLE: C.UNAVAILABLE,
    pb.STATUS_CODE_RESOURCE_EXHAUSTED: C.RESOURCE_EXHAUSTED,
}


def from_in_band(status: pb.Status) -> grpc.StatusCode:
    """The gRPC code of an in-band Status (INTERNAL for anything unknown)."""
    return C.OK if status.code == pb.STATUS_CODE_OK else _FROM_IN_BAND.get(status.code, C.INTERNAL)
