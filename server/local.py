"""An encoder and a decoder sidecar in this process, on loopback, for the demo
and the benchmarks: both real grpc.aio servers (ephemeral ports, real
sockets) on one asyncio loop in a background thread, sharing one loaded
predictor. Callers talk to them with the blocking clients.

Lifecycle::

    with LocalPair(predictor) as pair:        # starts both, health SERVING
        EncoderClient(pair.encoder_address).submit(..., decoder_address=pair.decoder_address)
    # both stopped gracefully, loop thread joined
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

from .app import Sidecar, create_server
from .config import ServerConfig
from .runtime import Runtime

if TYPE_CHECKING:  # pragma: no cover
    from speckv.predictor.predict import Predictor


class LocalPair:
    """A started decoder + encoder pair; ``**overrides`` apply to both configs, ``decoder``
    and ``encoder`` to one (e.g. each its own ``local_socket``)."""

    def __init__(self, predictor: "Predictor", metrics: bool = True, decoder: dict | None = None,
                 encoder: dict | None = None, **overrides: Any) -> None:
        self.predictor, self.overrides = predictor, overrides
        self.role_overrides = {"decoder": decoder or {}, "encoder": encoder or {}}
        self.metrics = metrics
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="speckv-local")
        self.sidecars: dict[str, tuple[Sidecar, int]] = {}

    def _run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> "LocalPair":
        self.thread.start()
        for role in ("decoder", "encoder"):
            config = ServerConfig(role=role, metrics_port=0 if self.metrics else -1,
                                  **{**self.overrides, **self.role_overrides[role]})
            runtime = Runtime.from_predictor(self.predictor, config)
            runtime.codec.warm()  # the reference's context table, if it is the path

            async def make(config: ServerConfig = config, runtime: Runtime = runtime) -> tuple[Sidecar, int]:
                sidecar, port = create_server(config, runtime)
                await sidecar.start()
                return sidecar, port

            self.sidecars[role] = self._run(make())
        return self

    def address(self, role: str) -> str:
        return f"127.0.0.1:{self.sidecars[role][1]}"

    @property
    def encoder_address(self) -> str:
        return self.address("encoder")

    @property
    def decoder_address(self) -> str:
        return self.address("decoder")

    def metrics_url(self, role: str) -> str | None:
        port = self.sidecars[role][0].metrics_port
        return f"http://127.0.0.1:{port}/metrics" if port else None

    def stop(self, grace: float = 1.0) -> None:
        for role in ("encoder", "decoder"):
            if role in self.sidecars:
                self._run(self.sidecars.pop(role)[0].stop(grace))
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        self.loop.close()

    def __enter__(self) -> "LocalPair":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
