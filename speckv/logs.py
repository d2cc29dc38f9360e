"""Log formats and the transfer context of log lines.

``configure(format, level)`` sets up stderr logging for the ``speckv`` command: ``text``
(``2026-12-01T03:45:12.345Z WARNING speckv.server.decoder: message key=value ...``) or
``json`` (one object per line: ``time``, ``level``, ``logger``, ``message``, then the
extra fields and ``exc_info``). ``level`` applies to speckv's own loggers; other
libraries log WARNING and up (``verbose``: everything at DEBUG).

``bind(request_id=..., peer=...)`` attaches fields to every line logged afterwards in
the current asyncio task (and the tasks it starts): a sidecar's handlers bind each
call's request id and peer, so every line of a transfer carries them, its failure
included. ``extra={...}`` on a single call adds fields too.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import time
from types import MappingProxyType
from typing import Any, Mapping, TextIO

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")
FORMAT_ENV, LEVEL_ENV = "SPECKV_LOG_FORMAT", "SPECKV_LOG_LEVEL"

# NOTE: never mutated: bind() sets a new mapping, so a task started earlier keeps its own
_FIELDS: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("speckv_log_fields",
                                                                            default=MappingProxyType({}))
# what every LogRecord has: anything else on a record came from ``extra`` or ``bind``
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


MAX_FIELD_CHARS = 256  # a bound value comes from a peer (a request id): never a whole message


def bind(**fields: Any) -> None:
    """Add ``fields`` (None values skipped, strings cut at MAX_FIELD_CHARS) to the lines of
    this task from now on."""
    _FIELDS.set({**_FIELDS.get(), **{k: v[:MAX_FIELD_CHARS] if isinstance(v, str) else v
                                     for k, v in fields.items() if v is not None}})


def bound() -> dict[str, Any]:
    return dict(_FIELDS.get())


def timestamp(created: float) -> str:
    """RFC 3339 UTC with milliseconds: ``2026-12-01T03:45:12.345Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The bound fields of the record's task, then those passed with ``extra``."""
    return {**getattr(record, "_bound", {}),
            **{k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}}


class _BindFilter(logging.Filter):
    """Copies the task's bound fields onto each record (where the record is made)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _FIELDS.get()
        if fields and not hasattr(record, "_bound"):
            record._bound = fields
        return True


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{timestamp(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        fields = extra_fields(record)
        if fields:
            line += " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {"time": timestamp(record.created), "level": record.levelname, "logger": record.name,
                               "message": record.getMessage()}
        for k, v in extra_fields(record).items():
            obj.setdefault(k, v)
        if record.exc_info:
            obj["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str, ensure_ascii=False)


def _text(v: Any) -> str:
    s = str(v)
    return json.dumps(s) if not s or any(c.isspace() or c in "\"=" for c in s) else s


def resolve(flag: str | None, env_name: str, default: str, choices: tuple[str, ...], env: Any = None) -> str:
    """A flag's value over its ``SPECKV_*`` variable over ``default``, checked against ``choices``."""
    env = os.environ if env is None else env
    value = flag if flag is not None else (env.get(env_name) or default)
    value = value.lower()
    if value not in choices:
        source = "" if flag is not None else f"{env_name}: "
        raise ValueError(f"{source}log {'format' if env_name == FORMAT_ENV else 'level'} must be one of "
                         f"{', '.join(choices)}, not {value!r}")
    return value


def configure(fmt: str = "text", level: str = "warning", verbose: bool = False,
              stream: TextIO | None = None) -> logging.Handler:
    """Replace the root logger's handlers with one ``fmt`` handler on ``stream`` (stderr)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_BindFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    logging.captureWarnings(True)  # a library's warnings.warn becomes a line in the same format
    own = logging.DEBUG if verbose else getattr(logging, level.upper())
    root.setLevel(logging.DEBUG if verbose else max(own, logging.WARNING))
    logging.getLogger("speckv").setLevel(own)
    return handler
