"""status: each failure type maps to one gRPC code (and its in-band twin),
the one place the sidecars' error contract lives."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from speckv.coder import container as ct
from speckv.errors import (
    BudgetExceeded,
    CalibrationError,
    CheckpointError,
    HoldingClosed,
    IntegrityError,
    MuMismatchError,
    PinMismatchError,
    PromptMismatchError,
    RpcError,
    UnsupportedVersionError,
)
from speckv.status import in_band, integrity_kind, outcome, to_status
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
    (CheckpointError("ckpt"), C.FAILED_PRECONDITION, pb.STATUS_CODE_FAILED_PRECONDITION, None),
    (CalibrationError("calib"), C.FAILED_PRECONDITION, pb.STATUS_CODE_FAILED_PRECONDITION, None),
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


# -- the one table: reasons, the in-band twin, google.rpc details -----------------------

def test_every_row_has_a_distinct_reason_and_codes_agree():
    from speckv.status import TABLE, verdict

    seen = {}
    for row in TABLE:
        assert row.reason.isupper() and " " not in row.reason, row
        seen.setdefault(row.reason, set()).add(row.code)
        v = verdict(row.exc("x") if row.exc not in (asyncio.CancelledError, GeneratorExit) else row.exc())
        assert (v.code, v.reason, v.in_band, v.integrity) == (row.code, row.reason, row.in_band, row.integrity)
    assert all(len(codes) == 1 for codes in seen.values()), seen


@pytest.mark.parametrize("exc,in_band_code,reason", [
    # the misreport this table fixed: every FAILED_PRECONDITION was in-band PIN_MISMATCH
    (RpcError(C.FAILED_PRECONDITION, "model 'x' is not served here", reason="MODEL_MISMATCH"),
     pb.STATUS_CODE_MODEL_MISMATCH, "MODEL_MISMATCH"),
    (RpcError(C.FAILED_PRECONDITION, "already fetched", reason="ALREADY_FETCHED"),
     pb.STATUS_CODE_FAILED_PRECONDITION, "ALREADY_FETCHED"),
    (RpcError(C.FAILED_PRECONDITION, "pin", reason="PIN_MISMATCH"), pb.STATUS_CODE_PIN_MISMATCH, "PIN_MISMATCH"),
    (CheckpointError("bad tables"), pb.STATUS_CODE_FAILED_PRECONDITION, "CHECKPOINT_ERROR"),
    (RpcError(C.NOT_FOUND, "no such id"), pb.STATUS_CODE_NOT_FOUND, "NOT_FOUND"),
    # the encoder's handshake tells a newer format from a malformed stream by this reason (server/replies.py)
    (UnsupportedVersionError("unsupported format version 5"), pb.STATUS_CODE_FORMAT_ERROR, "UNSUPPORTED_VERSION"),
    (ct.FormatError("bad magic"), pb.STATUS_CODE_FORMAT_ERROR, "MALFORMED_STREAM"),
])
def test_in_band_follows_the_reason(exc, in_band_code, reason):
    from speckv.status import from_in_band

    st = in_band(exc)
    assert (st.code, st.reason) == (in_band_code, reason)
    back = from_in_band(st)
    assert (back.code, back.reason) == (to_status(exc)[0], reason)


@pytest.mark.parametrize("exc,reason,retry", [
    (RpcError(C.RESOURCE_EXHAUSTED, "cap", reason="PEER_LIMIT"), "PEER_LIMIT", 1.0),
    (RpcError(C.UNAVAILABLE, "draining"), "UNAVAILABLE", 1.0),
    (MuMismatchError("mu"), "MU_MISMATCH", None),
    (ct.ChecksumError("crc"), "CHECKSUM_MISMATCH", None),
])
def test_details_reach_a_real_client(exc, reason, retry):
    """A real grpc.aio server aborts with ``abort``; the sync client reads the
    google.rpc.Status details back (grpcio-status's own parser agrees)."""
    from grpc_status import rpc_status

    from speckv.status import abort, error_details

    async def fail(request, context):
        await abort(context, exc)

    async def run():
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(fail)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {"F": handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return port, server
        except BaseException:
            await server.stop(None)
            raise

    async def call(port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await ch.unary_unary("/t.T/F")(b"", timeout=10)
            return ei.value

    async def main():
        port, server = await run()
        try:
            return await call(port)
        finally:
            await server.stop(None)

    err = asyncio.run(main())
    assert err.code() == to_status(exc)[0]
    assert error_details(err) == (reason, retry)
    st = rpc_status.from_call(err)  # the standard parser: code and message agree with the trailer
    assert st is not None and st.code == err.code().value[0] and st.message == err.details()


def test_error_details_without_a_trailer():
    from speckv.status import error_details

    class NoTrailer:
        def trailing_metadata(self):
            return (("other", b"x"),)

    assert error_details(NoTrailer()) == ("", None)
    assert error_details(object()) == ("", None)


@pytest.mark.parametrize("code,reason", [
    (pb.STATUS_CODE_PIN_MISMATCH, "PIN_MISMATCH"), (pb.STATUS_CODE_MU_MISMATCH, "MU_MISMATCH"),
    (pb.STATUS_CODE_CHECKSUM_ERROR, "CHECKSUM_MISMATCH"),
    (pb.STATUS_CODE_INTEGRITY_ERROR, "DATA_LOSS"),  # several reasons share it: the code's name, no guess
    (pb.STATUS_CODE_CANCELLED, "CANCELLED"),
])
def test_a_peer_without_reasons_keeps_its_in_band_meaning(code, reason):
    """A decoder from before Status.reason sends only the in-band code."""
    from speckv.status import from_in_band

    assert from_in_band(pb.Status(code=code, message="m")).reason == reason


def test_an_internal_error_is_logged_once_per_call(caplog):
    from speckv.status import abort, verdict

    class Context:
        aborted = None

        async def abort(self, code, message, trailing_metadata=()):
            self.aborted = (code, message)

    exc = KeyError("oops")
    with caplog.at_level("ERROR", logger="speckv.status"):
        for _ in range(3):  # handlers ask for the code, the integrity kind and the in-band twin
            verdict(exc), integrity_kind(exc), in_band(exc)
        assert caplog.records == []
        ctx = Context()
        asyncio.run(abort(ctx, exc))
    assert ctx.aborted == (C.INTERNAL, "internal error: KeyError: 'oops'")
    assert [r.getMessage() for r in caplog.records] == ["internal error"]
