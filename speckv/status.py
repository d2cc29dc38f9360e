"""The sidecars' error contract: one table from exception type to gRPC status.

Each row names, for one exception type, the gRPC code a caller sees, the
``google.rpc.ErrorInfo`` reason carried in the status details (grpcio-status's
``grpc-status-details-bin`` trailer), the in-band ``speckv.v1.StatusCode`` of a
transfer's verdict (``TransferResult.status``, ``TransferStatus.status``) and the
``kind`` label of ``speckv_integrity_failures_total``. The first matching row
wins, so subclasses come before their bases. ``RpcError`` carries its code (and
optionally its reason) chosen by the raiser; RESOURCE_EXHAUSTED and UNAVAILABLE
also carry a ``google.rpc.RetryInfo``.

Sidecars report with ``abort(context, exc)``; clients read the details back with
``error_details(rpc_error)``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from speckv.errors import (
    BudgetExceeded,
    CalibrationError,
    CheckpointError,
    ChecksumError,
    FormatError,
    HoldingClosed,
    IntegrityError,
    MuMismatchError,
    PinMismatchError,
    PromptMismatchError,
    RansDecodeError,
    RpcError,
    TransferDigestError,
    UnsupportedVersionError,
)
from speckv.v1 import common_pb2 as pb

logger = logging.getLogger(__name__)
C = grpc.StatusCode

DOMAIN = "speckv"  # google.rpc.ErrorInfo.domain of every speckv error
RETRY_AFTER_S = 1.0  # google.rpc.RetryInfo.retry_delay on RESOURCE_EXHAUSTED and UNAVAILABLE
DETAILS_KEY = "grpc-status-details-bin"  # the trailer grpcio-status reads (google.rpc.Status)
RETRYABLE = (C.RESOURCE_EXHAUSTED, C.UNAVAILABLE)


@dataclass(frozen=True)
class Row:
    exc: type[BaseException]
    code: grpc.StatusCode
    reason: str  # google.rpc.ErrorInfo.reason
    in_band: int  # speckv.v1.StatusCode
    integrity: str | None = None  # speckv_integrity_failures_total{kind}


TABLE: tuple[Row, ...] = (
    Row(ChecksumError, C.DATA_LOSS, "CHECKSUM_MISMATCH", pb.STATUS_CODE_CHECKSUM_ERROR, "crc32"),
    Row(UnsupportedVersionError, C.INVALID_ARGUMENT, "UNSUPPORTED_VERSION", pb.STATUS_CODE_FORMAT_ERROR),
    Row(FormatError, C.INVALID_ARGUMENT, "MALFORMED_STREAM", pb.STATUS_CODE_FORMAT_ERROR),
    Row(PinMismatchError, C.FAILED_PRECONDITION, "PIN_MISMATCH", pb.STATUS_CODE_PIN_MISMATCH),
    Row(MuMismatchError, C.FAILED_PRECONDITION, "MU_MISMATCH", pb.STATUS_CODE_MU_MISMATCH, "mu_fingerprint"),
    Row(PromptMismatchError, C.INVALID_ARGUMENT, "PROMPT_MISMATCH", pb.STATUS_CODE_PROMPT_MISMATCH),
    Row(TransferDigestError, C.DATA_LOSS, "TRANSFER_DIGEST_MISMATCH", pb.STATUS_CODE_INTEGRITY_ERROR,
        "transfer_digest"),
    Row(IntegrityError, C.DATA_LOSS, "RAW_DIGEST_MISMATCH", pb.STATUS_CODE_INTEGRITY_ERROR, "raw_digest"),
    # a corrupt rANS payload behind a valid crc32
    Row(RansDecodeError, C.DATA_LOSS, "RANS_CORRUPT", pb.STATUS_CODE_INTEGRITY_ERROR, "rans"),
    Row(CheckpointError, C.FAILED_PRECONDITION, "CHECKPOINT_ERROR", pb.STATUS_CODE_FAILED_PRECONDITION),
    Row(CalibrationError, C.FAILED_PRECONDITION, "CALIBRATION_ERROR", pb.STATUS_CODE_FAILED_PRECONDITION),
    Row(BudgetExceeded, C.RESOURCE_EXHAUSTED, "BUDGET_EXCEEDED", pb.STATUS_CODE_RESOURCE_EXHAUSTED),
    Row(HoldingClosed, C.CANCELLED, "TRANSFER_ENDED", pb.STATUS_CODE_CANCELLED),
    Row(asyncio.TimeoutError, C.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", pb.STATUS_CODE_DEADLINE_EXCEEDED),
    Row(asyncio.CancelledError, C.CANCELLED, "CANCELLED", pb.STATUS_CODE_CANCELLED),
    Row(GeneratorExit, C.CANCELLED, "CANCELLED", pb.STATUS_CODE_CANCELLED),  # the caller went away
)

# NOTE: an RpcError's in-band code follows its reason where one is named here, else its code
_IN_BAND_BY_REASON = {"PIN_MISMATCH": pb.STATUS_CODE_PIN_MISMATCH, "MODEL_MISMATCH": pb.STATUS_CODE_MODEL_MISMATCH}
_IN_BAND_BY_CODE = {
    C.OK: pb.STATUS_CODE_OK, C.INVALID_ARGUMENT: pb.STATUS_CODE_INVALID_ARGUMENT,
    C.FAILED_PRECONDITION: pb.STATUS_CODE_FAILED_PRECONDITION, C.DATA_LOSS: pb.STATUS_CODE_INTEGRITY_ERROR,
    C.ALREADY_EXISTS: pb.STATUS_CODE_ALREADY_EXISTS, C.NOT_FOUND: pb.STATUS_CODE_NOT_FOUND,
    C.CANCELLED: pb.STATUS_CODE_CANCELLED, C.DEADLINE_EXCEEDED: pb.STATUS_CODE_DEADLINE_EXCEEDED,
    C.UNAVAILABLE: pb.STATUS_CODE_UNAVAILABLE, C.RESOURCE_EXHAUSTED: pb.STATUS_CODE_RESOURCE_EXHAUSTED,
}
_CODE_BY_IN_BAND = {v: k for k, v in _IN_BAND_BY_CODE.items()} | {
    pb.STATUS_CODE_PIN_MISMATCH: C.FAILED_PRECONDITION, pb.STATUS_CODE_MODEL_MISMATCH: C.FAILED_PRECONDITION,
    pb.STATUS_CODE_FORMAT_ERROR: C.INVALID_ARGUMENT, pb.STATUS_CODE_CHECKSUM_ERROR: C.DATA_LOSS,
    pb.STATUS_CODE_TRUNCATED: C.INVALID_ARGUMENT, pb.STATUS_CODE_MU_MISMATCH: C.FAILED_PRECONDITION,
    pb.STATUS_CODE_PROMPT_MISMATCH: C.INVALID_ARGUMENT,
}


# the reason an in-band code names unambiguously (one reason, and not a generic code's twin)
_REASON_BY_IN_BAND = {code: reason for reason, code in _IN_BAND_BY_REASON.items()} | {
    row.in_band: row.reason for row in TABLE
    if row.in_band not in _IN_BAND_BY_CODE.values() and sum(r.in_band == row.in_band for r in TABLE) == 1}


@dataclass(frozen=True)
class Verdict:
    """How one exception reaches a caller."""

    code: grpc.StatusCode
    message: str
    reason: str
    in_band: int
    integrity: str | None = None


def verdict(exc: BaseException) -> Verdict:
    """The status that reports ``exc`` (INTERNAL for anything unforeseen; ``abort`` logs it)."""
    if isinstance(exc, RpcError):
        reason = exc.reason or exc.code.name
        in_band = _IN_BAND_BY_REASON.get(reason, _IN_BAND_BY_CODE.get(exc.code, pb.STATUS_CODE_INTERNAL))
        return Verdict(exc.code, str(exc), reason, in_band)
    if isinstance(exc, grpc.aio.AioRpcError):  # from our own call to a peer sidecar
        reason = error_details(exc)[0] or exc.code().name
        return Verdict(exc.code(), f"decoder: {exc.details()}", reason,
                       _IN_BAND_BY_REASON.get(reason, _IN_BAND_BY_CODE.get(exc.code(), pb.STATUS_CODE_INTERNAL)))
    for row in TABLE:
        if isinstance(exc, row.exc):
            message = "cancelled" if row.code == C.CANCELLED and not str(exc) else str(exc) or row.exc.__name__
            return Verdict(row.code, message, row.reason, row.in_band, row.integrity)
    return Verdict(C.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", "INTERNAL", pb.STATUS_CODE_INTERNAL)


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC code and message that report ``exc`` to a caller."""
    v = verdict(exc)
    return v.code, v.message


