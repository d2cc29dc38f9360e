"""One step ahead: the next item prepared on a helper thread while the caller codes this one.

A whole stream is coded group by group (``plan.element_groups``). Each group has a prepare
step (prepare mu, sample and price the sigma shifts: numpy and small native calls, mostly
serial) and a code step (the native rANS pass over both cores). In series the prepare steps
leave a core idle; with ``Lookahead`` group g + 1 is prepared while group g is coded (and group 0
on the caller while the helper prepares group 1: nothing else is ready to run then)::

    with Lookahead(prepare, groups, ahead=threads > 1) as prepared:
        for g, p in zip(groups, prepared):
            code(p)

The results come in the items' order, and each is the same object ``fn(item)`` returns in
series (the prepare step reads the stream, never what coding wrote), so the bytes do not
depend on ``ahead``. An exception of ``fn`` is raised by the iteration that reaches its
item.

``hold`` (the native coder's ``hold_core``) is told +1 when a step is handed to the helper and
-1 when it ends (or is cancelled): while the helper computes, the rANS pass starts one thread
fewer, and a thread joins it when the helper is done. NOTE: without it the helper, the caller and
the pass's worker were three runnable threads on two cores, and the scheduler left one core idle
while the other queued two of them (coder/kernels/spk_pool.h, "Held cores").

NOTE: leaving the ``with`` early (an error, a consumer that stops reading) cancels the
step not started and waits for the one running, so nothing runs on after the stream ends.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, Iterator, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def runs_ahead(ahead: bool, n_items: int) -> bool:
    """Whether a ``Lookahead`` over ``n_items`` hands steps to a helper (one item: nothing to overlap)."""
    return ahead and n_items > 1


class Lookahead(Generic[T, R]):
    """``fn`` over ``items`` in order, one item ahead of the caller when ``ahead``."""

    def __init__(self, fn: Callable[[T], R], items: Sequence[T], ahead: bool,
                 hold: Callable[[int], None] | None = None) -> None:
        self._fn, self._items, self._hold = fn, list(items), hold
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="speckv-lookahead") \
            if runs_ahead(ahead, len(self._items)) else None

    def __iter__(self) -> Iterator[R]:
        if self._pool is None:
            yield from (self._fn(item) for item in self._items)
            return
        nxt = self._submit(self._items[1])  # NOTE: item 0 on the caller meanwhile: no pass runs yet to overlap
        yield self._fn(self._items[0])
        for k in range(1, len(self._items)):
            result = nxt.result()
            if k + 1 < len(self._items):
                nxt = self._submit(self._items[k + 1])
            yield result

    def _submit(self, item: T) -> "Future[R]":
        assert self._pool is not None
        hold = self._hold
        if hold is None:
            return self._pool.submit(self._fn, item)
        hold(1)
        try:
            f = self._pool.submit(self._fn, item)
        except BaseException:
            hold(-1)
            raise
        f.add_done_callback(lambda _: hold(-1))  # NOTE: run on cancel too, so every +1 has its -1
        return f

    def __enter__(self) -> "Lookahead[T, R]":
        return self

    def __exit__(self, *_: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
