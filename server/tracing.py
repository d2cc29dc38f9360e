"""OpenTelemetry spans of the sidecars: the optional ``tracing`` extra (opentelemetry-api).

Without opentelemetry installed every function here is a no-op (no span, no metadata).
With it, spans go to the global TracerProvider: the one the standard ``OTEL_*``
variables configure when the sidecar runs under the SDK's auto-configuration
(``opentelemetry-instrument speckv serve ...``, from opentelemetry-distro), or any
provider the embedding process sets. With no provider the API's own is a no-op.

Spans (kind SERVER): ``speckv.encoder.Submit`` (the engine's call; child of the
engine's trace when its call carries one), ``speckv.decoder.Transfer`` (child of the
encoder's Submit span: its W3C trace context travels in the Transfer call's gRPC
metadata) and ``speckv.decoder.FetchKV``. Attributes: ``speckv.request_id``,
``rpc.*``, and when a transfer ends its figures: raw and wire bytes, chunks, encoding,
fallback, and each stage's seconds (predictor, encode or decode, mu_wait, wire_wait).
NOTE: stages are attributes, not child spans: their times are sums over chunks that
overlap each other. A failed call's span has status ERROR and ``rpc.grpc.status_code``.
"""

from __future__ import annotations

from typing import Any

import grpc

try:
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
except ImportError:  # the extra is not installed: tracing is off and costs nothing
    _propagate = None  # type: ignore[assignment]
    _trace = None  # type: ignore[assignment]

TRACER = "speckv.server"
_provider: Any = None  # None: the global TracerProvider (tests set their own here)


def available() -> bool:
    return _trace is not None


def start(name: str, context: grpc.aio.ServicerContext, **attributes: Any) -> Any:
    """A started SERVER span (None without opentelemetry), child of the call's trace context."""
    if _trace is None:
        return None
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    service, _, method = name.rpartition(".")
    attrs = {"rpc.system": "grpc", "rpc.service": f"speckv.v1.{service.rsplit('.', 1)[-1].capitalize()}Service",
             "rpc.method": method, **_prefixed(attributes)}
    return _trace.get_tracer(TRACER, tracer_provider=_provider).start_span(name, context=_propagate.extract(carrier),
                                                kind=_trace.SpanKind.SERVER, attributes=attrs)


def annotate(span: Any, **attributes: Any) -> None:
    if span is not None:
        span.set_attributes(_prefixed(attributes))


def end(span: Any, code: grpc.StatusCode = grpc.StatusCode.OK, message: str = "", **attributes: Any) -> None:
    """End ``span`` with the call's final code (ERROR status unless OK) and ``attributes``."""
    if span is None or _trace is None:
        return
    span.set_attributes({**_prefixed(attributes), "rpc.grpc.status_code": code.value[0]})
    if code != grpc.StatusCode.OK:
        span.set_status(_trace.Status(_trace.StatusCode.ERROR, f"{code.name}: {message}"[:512]))
    span.end()


def outgoing(span: Any) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying ``span``'s trace context to the next sidecar (None: nothing to carry)."""
    if span is None or _trace is None:
        return None
    carrier: dict[str, str] = {}
    _propagate.inject(carrier, context=_trace.set_span_in_context(span))
    return tuple(carrier.items()) or None


def _prefixed(attributes: dict[str, Any]) -> dict[str, Any]:
    return {f"speckv.{k}": v for k, v in attributes.items() if v is not None}
