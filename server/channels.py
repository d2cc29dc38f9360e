"""The encoder's channels to decoders, one per decoder address, reused across
transfers. Under TLS a channel is bound to the certificate files as they were when it
was made: when they change (server/tls.py ``ClientCertificates``), the next transfer
to that address opens a new channel with the new files, and the old one is closed once
its calls have ended (at most ``transfer_timeout_s`` later)."""

from __future__ import annotations

import asyncio

import grpc

from .config import ServerConfig
from .tls import KEEPALIVE, client_certificates


class DecoderChannels:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.tls = client_certificates(config)
        self.options = [("grpc.max_receive_message_length", config.max_receive_bytes),
                        ("grpc.max_send_message_length", config.max_receive_bytes),
                        # a restarted decoder is reached again within ~0.1-1 s, not gRPC's 1-120 s backoff
                        ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                        ("grpc.max_reconnect_backoff_ms", 1000), *KEEPALIVE]
        self._open: dict[str, tuple[int, grpc.aio.Channel]] = {}
        self._retiring: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._open)

    def get(self, addr: str) -> grpc.aio.Channel:
        """The channel to ``addr``, made anew when the TLS files changed since the last one."""
        generation, creds = self.tls.current() if self.tls is not None else (0, None)
        held = self._open.get(addr)
        if held is not None and held[0] == generation:
            return held[1]
        if held is not None:  # NOTE: close() waits for the calls under way, then cancels what is left
            task = asyncio.ensure_future(held[1].close(grace=self.config.transfer_timeout_s))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        channel = (grpc.aio.secure_channel(addr, creds, options=self.options) if creds is not None
                   else grpc.aio.insecure_channel(addr, options=self.options))
        self._open[addr] = (generation, channel)
        return channel

    async def close(self) -> None:
        for _, ch in self._open.values():
            await ch.close()
        self._open.clear()
        for task in list(self._retiring):
            task.cancel()
