"""Transport settings of the sidecars' gRPC channels: TLS credentials (server and the
encoder's channel towards decoders, mutual TLS when a CA is configured) and keepalive.

Certificates follow their files without a restart (cert-manager renewing a Secret, the
kubelet swapping the mounted files): the server's credentials are dynamic, gRPC asks
``ServerCertificates.fetch`` on every new handshake and it re-reads the files when their
stat changed; the encoder's ``ClientCertificates`` does the same for the channels it
opens towards decoders (server/channels.py). New files that cannot be read or do not
form a valid pair are logged at WARNING and the previous certificate keeps serving."""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
import threading

import grpc

from .config import ServerConfig

logger = logging.getLogger(__name__)

# NOTE: a peer that vanished without a FIN/RST (partition, killed host) is noticed
# within ~15 s, so its transfer ends, frees its memory and a retry can take the id
KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
             ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
             ("grpc.http2.max_pings_without_data", 0)]

Stamp = tuple[tuple[int, int, int, int], ...]
Pem = tuple[bytes, bytes, bytes | None]  # certificate chain, key, CA bundle


class InFlux(Exception):
    """The files changed while they were read (a rotation under way): read them again later."""


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _stamp(paths: tuple[str | None, ...]) -> Stamp:
    """What changes when any of the files is replaced: a kubelet Secret volume swaps a
    symlink (new inode), cert-manager's or an editor's write changes mtime and size."""
    out = []
    for p in paths:
        if p is not None:
            st = os.stat(p)  # NOTE: follows the symlinks of a Secret volume
            out.append((st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev))
    return tuple(out)


def fingerprint(cert_chain: bytes) -> str:
    """SHA-256 of the leaf certificate (DER), as `openssl x509 -fingerprint -sha256` prints it."""
    text = cert_chain.decode("ascii", "replace")
    end = text.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")
    digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(text[text.index("-----BEGIN CERTIFICATE-----"):end]))
    return digest.hexdigest().upper()


def load_pem(cert: str, key: str, ca: str | None) -> Pem:
    """The three files, checked: the chain parses, the key is the certificate's, the CA
    bundle holds certificates. Raises OSError, ssl.SSLError or ValueError; InFlux when
    a file changed between the reads."""
    before = _read(cert), _read(key), _read(ca)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)  # NOTE: ssl reads paths only; the re-read below closes the gap
    if before[2] is not None:
        ctx.load_verify_locations(cadata=before[2].decode("ascii"))
        if not ctx.get_ca_certs():
            raise ValueError(f"{ca} holds no certificate")
    if (_read(cert), _read(key), _read(ca)) != before:
        raise InFlux(cert)
    chain, pkey, bundle = before
    assert chain is not None and pkey is not None
    fingerprint(chain)  # a chain without a PEM certificate raises ValueError
    return chain, pkey, bundle


class Reloading:
    """PEM files re-read when their stat changes; the last good set is kept. Thread-safe
    (gRPC calls the server's fetcher from its own threads)."""

    def __init__(self, cert: str, key: str, ca: str | None, what: str) -> None:
        self.cert, self.key, self.ca, self.what = cert, key, ca, what
        self._lock = threading.Lock()
        self._seen: Stamp | None = _stamp((cert, key, ca))
        self.pem = load_pem(cert, key, ca)  # NOTE: bad files at start-up fail the start
        self._warned: str | None = None
        self.loads = 1

    def refresh(self) -> bool:
        """Re-read the files if they changed; True when a new certificate was taken."""
        with self._lock:
            try:
                stamp = _stamp((self.cert, self.key, self.ca))
                if stamp == self._seen:
                    return False
                self._seen = stamp
                pem = load_pem(self.cert, self.key, self.ca)
            except InFlux:
                self._seen = None  # read them again at the next handshake
                return False
            except (OSError, ValueError, ssl.SSLError) as e:
                self._warn(f"{type(e).__name__}: {e}")
                return False
            self._warned = None
            if pem == self.pem:
                return False
            self.pem, self.loads = pem, self.loads + 1
        logger.info("%s: new TLS certificate loaded from %s (sha256 %s)", self.what, self.cert, fingerprint(pem[0]))
        return True

    def _warn(self, why: str) -> None:
        if why != self._warned:  # once per distinct failure, not once per handshake
            self._warned = why
            logger.warning("%s: TLS files %s, %s changed but are not usable (%s); keeping the previous "
                           "certificate (sha256 %s)", self.what, self.cert, self.key, why, fingerprint(self.pem[0]))


class ServerCertificates(Reloading):
    """The sidecar's own certificate and the CA its clients must chain to (mTLS)."""

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        chain, key, ca = self.pem
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate-config fetcher: a new configuration when the files changed, else None."""
        try:
            return self.configuration() if self.refresh() else None
        except Exception:  # NOTE: never raise into gRPC's handshake
            logger.exception("%s: TLS reload failed; keeping the previous certificate", self.what)
            return None


class ClientCertificates(Reloading):
    """The encoder's credentials towards decoders; ``generation`` grows with each new set."""

    _creds: tuple[int, grpc.ChannelCredentials] | None = None

    def current(self) -> tuple[int, grpc.ChannelCredentials]:
        """(generation, credentials) from the files as they are now (the last good set)."""
        self.refresh()
        if self._creds is None or self._creds[0] != self.loads:
            chain, key, ca = self.pem
            self._creds = (self.loads, grpc.ssl_channel_credentials(ca, key, chain))
        return self._creds


def server_credentials(config: ServerConfig) -> tuple[grpc.ServerCredentials, ServerCertificates] | None:
    """TLS from ``tls_cert``/``tls_key``, re-read when the files change; with ``tls_ca``
    clients must present a certificate signed by it (mutual TLS). None: plaintext."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    certs = ServerCertificates(config.tls_cert, config.tls_key, config.tls_ca, f"{config.role} server")
    creds = grpc.dynamic_ssl_server_credentials(certs.configuration(), certs.fetch,
                                                require_client_authentication=config.tls_ca is not None)
    return creds, certs


def client_certificates(config: ServerConfig) -> ClientCertificates | None:
    """The encoder's credentials towards decoders: verify them with ``tls_ca`` and present
    its own certificate (mTLS). None (plaintext) unless ``tls_ca`` is set."""
    if config.tls_ca is None or config.tls_cert is None or config.tls_key is None:
        return None
    return ClientCertificates(config.tls_cert, config.tls_key, config.tls_ca, f"{config.role} client")
