"""The log lines of real ``speckv serve`` processes: a decoder started with
``--log-format json --log-level debug`` after the subcommand, an encoder configured by
``SPECKV_LOG_FORMAT=text`` and ``SPECKV_LOG_LEVEL=debug``; one transfer between them,
one submit the encoder refuses and one fetch of a transfer never sent.

Every decoder line is one JSON object (time, level, logger, message, then the fields);
every encoder line is ``TIME LEVEL LOGGER: MESSAGE key=value...``; both carry RFC 3339
UTC timestamps of now; every line of a transfer carries its request id and its peer;
failures are WARNINGs."""

from __future__ import annotations

import json
import re
import signal
import time
from datetime import datetime, timezone

import grpc
import pytest
from server_helpers import MODEL, WAIT, rid, wait_until
from test_processes import ServeProc, _fetch_and_submit

from speckv.client.client import DecoderClient, EncoderClient, RpcFailed

TEXT = "Hello world, this is a test of the sidecar logs."
TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
TEXT_LINE = re.compile(rf"(?P<time>{TIME}) (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<logger>[\w.]+): "
                       r"(?P<rest>.*)")
PEER = re.compile(r"ipv[46]:\S+:\d+")


@pytest.fixture(scope="module")
def logged(tmp_path_factory, embedded_target):
    """(decoder JSON lines, encoder text lines, the request ids, the test's start) after the traffic."""
    logdir = tmp_path_factory.mktemp("log-format")
    t_start = time.time()
    dec = ServeProc("decoder", logdir, args=("--log-format", "json", "--log-level", "DEBUG"))
    enc = ServeProc("encoder", logdir, env={"SPECKV_LOG_FORMAT": "text", "SPECKV_LOG_LEVEL": "debug"})
    ids = embedded_target.tokenize(TEXT)
    kv = embedded_target.kv(ids)
    r = {"ok": rid("log-ok"), "refused": rid("log-refused"), "lost": rid("log-lost")}
    try:
        daddr, eaddr = dec.wait_ready(), enc.wait_ready()
        _fetch_and_submit(eaddr, daddr, r["ok"], kv, ids)
        with EncoderClient(eaddr, timeout=WAIT) as ec, pytest.raises(RpcFailed) as ei:
            ec.submit(r["refused"], kv, ids, daddr, "other-model", timeout=WAIT)
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with DecoderClient(daddr, timeout=WAIT) as dc, pytest.raises(RpcFailed) as ei:
            dc.fetch(r["lost"], wait=0.1, timeout=WAIT)
        assert ei.value.code == grpc.StatusCode.NOT_FOUND
        wait_until(lambda: r["lost"] in dec.log_tail(1 << 20), timeout=10, what="the decoder's fetch failure line")
        for p in (dec, enc):
            p.proc.send_signal(signal.SIGTERM)
            assert p.proc.wait(30) == 0, p.log_tail()
        return ([json.loads(x) for x in dec.log_tail(1 << 22).splitlines() if x.strip()],
                [x for x in enc.log_tail(1 << 22).splitlines() if x.strip()], r, t_start)
    finally:
        dec.kill()
        enc.kill()


def _recent(stamp: str, t_start: float) -> bool:
    t = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()
    return t_start - 1 <= t <= time.time() + 1


def test_json_lines(logged):
    lines, _, r, t_start = logged
    assert len(lines) >= 4
    for obj in lines:
        assert list(obj)[:4] == ["time", "level", "logger", "message"], obj
        assert re.fullmatch(TIME, obj["time"]) and _recent(obj["time"], t_start), obj
    received = [o for o in lines if o["message"].startswith(f"transfer {r['ok']} received: ")]
    assert len(received) == 1 and received[0]["level"] == "DEBUG" and received[0]["logger"] == "speckv.server.decoder"
    assert received[0]["request_id"] == r["ok"] and PEER.fullmatch(received[0]["peer"]), received
    (lost,) = [o for o in lines if r["lost"] in o["message"]]
    assert lost["message"].startswith(f"fetch {r['lost']} failed: NOT_FOUND no transfer with request id")
    assert (lost["level"], lost["logger"], lost["request_id"], lost["code"]) == (
        "WARNING", "speckv.server.fetch", r["lost"], "NOT_FOUND")
    assert PEER.fullmatch(lost["peer"])
    assert any(o["message"].startswith("decoder stopping") and o["level"] == "INFO" for o in lines)


def test_json_transfer_lines_carry_request_id_and_peer(logged):
    lines, _, r, _ = logged
    for obj in lines:
        named = [v for v in r.values() if v in obj["message"]]
        if named or "request_id" in obj:
            assert obj.get("request_id") in named and PEER.fullmatch(obj.get("peer", "")), obj
        if "failed" in obj["message"]:
            assert obj["level"] == "WARNING", obj


def _fields(rest: str) -> dict[str, str]:
    return dict(re.findall(r" (\w+)=(\S+)", rest))


def test_text_lines(logged):
    _, lines, r, t_start = logged
    parsed = [TEXT_LINE.fullmatch(x) for x in lines]
    assert all(parsed), [x for x, m in zip(lines, parsed, strict=True) if not m]
    assert all(_recent(m["time"], t_start) for m in parsed if m)
    (refused,) = [m for m in parsed if m and r["refused"] in m["rest"]]
    assert (refused["level"], refused["logger"]) == ("WARNING", "speckv.server.encoder")
    assert refused["rest"].startswith(f"submit {r['refused']} failed: FAILED_PRECONDITION ")
    f = _fields(refused["rest"])
    assert (f["request_id"], f["code"]) == (r["refused"], "FAILED_PRECONDITION") and PEER.fullmatch(f["peer"])
    assert re.fullmatch(r"127\.0\.0\.1:\d+", f["decoder"])
    sent = [m for m in parsed if m and m["rest"].startswith(f"submit {r['ok']} sent: ")]
    assert len(sent) == 1 and sent[0]["level"] == "DEBUG", sent
    assert _fields(sent[0]["rest"])["request_id"] == r["ok"]


def test_text_transfer_lines_carry_request_id_and_peer(logged):
    _, lines, r, _ = logged
    for m in (TEXT_LINE.fullmatch(x) for x in lines):
        assert m
        f = _fields(m["rest"])
        named = [v for v in r.values() if v in m["rest"].split(" request_id=")[0]]
        if named or "request_id" in f:
            assert f.get("request_id") in named and PEER.fullmatch(f.get("peer", "")), m.string
        if "failed" in m["rest"]:
            assert m["level"] == "WARNING", m.string


def test_info_lines_are_the_lifecycle_only(logged):
    """INFO lines are the sidecar's lifecycle only: nothing about a single transfer."""
    dec_lines, enc_lines, r, _ = logged
    info = [o["message"] for o in dec_lines if o["level"] == "INFO"]
    info += [m["rest"] for m in (TEXT_LINE.fullmatch(x) for x in enc_lines) if m and m["level"] == "INFO"]
    assert info and not [x for x in info if any(v in x for v in r.values())], info
    loaded = re.compile(rf"loaded predictor [0-9a-f]{{64}} for model {re.escape(MODEL)} \(resident \d+ MiB\)$")
    assert sum(bool(loaded.match(x)) for x in info) == 2, info
