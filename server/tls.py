"""Transport settings of the sidecars' gRPC channels: TLS credentials (server and the
encoder's channel towards decoders, mutual TLS when a CA is configured) and keepalive."""

from __future__ import annotations

import grpc

from .config import ServerConfig

# NOTE: a peer that vanished without a FIN/RST (partition, killed host) is noticed
# within ~15 s, so its transfer ends, frees its memory and a retry can take the id
KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
             ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
             ("grpc.http2.max_pings_without_data", 0)]


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS from ``tls_cert``/``tls_key``; with ``tls_ca`` clients must present a certificate
    signed by it (mutual TLS). None: plaintext."""
    if config.tls_cert is None:
        return None
    key, cert = _read(config.tls_key), _read(config.tls_cert)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=_read(config.tls_ca),
                                       require_client_auth=config.tls_ca is not None)


def channel_credentials(config: ServerConfig) -> grpc.ChannelCredentials | None:
    """The encoder's credentials towards decoders: verify them with ``tls_ca`` and present
    its own certificate (mTLS). None (plaintext) unless ``tls_ca`` is set."""
    if config.tls_ca is None:
        return None
    return grpc.ssl_channel_credentials(_read(config.tls_ca), _read(config.tls_key), _read(config.tls_cert))
