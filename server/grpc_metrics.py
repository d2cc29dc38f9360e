"""gRPC server metrics under the names of grpc-ecosystem/go-grpc-prometheus.

``GrpcMetrics(registry)`` declares, on a sidecar's own registry:

- ``grpc_server_started_total{grpc_type,grpc_service,grpc_method}``: calls started;
- ``grpc_server_handled_total{grpc_type,grpc_service,grpc_method,grpc_code}``: calls
  ended, by final status (``grpc_code`` spelt as Go's ``codes.Code.String()``: ``OK``,
  ``Canceled``, ``InvalidArgument``, ``ResourceExhausted``, ...);
- ``grpc_server_handling_seconds{grpc_type,grpc_service,grpc_method}``: a histogram of
  the time from the call's start to its end;
- ``grpc_server_msg_received_total`` / ``grpc_server_msg_sent_total``: messages read
  from the request stream and yielded to the response stream (unary calls count 1).

``grpc_type`` is ``unary``, ``client_stream``, ``server_stream`` or ``bidi_stream``.
``interceptor()`` returns the grpc.aio server interceptor that records them: a
streaming call is counted when it ends (its last message written, an abort, the
client's cancellation or the server's stop), with its final code. A call cancelled
past its deadline counts ``DeadlineExceeded``. ``preregister(service)`` creates the
series of a service's methods at 0 (every code), so ratios exist before traffic.

NOTE: messages a coroutine handler writes with ``context.write`` (the health Watch)
are not counted; speckv's own handlers are async generators.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from prometheus_client import CollectorRegistry, Counter, Histogram

SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# grpc.StatusCode -> Go's codes.Code.String(), the spelling dashboards and alert rules expect
GO_CODES = {
    grpc.StatusCode.OK: "OK", grpc.StatusCode.CANCELLED: "Canceled", grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument", grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound", grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied", grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition", grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange", grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal", grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss", grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}
_LABELS = ("grpc_type", "grpc_service", "grpc_method")


def grpc_type(client_streaming: bool, server_streaming: bool) -> str:
    return {(False, False): "unary", (True, False): "client_stream", (False, True): "server_stream",
            (True, True): "bidi_stream"}[(client_streaming, server_streaming)]


class GrpcMetrics:
    """The go-grpc-prometheus server families on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.started = Counter("grpc_server_started_total", "Total number of RPCs started on the server.",
                               _LABELS, registry=registry)
        self.handled = Counter("grpc_server_handled_total", "Total number of RPCs completed on the server, "
                               "regardless of success or failure.", (*_LABELS, "grpc_code"), registry=registry)
        self.seconds = Histogram("grpc_server_handling_seconds", "Histogram of response latency (seconds) of "
                                 "gRPC that had been application-level handled by the server.", _LABELS,
                                 buckets=SECONDS, registry=registry)
        self.received = Counter("grpc_server_msg_received_total", "Total number of RPC stream messages received "
                                "on the server.", _LABELS, registry=registry)
        self.sent = Counter("grpc_server_msg_sent_total", "Total number of gRPC stream messages sent by the "
                            "server.", _LABELS, registry=registry)

    def preregister(self, service: ServiceDescriptor) -> None:
        """Every series of ``service``'s methods at 0 (go-grpc-prometheus' InitializeMetrics)."""
        for m in service.methods:
            lab = (grpc_type(m.client_streaming, m.server_streaming), service.full_name, m.name)
            for family in (self.started, self.seconds, self.received, self.sent):
                family.labels(*lab)
            for code in GO_CODES.values():
                self.handled.labels(*lab, code)

    def interceptor(self) -> "MetricsInterceptor":
        return MetricsInterceptor(self)


class _Call:
    """One call being measured: its labels, start time and (once) its end."""

    def __init__(self, metrics: GrpcMetrics, labels: tuple[str, str, str]) -> None:
        self.m, self.labels, self.t0, self.ended = metrics, labels, time.perf_counter(), False
        metrics.started.labels(*labels).inc()
        # NOTE: the children looked up once per call, not once per message
        self.received, self.sent = metrics.received.labels(*labels).inc, metrics.sent.labels(*labels).inc

    def end(self, context: grpc.aio.ServicerContext, exc: BaseException | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        self.m.handled.labels(*self.labels, GO_CODES.get(final_code(context, exc), "Unknown")).inc()
        self.m.seconds.labels(*self.labels).observe(time.perf_counter() - self.t0)


def final_code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    """The status a call ended with: an abort's code, CANCELLED (DEADLINE_EXCEEDED past the
    deadline) for a cancelled call, UNKNOWN for any other exception, else the code set."""
    code = context.code()
    if isinstance(exc, grpc.aio.AbortError):
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    if exc is not None:
        return grpc.StatusCode.UNKNOWN
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.OK


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method handler so its calls are counted, timed and their messages counted."""

    def __init__(self, metrics: GrpcMetrics) -> None:
        self.m = metrics

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: grpc answers UNIMPLEMENTED itself
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        labels = (grpc_type(handler.request_streaming, handler.response_streaming), service, method)
        kind = "stream" if handler.request_streaming else "unary"
        if handler.response_streaming:
            factory, behavior = ((grpc.stream_stream_rpc_method_handler, handler.stream_stream)
                                 if handler.request_streaming
                                 else (grpc.unary_stream_rpc_method_handler, handler.unary_stream))
            wrapped = self._streaming(behavior, labels, kind)
        else:
            factory, behavior = ((grpc.stream_unary_rpc_method_handler, handler.stream_unary)
                                 if handler.request_streaming
                                 else (grpc.unary_unary_rpc_method_handler, handler.unary_unary))
            wrapped = self._unary(behavior, labels, kind, sends=True)
        return factory(wrapped, request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)

    def _request(self, call: _Call, request: Any, kind: str) -> Any:
        if kind == "unary":
            call.received()
            return request
        return _counted(request, call)

    def _unary(self, behavior: Callable, labels: tuple[str, str, str], kind: str, sends: bool) -> Callable:
        async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = _Call(self.m, labels)
            try:
                response = await behavior(self._request(call, request, kind), context)
            except BaseException as e:
                call.end(context, e)
                raise
            if sends:
                call.sent()
            call.end(context)
            return response
        return handler

    def _streaming(self, behavior: Callable, labels: tuple[str, str, str], kind: str) -> Callable:
        if not inspect.isasyncgenfunction(behavior):  # writes with context.write: timed and coded only
            return self._unary(behavior, labels, kind, sends=False)

        async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = _Call(self.m, labels)
            try:
                # NOTE: aclosing: a call ended at a yield (GeneratorExit) closes the handler now,
                # as grpc would without this wrapper
                async with contextlib.aclosing(behavior(self._request(call, request, kind), context)) as responses:
                    async for response in responses:
                        call.sent()
                        yield response
            except BaseException as e:
                call.end(context, e)
                raise
            call.end(context)
        return handler


async def _counted(requests: AsyncIterator[Any], call: _Call) -> AsyncIterator[Any]:
    async for request in requests:
        call.received()
        yield request
