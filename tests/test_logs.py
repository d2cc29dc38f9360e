"""speckv/logs.py: the two formats, levels, and fields bound per asyncio task."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re

import pytest

from speckv import logs


@pytest.fixture
def stream():
    """Where ``logs.configure`` writes (tests/conftest.py restores the root logger after each test)."""
    return io.StringIO()


def test_json_line(stream):
    logs.configure("json", "info", stream=stream)
    logging.getLogger("speckv.x").warning("a %s", "b", extra={"code": "NOT_FOUND"})
    obj = json.loads(stream.getvalue())
    assert list(obj) == ["time", "level", "logger", "message", "code"]
    assert (obj["level"], obj["logger"], obj["message"], obj["code"]) == ("WARNING", "speckv.x", "a b", "NOT_FOUND")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", obj["time"])


def test_text_line_quotes_values_with_spaces(stream):
    logs.configure("text", "info", stream=stream)
    logging.getLogger("speckv.x").info("hello", extra={"peer": "ipv4:1.2.3.4:5", "why": "two words"})
    assert re.fullmatch(r'\S+Z INFO speckv.x: hello peer=ipv4:1.2.3.4:5 why="two words"\n', stream.getvalue())


def test_levels(stream):
    logs.configure("text", "info", stream=stream)
    logging.getLogger("speckv.x").debug("hidden")
    logging.getLogger("other").info("hidden too")  # other libraries: warning and up
    logging.getLogger("other").warning("shown")
    logging.getLogger("speckv.x").info("shown too")
    assert [line.split(" ", 2)[2] for line in stream.getvalue().splitlines()] == ["other: shown",
                                                                                 "speckv.x: shown too"]


def test_verbose_is_debug_everywhere(stream):
    logs.configure("text", "warning", verbose=True, stream=stream)
    logging.getLogger("other").debug("shown")
    assert "DEBUG other: shown" in stream.getvalue()


def test_exception_in_json(stream):
    logs.configure("json", "info", stream=stream)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("speckv.x").exception("failed")
    obj = json.loads(stream.getvalue())
    assert obj["message"] == "failed" and "RuntimeError: boom" in obj["exc_info"]


def test_bound_fields_stay_in_their_task(stream):
    logs.configure("json", "debug", stream=stream)
    log = logging.getLogger("speckv.x")

    async def call(request_id: str) -> None:
        logs.bind(request_id=request_id, peer=f"ipv4:127.0.0.1:{len(request_id)}")
        await asyncio.sleep(0)
        log.info("in %s", request_id)
        await asyncio.create_task(child(request_id))  # a task started by the call inherits them

    async def child(request_id: str) -> None:
        log.info("child of %s", request_id)

    async def main() -> None:
        await asyncio.gather(call("a"), call("bb"))
        log.info("outside")

    asyncio.run(main())
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    for obj in lines:
        if obj["message"] == "outside":
            assert "request_id" not in obj
        else:
            rid = obj["message"].rsplit(" ", 1)[1]
            assert (obj["request_id"], obj["peer"]) == (rid, f"ipv4:127.0.0.1:{len(rid)}")
    assert len(lines) == 5


def test_bound_values_are_capped():
    async def main() -> dict:
        logs.bind(request_id="x" * 10_000, none=None)
        return logs.bound()

    assert asyncio.run(main()) == {"request_id": "x" * logs.MAX_FIELD_CHARS}


@pytest.mark.parametrize("flag,env,want", [(None, {}, "text"), ("JSON", {"SPECKV_LOG_FORMAT": "text"}, "json"),
                                           (None, {"SPECKV_LOG_FORMAT": "json"}, "json")])
def test_resolve_flag_over_variable_over_default(flag, env, want):
    assert logs.resolve(flag, logs.FORMAT_ENV, "text", logs.FORMATS, env) == want