def integrity_kind(exc: BaseException) -> str | None:
    """The ``kind`` label of speckv_integrity_failures_total for ``exc``, if it is one."""
    return verdict(exc).integrity if not isinstance(exc, (RpcError, grpc.aio.AioRpcError)) else None


def outcome(code: grpc.StatusCode) -> str:
    """The ``outcome`` label of a finished transfer: ``ok`` or the status name."""
    return str(code.name).lower()


def in_band(exc: BaseException | None) -> pb.Status:
    """The in-band Status (TransferStatus.status) of a transfer ended by ``exc`` (None: ok)."""
    if exc is None:
        return pb.Status(code=pb.STATUS_CODE_OK)
    v = verdict(exc)
    return pb.Status(code=v.in_band, message=v.message, reason=v.reason)


def from_in_band(status: pb.Status, prefix: str = "decoder: ") -> RpcError:
    """The error an in-band verdict stands for (its code INTERNAL when unknown)."""
    code = _CODE_BY_IN_BAND.get(status.code, C.INTERNAL)
    # NOTE: a peer from before Status.reason sends none: its in-band code names the failure
    reason = status.reason or _REASON_BY_IN_BAND.get(status.code, code.name)
    return RpcError(code, prefix + status.message, reason=reason)


def details(v: Verdict) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata carrying ``v`` as a google.rpc.Status with its details."""
    info = error_details_pb2.ErrorInfo(reason=v.reason, domain=DOMAIN)
    st = status_pb2.Status(code=v.code.value[0], message=v.message)
    st.details.add().Pack(info)
    if v.code in RETRYABLE:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(RETRY_AFTER_S * 1e9))
        st.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return ((DETAILS_KEY, st.SerializeToString()),)


async def abort(context: grpc.aio.ServicerContext, exc: BaseException | Verdict) -> None:
    """End the call with ``exc``'s status, its ErrorInfo (and RetryInfo) attached."""
    v = exc if isinstance(exc, Verdict) else verdict(exc)
    if v.code == C.INTERNAL and not isinstance(exc, Verdict):
        logger.error("internal error", exc_info=exc)  # NOTE: once per failed call, here alone
    await context.abort(v.code, v.message, trailing_metadata=details(v))


def error_details(err: Any) -> tuple[str, float | None]:
    """(ErrorInfo reason, RetryInfo delay in seconds) of a failed call; ("", None) without details."""
    try:
        trailers = err.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 -- a call that never reached a server has none
        return "", None
    raw = next((v for k, v in trailers if k == DETAILS_KEY), None)
    if not isinstance(raw, bytes):
        return "", None
    st = status_pb2.Status()
    try:
        st.ParseFromString(raw)
    except Exception:  # noqa: BLE001 -- a peer's malformed trailer is no details
        return "", None
    reason, retry = "", None
    for d in st.details:
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
            reason = info.reason
        elif d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            ri = error_details_pb2.RetryInfo()
            d.Unpack(ri)
            retry = ri.retry_delay.ToNanoseconds() / 1e9
    return reason, retry
