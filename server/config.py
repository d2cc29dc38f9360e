"""Sidecar configuration: one typed dataclass, validated at construction.

Every field can be set three ways, highest priority first: a keyword (or CLI
flag, ``speckv serve --listen ...``), an environment variable (``SPECKV_LISTEN``,
for Kubernetes), or the default. ``FIELDS`` lists the flag, variable and parser
of each, so the CLI, the environment reader and the docs share one table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from speckv.coder.backends import CODERS
from speckv.quantity import format_size, parse_size
from speckv.wire import FRAMING_BYTES, MAX_MESSAGE_BYTES, SIDECAR_PART_BYTES

from .batcher import DEFAULT_BATCH_TOKENS

ROLES = ("encoder", "decoder")
FALLBACK_MAX_TOKENS = 131072  # max_tokens left unset and a model config that names no context


def _opt_str(v: str) -> str | None:
    return v or None


_bytes = parse_size  # bytes or a Kubernetes quantity: 2Gi, 2G, 512Mi, 1.5Gi (speckv/quantity.py)


@dataclass(frozen=True)
class ServerConfig:
    """What one sidecar serves and its limits."""

    role: str
    predictor: str | None = None  # checkpoint directory; None = the shipped default
    pin: str | None = None  # sha256 the checkpoint must have; None = accept what is there
    target: str = "default"  # target model, needed when the checkpoint derives its weights
    model_id: str | None = None  # served model id; None = the checkpoint's target name
    listen: str = "127.0.0.1:0"  # loopback unless configured otherwise; port 0 = ephemeral
    metrics_port: int = -1  # Prometheus /metrics; 0 = ephemeral, -1 = off
    metrics_host: str = "127.0.0.1"
    max_inflight_bytes: int = 1 << 30  # KV bytes buffered by all transfers together
    max_transfers: int = 64  # concurrent transfers (each also holds its predictor mu)
    # NOTE: predictor passes kept by prompt (server/mu_cache.py; 0 = off), running ones counted: a pass's
    # mu is as large as its KV (45 MiB at 2,048 tokens of the embedded model), so 256 MiB of distinct
    # prompts' mu took a decoder to 709 MiB, 2.8x the target's weights (benchmarks/load.py, six prompts)
    mu_cache_bytes: int = 64 << 20
    max_tokens: int | None = None  # prompt length limit per transfer; None = the served model's context
    # largest payload per gRPC message (parts); 0 = SIDECAR_PART_BYTES, or less where max_receive_bytes or
    # max_inflight_bytes are smaller. NOTE: an encoder's parts must fit its decoder's max_receive_bytes
    message_bytes: int = 0
    max_receive_bytes: int = MAX_MESSAGE_BYTES  # gRPC max receive message length
    grace_s: float = 10.0  # SIGTERM: time for in-flight transfers before they are cancelled
    fetch_wait_s: float = 30.0  # FetchKV's default wait for a transfer to arrive
    lease_s: float = 300.0  # an unfetched (or idle) decoded transfer expires after this
    transfer_timeout_s: float = 600.0  # encoder: deadline of its call to the decoder
    layers_per_chunk: int = 2
    threads: int = 2  # coder threads
    coder: str = "auto"  # per-scalar coder: numpy | native (CPU extension) | cuda (opt-in) | auto
    predictor_device: str = "cpu"  # where the predictor runs: cpu | cuda[:N] | auto
    predictor_batch_tokens: int = DEFAULT_BATCH_TOKENS  # concurrent prompts one predictor pass takes; 0 = off
    tls_cert: str | None = None  # PEM files: serve TLS (cert + key); with tls_ca, require client certs
    tls_key: str | None = None
    tls_ca: str | None = None  # CA bundle: verifies clients (mTLS) and, on the encoder, the decoder
    health_listen: str | None = None  # extra plaintext health-only port (probes while mTLS is on)
    allow: str | None = None  # per-RPC allow-list of client certificate names (server/auth.py), needs mTLS
    max_transfers_per_peer: int = 16  # concurrent transfers from one client host
    local_socket: str | None = None  # Unix socket for engines on this host: the encoder's sealed-memfd KV
    # hand-offs (server/handoff.py), the decoder's local fetches (server/mailbox.py)
    local_uids: str | None = None  # uids allowed on local_socket (SO_PEERCRED); None = this process's uid
    local_handle_ttl_s: float = 30.0  # a handed-off memfd no Submit claimed is closed after this
    local_max_handles: int = 256  # memfds mapped at once (each holds one fd)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
        if self.pin is not None:
            if len(self.pin) != 64 or not _is_hex(self.pin):
                raise ValueError("pin must be 64 hex digits (a sha256)")
            object.__setattr__(self, "pin", self.pin.lower())  # pins compare as lower-case hex
        if ":" not in self.listen:
            raise ValueError(f"listen must be HOST:PORT, not {self.listen!r}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be -1 (off), 0 (ephemeral) or a port, not {self.metrics_port}")
        if self.mu_cache_bytes < 0:
            raise ValueError(f"mu_cache_bytes must be >= 0, not {self.mu_cache_bytes}")
        if self.predictor_batch_tokens < 0:
            raise ValueError(f"predictor_batch_tokens must be >= 0 (0 = off), not {self.predictor_batch_tokens}")
        if self.message_bytes == 0:  # NOTE: a limit set lower than the default's still holds alone
            object.__setattr__(self, "message_bytes", max(64 * 1024, min(
                SIDECAR_PART_BYTES, self.max_receive_bytes - FRAMING_BYTES, self.max_inflight_bytes)))
        if not 64 * 1024 <= self.message_bytes <= self.max_receive_bytes - FRAMING_BYTES:
            raise ValueError("message_bytes must be >= 64 KiB and leave 64 KiB of max_receive_bytes "
                             "for framing")
        if self.max_inflight_bytes < self.message_bytes:
            raise ValueError("max_inflight_bytes must hold at least one message")
        for name in ("max_transfers", "layers_per_chunk", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.coder not in CODERS:
            raise ValueError(f"coder must be one of {', '.join(CODERS)}, not {self.coder!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("tls_ca needs tls_cert and tls_key (mTLS)")
        if self.allow is not None:
            from .auth import parse_allow

            parse_allow(self.allow)  # ValueError names the bad entry
            if self.tls_ca is None:
                raise ValueError("allow needs mutual TLS (tls_ca): identities come from client certificates")
        if self.max_transfers_per_peer < 1:
            raise ValueError("max_transfers_per_peer must be >= 1")
        if self.health_listen is not None and ":" not in self.health_listen:
            raise ValueError(f"health_listen must be HOST:PORT, not {self.health_listen!r}")
        if self.local_uids is not None:
            from .local_socket import parse_uids

            parse_uids(self.local_uids)  # ValueError names the bad value
        if self.local_max_handles < 1:
            raise ValueError("local_max_handles must be >= 1")
        for name in ("grace_s", "fetch_wait_s", "lease_s", "transfer_timeout_s", "local_handle_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")

    @classmethod
    def from_env(cls, role: str, env: Mapping[str, str] | None = None, **given: Any) -> "ServerConfig":
        """Keyword values (None = not given) over ``SPECKV_*`` variables over defaults."""
        env = os.environ if env is None else env
        kw: dict[str, Any] = {}
        source: dict[str, str] = {}
        for f in FIELDS:
            if given.get(f.name) is not None:
                kw[f.name] = given[f.name]
            elif env.get(f.env):
                try:
                    kw[f.name] = f.parse(env[f.env])
                except ValueError as e:
                    raise ValueError(f"{f.env}={env[f.env]!r}: {e}") from None
                source[f.name] = f.env
        try:
            return cls(role=role, **kw)
        except ValueError as e:  # name the variable a bad value came from
            names = [v for k, v in source.items() if str(e).startswith(k) or f" {k} " in f" {e} "]
            raise ValueError(f"{names[0]}: {e}" if names else str(e)) from None


def _is_hex(s: str) -> bool:
    try:
        int(s, 16)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class Field:
    name: str
    flag: str
    env: str
    parse: Callable[[str], Any]
    help: str


def _field(name: str, parse: Callable[[str], Any], help: str) -> Field:
    return Field(name, "--" + name.replace("_", "-"), "SPECKV_" + name.upper(), parse, help)


FIELDS = (
    _field("predictor", _opt_str, "predictor checkpoint directory (default: the shipped one)"),
    _field("pin", _opt_str, "sha256 the checkpoint must have"),
    _field("target", str, "target model for derived predictor weights: 'default' (the embedded one) or a "
                          "model directory"),
    _field("model_id", _opt_str, "model id served (default: the checkpoint's target name)"),
    _field("listen", str, "gRPC listen address HOST:PORT"),
    _field("metrics_port", int, "Prometheus /metrics port (0 ephemeral, -1 off)"),
    _field("metrics_host", str, "Prometheus /metrics bind address"),
    _field("max_inflight_bytes", _bytes, "cap on buffered KV bytes (bytes or a quantity: 1Gi, 2G, 1.5Gi)"),
    _field("max_transfers", int, "cap on concurrent transfers"),
    _field("mu_cache_bytes", _bytes, "predictor passes kept by exact prompt for retries and repeats (e.g. "
                                     "256Mi; 0 = off)"),
    _field("max_tokens", int, "prompt length limit per transfer, at most the model's context "
                              "(default: the context, its config's max_position_embeddings)"),
    _field("message_bytes", _bytes, "largest payload per gRPC message (0: 4 MiB - 64 KiB, or less to fit "
                                    "max_receive_bytes and max_inflight_bytes; a decoder's max_receive_bytes must "
                                    "take its encoder's)"),
    _field("max_receive_bytes", _bytes, "gRPC max receive message length"),
    _field("grace_s", float, "SIGTERM grace period, seconds"),
    _field("fetch_wait_s", float, "FetchKV default wait, seconds"),
    _field("lease_s", float, "unfetched transfers expire after this many seconds"),
    _field("transfer_timeout_s", float, "encoder's deadline for one transfer, seconds"),
    _field("layers_per_chunk", int, "layers per coded chunk"),
    _field("threads", int, "coder threads"),
    _field("predictor_device", str, "predictor device: cpu | cuda[:N] | auto (both sidecars alike!)"),
    _field("predictor_batch_tokens", int, "tokens of concurrent transfers' prompts one predictor pass takes "
                                          "(server/batcher.py; mu stays bit for bit; 0 = one pass per prompt)"),
    _field("coder", str, "per-scalar coder: numpy | native | cuda (opt-in) | auto (native, else numpy)"),
    _field("tls_cert", _opt_str, "PEM certificate: serve TLS"),
    _field("tls_key", _opt_str, "PEM private key of tls_cert"),
    _field("tls_ca", _opt_str, "PEM CA bundle: require and verify client certificates (mTLS)"),
    _field("health_listen", _opt_str, "extra plaintext health-only HOST:PORT (probes under mTLS)"),
    _field("allow", _opt_str, "per-RPC allow-list of client cert names: RPC=ID,ID;RPC=ID (needs mTLS)"),
    _field("max_transfers_per_peer", int, "concurrent transfers from one client host"),
    _field("local_socket", _opt_str, "Unix socket path for engines on this host (off when unset): the encoder "
                                     "takes their KV as sealed memfds, the decoder hands it out as memfds"),
    _field("local_uids", _opt_str, "uids allowed on local_socket, comma-separated (default: the sidecar's own)"),
    _field("local_handle_ttl_s", float, "seconds a handed-off memfd waits for its Submit before it is closed"),
    _field("local_max_handles", int, "handed-off memfds mapped at once"),
)
assert {f.name for f in FIELDS} == {f.name for f in fields(ServerConfig)} - {"role"}


def default_text(f: Field) -> str | None:
    """The default of ``f`` as a flag would spell it (sizes as quantities); None when unset."""
    default: Any = {d.name: d.default for d in fields(ServerConfig)}[f.name]
    if default is None:
        return None
    return format_size(default) if f.parse is _bytes else str(default)
