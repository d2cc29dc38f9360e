"""Building, starting and stopping a sidecar.

``create_server(config) -> (sidecar, port)`` builds a grpc.aio server with the
role's service, gRPC health checking and server reflection, bound to
``config.listen`` (port 0 = ephemeral, the bound port is returned), plus its
``/metrics`` endpoint; nothing runs until ``await sidecar.start()``.
``serve(config)`` is the process entry point of ``speckv serve``: it starts
one sidecar and, on SIGTERM or SIGINT, calls ``stop(grace)``: health goes
NOT_SERVING first (so load balancers and probes drain it), new calls are
refused, in-flight transfers get ``config.grace_s`` seconds to finish and are
cancelled after that, then the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from speckv import __version__
from speckv.coder import container as ct
from speckv.coder.backends import backend_name
from speckv.v1 import decoder_pb2, encoder_pb2

from .budget import ByteBudget
from .config import ServerConfig
from .decoder import DecoderService
from .encoder import EncoderService
from .handlers import add_service
from .layer_mu import PREDICTOR_TASK
from .metrics import Metrics
from .runtime import Runtime
from .tls import KEEPALIVE, server_credentials

logger = logging.getLogger(__name__)

SERVICE_NAMES = {
    "decoder": decoder_pb2.DESCRIPTOR.services_by_name["DecoderService"].full_name,
    "encoder": encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name,
}
RPC_DRAIN_S = 2.0  # after stop(grace): how long the calls' own tasks get to finish their cleanup
_GRPC_RPC_COROS = ("_schedule_rpc_coro", "_handle_exceptions")  # grpc.aio's per-call tasks


class Sidecar:
    """One running (or ready to run) encoder or decoder sidecar."""

    def __init__(self, config: ServerConfig, server: grpc.aio.Server, service: DecoderService | EncoderService,
                 metrics: Metrics, health_servicer: health.aio.HealthServicer,
                 health_server: grpc.aio.Server | None = None, health_port: int | None = None) -> None:
        self.config, self.server, self.service, self.metrics = config, server, service, metrics
        self.health = health_servicer
        self.health_server, self.health_port = health_server, health_port
        self.metrics_port: int | None = None
        self._reaper: asyncio.Task | None = None
        self._stopped = asyncio.Event()

    @property
    def service_name(self) -> str:
        return SERVICE_NAMES[self.config.role]

    async def start(self) -> None:
        await self.server.start()
        local = self.service.handoffs if isinstance(self.service, EncoderService) else self.service.mailboxes
        if local is not None:
            local.start()  # the local socket: memfd hand-offs (encoder) or fetch mailboxes (decoder)
        if self.health_server is not None:
            await self.health_server.start()
        if self.config.metrics_port >= 0:
            self.metrics_port = self.metrics.start_http(self.config.metrics_host, self.config.metrics_port)
        ok = self.service.rt.numeric_ok  # False: the predictor's canary differs here (runtime.py)
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", self.service_name):
            await self.health.set(name, status)
        if isinstance(self.service, DecoderService):
            self._reaper = asyncio.ensure_future(self._reap(self.service))

    async def _reap(self, service: DecoderService) -> None:
        period = min(5.0, service.config.lease_s / 4)
        while True:
            await asyncio.sleep(period)
            if await service.table.expire():
                service._gauges()  # expired transfers are no longer in flight

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new calls, let in-flight ones finish within ``grace``."""
        grace = self.config.grace_s if grace is None else grace
        try:
            await self.health.enter_graceful_shutdown()
            logger.info("%s stopping: health NOT_SERVING, %.1f s grace", self.config.role, grace)
            await self.server.stop(grace)
            await _drain_rpc_tasks(RPC_DRAIN_S)
            batcher = getattr(getattr(self.service, "rt", None), "batcher", None)
            if batcher is not None and not await asyncio.to_thread(batcher.join, RPC_DRAIN_S):
                logger.warning("%s: a predictor pass still runs after the drain", self.config.role)
            if self.health_server is not None:
                await self.health_server.stop(0)
            if self._reaper is not None:
                self._reaper.cancel()
            await self.service.close()  # NOTE: its local socket too
            self.metrics.stop_http()
        except Exception:
            logger.exception("%s: error while stopping", self.config.role)
            raise
        finally:
            self._stopped.set()  # NOTE: serve() waits on it; a failed step must not hang the process

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()


