"""Method handlers that parse requests themselves, so bad bytes get a precise status.

grpc's generated ``add_*Servicer_to_server`` deserialises each request before the
servicer runs; a message that is not valid protobuf then ends the call with
UNKNOWN (first message) or surfaces inside the handler as a ``DecodeError``.
``add_service`` registers the same servicer methods with pass-through
deserialisers and parses here: undecodable bytes become INVALID_ARGUMENT
("request message N is not a valid speckv.v1.X"), for unary and streaming
requests alike. The method table comes from the service's proto descriptor,
so it cannot drift from the .proto.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from speckv import frames
from speckv.errors import RpcError
from speckv.status import abort

logger = logging.getLogger(__name__)


def parse(cls: type[Message], data: bytes, index: int) -> Any:
    """``cls.FromString(data)`` (a bulk message as a ``frames.Parsed``: its payload a view of
    ``data``), or RpcError(INVALID_ARGUMENT) naming the message."""
    try:
        return frames.parse(cls, data)
    except (DecodeError, RuntimeWarning, ValueError) as e:
        raise RpcError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"request message {index} is not a valid {cls.DESCRIPTOR.full_name}: {e}") from None


async def parsed(cls: type[Message], raw: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    """A request stream of raw messages, parsed one by one (RpcError on a bad one)."""
    index = 0
    async for data in raw:
        yield parse(cls, data, index)
        index += 1


def _unary(fn: Callable, cls: type[Message]) -> Callable:
    async def handler(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = parse(cls, data, 0)
        except RpcError as e:
            await abort(context, e)
        return await fn(request, context)
    return handler


def _unary_stream(fn: Callable, cls: type[Message]) -> Callable:
    async def handler(data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            request = parse(cls, data, 0)
        except RpcError as e:
            await abort(context, e)
        async for response in fn(request, context):
            yield response
    return handler


def _stream_unary(fn: Callable, cls: type[Message]) -> Callable:
    # NOTE: the servicer sees RpcError from its request iterator and reports it like
    # any other bad request (its own except path), so nothing else is wrapped here
    async def handler(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        return await fn(parsed(cls, raw), context)
    return handler


def _stream_stream(fn: Callable, cls: type[Message]) -> Callable:
    async def handler(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for response in fn(parsed(cls, raw), context):
            yield response
    return handler


_KINDS = {  # (client_streaming, server_streaming) -> (wrapper, grpc handler factory)
    (False, False): (_unary, grpc.unary_unary_rpc_method_handler),
    (False, True): (_unary_stream, grpc.unary_stream_rpc_method_handler),
    (True, False): (_stream_unary, grpc.stream_unary_rpc_method_handler),
    (True, True): (_stream_stream, grpc.stream_stream_rpc_method_handler),
}


def method_handlers(servicer: Any, service: ServiceDescriptor) -> dict[str, grpc.RpcMethodHandler]:
    """One handler per method of ``service``, bound to the servicer's method of that name."""
    handlers = {}
    for m in service.methods:
        wrap, factory = _KINDS[(m.client_streaming, m.server_streaming)]
        request_cls = message_factory.GetMessageClass(m.input_type)
        handlers[m.name] = factory(wrap(getattr(servicer, m.name), request_cls),
                                   request_deserializer=None,  # bytes through; parsed above
                                   # NOTE: passes pre-serialised responses (FetchKV's layers) through
                                   response_serializer=frames.serialize)
    return handlers


def add_service(server: grpc.aio.Server, servicer: Any, service: ServiceDescriptor) -> None:
    """Register ``servicer`` for ``service`` (as the generated add_*_to_server would)."""
    handlers = method_handlers(servicer, service)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
