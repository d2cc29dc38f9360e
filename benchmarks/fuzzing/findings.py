"""What the fuzzer reports, and the time bound on every call it makes.

A finding is a *crash* (an unexpected exception type, status UNKNOWN or INTERNAL,
an error logged by a sidecar), *corrupt* (a success with other bits), *lost* (a
transfer reported OK that cannot be fetched), *leak* (a budget not back to 0) or
a *hang* (a call past its deadline).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import traceback
from typing import Any, Callable, Iterator


class Finding(Exception):
    """Something the fuzzer must report: kind is crash | corrupt | lost | leak | hang."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


class _Alarm(BaseException):  # BaseException: no ``except Exception`` under test swallows it
    pass


def describe(e: BaseException) -> str:
    """``Type: message (at file:line)`` of an exception, where it was raised."""
    where = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__}: {str(e)[:200]} (at {where.filename}:{where.lineno})"


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise _Alarm in the main thread after ``seconds`` (no-op elsewhere: the caller
    still checks the elapsed time)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise _Alarm()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def guarded(fn: Callable[[], Any], allowed: tuple[type, ...], limit: float) -> tuple[str, Any]:
    """Run ``fn``: ``("ok", result)`` or ``(exception type name, None)`` for an allowed
    exception; Finding for any other exception or for a call past ``limit`` seconds."""
    t0 = time.perf_counter()
    try:
        with time_limit(limit):
            result = fn()
        outcome = "ok"
    except _Alarm:
        raise Finding("hang", f"still running after {limit} s") from None
    except allowed as e:
        result, outcome = None, type(e).__name__
    except Exception as e:
        raise Finding("crash", describe(e)) from e
    elapsed = time.perf_counter() - t0
    if elapsed > limit:
        raise Finding("hang", f"took {elapsed:.2f} s > {limit} s")
    return outcome, result
