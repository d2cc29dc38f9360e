"""The in-flight byte cap: a sidecar-wide budget that transfers await.

Every buffer a transfer holds (raw layers waiting to be coded, records
waiting to be decoded, decoded layers waiting to be fetched) is reserved from
one :class:`ByteBudget` first. When the cap is reached, ``acquire`` awaits, the
handler stops reading its gRPC stream, and HTTP/2 flow control pushes back on
the sender: real backpressure, no unbounded queue. A transfer reserves
through its own :class:`Holding`, so a failed or cancelled transfer gives back
everything it held in one ``close()``.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from speckv.errors import BudgetExceeded, HoldingClosed


class ByteBudget:
    """``limit`` bytes shared by all transfers of one sidecar (asyncio, one loop)."""

    def __init__(self, limit: int, on_change: Callable[[int], None] | None = None) -> None:
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()
        self._on_change = on_change or (lambda used: None)

    def holding(self) -> "Holding":
        return Holding(self)

    async def _acquire(self, n: int, holding: "Holding") -> None:
        if n > self.limit:
            raise BudgetExceeded(f"{n} bytes exceed the in-flight cap of {self.limit} bytes")
        async with self._cond:
            await self._cond.wait_for(lambda: holding.closed or self.used + n <= self.limit)
            if holding.closed:
                raise HoldingClosed("transfer ended while waiting for buffer space")
            self.used += n
        self._on_change(self.used)

    def _release(self, n: int) -> None:
        self.used -= n
        assert self.used >= 0, "released more than acquired"
        self._on_change(self.used)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()


class Holding:
    """What one transfer holds of a :class:`ByteBudget`."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.held = 0
        self.closed = False

    async def acquire(self, n: int) -> None:
        """Reserve ``n`` bytes, awaiting space (BudgetExceeded if it can never fit)."""
        if self.closed:
            raise HoldingClosed("transfer already ended")
        if n:
            await self.budget._acquire(n, self)
            if self.closed:  # closed between the grant and now: give it back
                self.budget._release(n)
                raise HoldingClosed("transfer ended while waiting for buffer space")
            self.held += n

    def release(self, n: int) -> None:
        n = min(n, self.held)
        if n:
            self.held -= n
            self.budget._release(n)

    def close(self) -> None:
        """Give back everything and wake this holding's waiters (idempotent)."""
        self.closed = True
        held, self.held = self.held, 0
        if held:
            self.budget._release(held)
        else:
            asyncio.get_running_loop().create_task(self.budget._notify())
