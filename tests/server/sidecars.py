"""Real sidecars for tests: grpc.aio servers on loopback (port 0), each group
running on its own asyncio event loop in a background thread, so tests drive
them with the blocking clients exactly as an engine would.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Coroutine

from speckv.server.app import Sidecar, create_server
from speckv.server.config import ServerConfig
from speckv.server.runtime import Runtime


class LoopThread:
    """An asyncio loop in a daemon thread; ``run(coro)`` blocks for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="sidecar-loop")
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class Sidecars:
    """Start/stop sidecars sharing one loaded predictor (``runtime_for(config)``)."""

    def __init__(self, predictor) -> None:
        self.predictor = predictor
        self.loop = LoopThread()
        self.running: list[Sidecar] = []

    def start(self, role: str, interceptors: list | None = None, **overrides: Any) -> tuple[Sidecar, str]:
        """A started sidecar and its ``127.0.0.1:PORT`` address."""
        config = ServerConfig(role=role, **{"metrics_port": 0, **overrides})
        runtime = Runtime.from_predictor(self.predictor, config)

        async def make() -> tuple[Sidecar, int]:
            sidecar, port = create_server(config, runtime, interceptors)
            await sidecar.start()
            return sidecar, port

        sidecar, port = self.loop.run(make())
        self.running.append(sidecar)
        return sidecar, f"127.0.0.1:{port}"

    def stop(self, sidecar: Sidecar, grace: float = 0.5, timeout: float = 60) -> None:
        self.loop.run(sidecar.stop(grace), timeout)
        if sidecar in self.running:
            self.running.remove(sidecar)

    def close(self) -> None:
        for s in list(self.running):
            self.stop(s, 0.1)
        self.loop.close()
