"""status: each failure type maps to one gRPC code (and its in-band twin),
the one place the sidecars' error contract lives."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from speckv.coder import container as ct
from speckv.errors import (CalibrationError, CheckpointError, IntegrityError, MuMismatchError,
                                 PinMismatchError, PromptMismatchError)
from speckv.server.budget import BudgetExceeded, HoldingClosed
from speckv.status import RpcError, in_band, integrity_kind, outcome, to_status
from speckv.v1 import common_pb2 as pb

C = grpc.StatusCode


@pytest.mark.parametrize("exc,code,in_band_code,kind", [
    (RpcError(C.NOT_FOUND, "no such id"), C.NOT_FOUND, pb.STATUS_CODE_NOT_FOUND, None),
    (RpcError(C.ALREADY_EXISTS, "dup"), C.ALREADY_EXISTS, pb.STATUS_CODE_ALREADY_EXISTS, None),
    (ct.ChecksumError("crc"), C.DATA_LOSS, pb.STATUS_CODE_CHECKSUM_ERROR, "crc32"),
    (ct.FormatError("magic"), C.INVALID_ARGUMENT, pb.STATUS_CODE_FORMAT_ERROR, None),
    (PinMismatchError("pin"), C.FAILED_PRECONDITION, pb.STATUS_CODE_PIN_MISMATCH, None),
    (MuMismatchError("mu"), C.FAILED_PRECONDITION, pb.STATUS_CODE_MU_MISMATCH, "mu_fingerprint"),
    (PromptMismatchError("ids"), C.INVALID_ARGUMENT, pb.STATUS_CODE_PROMPT_MISMATCH, None),
    (IntegrityError("digest"), C.DATA_LOSS, pb.STATUS_CODE_INTEGRITY_ERROR, "raw_digest"),
    (CheckpointError("ckpt"), C.FAILED_PRECONDITION, pb.STATUS_CODE_PIN_MISMATCH, None),
    (CalibrationError("calib"), C.FAILED_PRECONDITION, pb.STATUS_CODE_PIN_MISMATCH, None),
    (BudgetExceeded("too big"), C.RESOURCE_EXHAUSTED, pb.STATUS_CODE_RESOURCE_EXHAUSTED, None),
    (HoldingClosed("ended"), C.CANCELLED, pb.STATUS_CODE_CANCELLED, None),
    (asyncio.TimeoutError(), C.DEADLINE_EXCEEDED, pb.STATUS_CODE_DEADLINE_EXCEEDED, None),
    (asyncio.CancelledError(), C.CANCELLED, pb.STATUS_CODE_CANCELLED, None),
    (KeyError("oops"), C.INTERNAL, pb.STATUS_CODE_INTERNAL, None),
])
def test_mapping(exc, code, in_band_code, kind):
    got, msg = to_status(exc)
    assert got == code and msg
    st = in_band(exc)
    assert st.code == in_band_code and st.message == msg
    assert integrity_kind(exc) == kind


def test_messages():
    assert to_status(RpcError(C.NOT_FOUND, "no transfer 'x'")) == (C.NOT_FOUND, "no transfer 'x'")
    assert to_status(asyncio.TimeoutError()) == (C.DEADLINE_EXCEEDED, "TimeoutError")
    assert to_status(asyncio.CancelledError()) == (C.CANCELLED, "cancelled")
    assert to_status(KeyError("oops"))[1] == "internal error: KeyError: 'oops'"


def test_ok_and_outcome_labels():
    assert in_band(None) == pb.Status(code=pb.STATUS_CODE_OK)
    assert outcome(C.OK) == "ok"
    assert outcome(C.FAILED_PRECONDITION) == "failed_precondition"
