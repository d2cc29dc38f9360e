"""One step ahead: the next item prepared on a helper thread while the caller codes this one.

A whole stream is coded group by group (``plan.element_groups``). Each group has a prepare
step (prepare mu, sample and price the sigma shifts: numpy and small native calls, mostly
serial) and a code step (the native rANS pass over both cores). In series the prepare steps
leave a core idle; with ``Lookahead`` group g + 1 is prepared while group g is coded::

    with Lookahead(prepare, groups, ahead=threads > 1) as prepared:
        for g, p in zip(groups, prepared):
            code(p)

The results come in the items' order, and each is the same object ``fn(item)`` returns in
series (the prepare step reads the stream, never what coding wrote), so the bytes do not
depend on ``ahead``. An exception of ``fn`` is raised by the iteration that reaches its
item. NOTE: leaving the ``with`` early (an error, a consumer that stops reading) cancels the
step not started and waits for the one running, so nothing runs on after the stream ends.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generic, Iterator, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Lookahead(Generic[T, R]):
    """``fn`` over ``items`` in order, one item ahead of the caller when ``ahead``."""

    def __init__(self, fn: Callable[[T], R], items: Sequence[T], ahead: bool) -> None:
        self._fn, self._items = fn, list(items)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="speckv-lookahead") \
            if ahead and len(self._items) > 1 else None

    def __iter__(self) -> Iterator[R]:
        if self._pool is None:
            yield from (self._fn(item) for item in self._items)
            return
        nxt = self._pool.submit(self._fn, self._items[0])
        for k in range(len(self._items)):
            result = nxt.result()
            if k + 1 < len(self._items):
                nxt = self._pool.submit(self._fn, self._items[k + 1])
            yield result

    def __enter__(self) -> "Lookahead[T, R]":
        return self

    def __exit__(self, *_: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