async def _drain_rpc_tasks(timeout: float) -> None:
    """Let grpc's per-call tasks (and the predictor passes they stopped) finish after ``server.stop``.

    NOTE: ``stop`` returns once the calls are cancelled, while each call's task may still be
    running its handler's cleanup; if the loop closes first (``asyncio.run`` cancels what is
    left) grpc logs the cancellation as an unhandled ERROR with a traceback.
    """
    tasks = [t for t in asyncio.all_tasks() if not t.done() and (
        getattr(t.get_coro(), "__qualname__", "") in _GRPC_RPC_COROS or t.get_name() == PREDICTOR_TASK)]
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


def create_server(config: ServerConfig, runtime: Runtime | None = None,
                  interceptors: list[grpc.aio.ServerInterceptor] | None = None) -> tuple[Sidecar, int]:
    """A sidecar bound to ``config.listen`` (not yet started) and its gRPC port;
    ``interceptors`` wrap every call (auth, auditing, fault injection in tests)."""
    runtime = runtime or Runtime.load(config)
    metrics = Metrics(config.role, runtime.model_id)
    metrics.build_info(__version__, runtime.pin, backend_name(runtime.codec.backend), runtime.predictor.device,
                       ct.FORMAT_VERSION)
    budget = ByteBudget(config.max_inflight_bytes,
                        lambda used: metrics.inflight_bytes.labels(config.role, runtime.model_id).set(used))
    metrics.gauges(0, 0, config.max_inflight_bytes)
    if runtime.batcher is not None:
        runtime.batcher.on_pass = metrics.predictor_pass
    # NOTE: the metrics interceptor comes first (outermost): it sees the handler the others
    # leave and every status they end a call with
    server = grpc.aio.server(interceptors=[metrics.grpc.interceptor(), *(interceptors or ())], options=[
        ("grpc.max_receive_message_length", config.max_receive_bytes),
        ("grpc.max_send_message_length", config.max_receive_bytes),
        *KEEPALIVE])
    service: DecoderService | EncoderService
    if config.role == "decoder":
        service = DecoderService(config, runtime, metrics, budget)
        descriptor = decoder_pb2.DESCRIPTOR.services_by_name["DecoderService"]
    else:
        service = EncoderService(config, runtime, metrics, budget)
        descriptor = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"]
    add_service(server, service, descriptor)
    metrics.grpc.preregister(descriptor)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAMES[config.role], health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    tls = server_credentials(config)  # NOTE: re-reads the files when they change (server/tls.py)
    port = server.add_secure_port(config.listen, tls[0]) if tls else server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"could not bind {config.listen}")
    health_server, health_port = None, None
    if config.health_listen:
        # NOTE: plaintext and health only, for kubelet probes while the main port requires mTLS
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = health_server.add_insecure_port(config.health_listen)
    logger.info("%s sidecar on %s (port %d, %s), predictor %s", config.role, config.listen, port,
                "mTLS" if config.tls_ca else "TLS" if tls else "plaintext", runtime.pin)
    return Sidecar(config, server, service, metrics, health_servicer, health_server, health_port), port


async def serve(config: ServerConfig, runtime: Runtime | None = None) -> None:
    """Run one sidecar until SIGTERM/SIGINT, then stop gracefully."""
    sidecar, port = create_server(config, runtime)
    await sidecar.start()
    print(f"speckv {config.role} listening on port {port}"
          + (f", metrics on port {sidecar.metrics_port}" if sidecar.metrics_port else "")
          + (f", health on port {sidecar.health_port}" if sidecar.health_port else ""), flush=True)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, lambda: stopping.append(asyncio.ensure_future(sidecar.stop())))
    await sidecar.wait_for_termination()
