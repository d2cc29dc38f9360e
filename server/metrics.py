"""All Prometheus metrics of a sidecar, in one place.

Names follow the Prometheus conventions: ``speckv_`` prefix, base units
(bytes, seconds), ``_total`` on counters. Every sidecar owns a private
``CollectorRegistry`` (two sidecars in one process, as in tests and the demo,
do not mix their series) served on ``/metrics`` by ``start_http``.

Besides the ``speckv_*`` families: the standard process (``process_*``),
platform (``python_info``) and GC (``python_gc_*``) collectors, and
``speckv_build_info`` (1, labelled with version, predictor pin, coder backend,
predictor device and stream format version), and the gRPC server families of
go-grpc-prometheus (``grpc_server_*``, server/grpc_metrics.py).

Labels: ``role`` (encoder | decoder), ``model`` (the served model id),
``dtype`` (bf16 | fp8), ``encoding`` (speckv | stored), ``outcome`` (a lower-case
gRPC status name, ``ok`` on success), ``kind`` (what failed an integrity check),
``reason`` (why chunks went stored: ``FALLBACK_REASONS``), ``result`` (hit | miss).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from .grpc_metrics import GrpcMetrics
from .memory import peak_rss_bytes

logger = logging.getLogger(__name__)

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# wire bytes per scalar (x 8 = bits per scalar): 0.5 .. 17 bits
_PER_SCALAR = tuple(b / 8 for b in (0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 5.5, 6, 6.5, 7, 8, 10, 12, 16, 17))
_PROMPTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
# why a speckv chunk goes stored
FALLBACK_REASONS = ("mu_mismatch", "larger_than_stored", "pin_mismatch", "model_mismatch")
RECHECK_OUTCOMES = ("same", "recovered", "unstable", "error")  # server/mu_recheck.py


class Metrics:
    """The metric families of one sidecar; ``role`` and ``model`` are bound here."""

    def __init__(self, role: str, model: str, registry: CollectorRegistry | None = None) -> None:
        self.role, self.model = role, model
        self.registry = registry or CollectorRegistry()
        r = self.registry
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*
            if registry is None:
                r.register(collector)
        self.build = Gauge("speckv_build_info", "1, labelled with what this sidecar runs.",
                           ("role", "model", "version", "pin", "coder", "predictor_device", "format_version"),
                           registry=r)
        lab = ("role", "model", "dtype", "encoding")
        self.raw_bytes = Counter("speckv_raw_bytes_total",
                                 "Raw (uncompressed) KV bytes encoded or decoded.", lab, registry=r)
        self.wire_bytes = Counter("speckv_wire_bytes_total",
                                  "Compressed stream bytes (header and chunk records) sent or received.",
                                  lab, registry=r)
        self.saved_bytes = Counter("speckv_saved_bytes_total",
                                   "Raw bytes minus wire bytes (header record included) of completed "
                                   "chunks; a chunk that grew counts 0.", lab, registry=r)
        # NOTE: in bytes, the base unit (promtool rejects "bits"); dashboards show 8x as bits/scalar
        self.bytes_per_scalar = Histogram("speckv_wire_bytes_per_scalar",
                                          "Wire bytes per KV scalar of completed transfers (x8 = bits "
                                          "per scalar).", lab, buckets=_PER_SCALAR, registry=r)
        self.stage_seconds = {
            stage: Histogram(f"speckv_{stage}_seconds", doc, ("role", "model"), buckets=_SECONDS, registry=r)
            for stage, doc in (("encode", "Entropy-coding time per transfer."),
                               ("decode", "Entropy-decoding time per transfer."),
                               ("predictor", "Predictor (mu) time per transfer."),
                               ("transfer", "Time from a transfer's header to its result."),
                               ("first_layer", "Decoder: time from FetchKV to its first layer."),
                               ("mu_wait", "Time per transfer that coding (encoder) or decoding (decoder) "
                                "waited for a chunk's mu: this side's predictor, or the peer's check."),
                               ("wire_wait", "Encoder: time per transfer spent in writes to the decoder "
                                "(flow control: the link or the decoder's backpressure)."))}
        self.transfers = Counter("speckv_transfers_total", "Transfers finished, by outcome.",
                                 ("role", "model", "outcome"), registry=r)
        self.integrity_failures = Counter("speckv_integrity_failures_total",
                                          "Checksum, digest and mu-fingerprint failures.",
                                          ("role", "model", "kind"), registry=r)
        self.fallbacks = Counter("speckv_fallbacks_total",
                                 "Chunks of speckv streams sent stored, by reason: mu_mismatch (the sidecars' "
                                 "predictors disagree on the chunk's layers), larger_than_stored (size guard), "
                                 "pin_mismatch / model_mismatch (the decoder holds another checkpoint / "
                                 "serves another model: the whole stream, encoder only).",
                                 ("role", "model", "reason"), registry=r)
        self.fallback_transfers = Counter("speckv_fallback_transfers_total",
                                          "Completed transfers of speckv streams with chunks sent stored, by "
                                          "reason (a transfer with chunks stored for two reasons counts under "
                                          "each; pin_mismatch, model_mismatch: the whole stream, encoder only).",
                                          ("role", "model", "reason"), registry=r)
        self.mu_rechecks = Counter("speckv_mu_rechecks_total",
                                   "Second predictor passes after the decoder's mu of a chunk disagreed "
                                   "(encoder; server/mu_recheck.py), by outcome: same (this side repeats "
                                   "itself: the decoder computes another mu), recovered (the first pass here "
                                   "was wrong: the second agrees with the decoder and the transfer goes on "
                                   "coded), unstable (the second pass differs from both), error.",
                                   ("role", "model", "outcome"), registry=r)
        for reason in FALLBACK_REASONS:  # NOTE: known series exist at 0 from the start
            self.fallbacks.labels(role, model, reason)
            self.fallback_transfers.labels(role, model, reason)
        for outcome in RECHECK_OUTCOMES if role == "encoder" else ():
            self.mu_rechecks.labels(role, model, outcome)
        self.mu_cache_lookups = Counter("speckv_mu_cache_lookups_total",
                                        "Predictor passes looked up by prompt: hit (cached or shared with a "
                                        "transfer in flight) or miss (a new pass).", ("role", "model", "result"),
                                        registry=r)
        self.local_bytes = Counter("speckv_local_bytes_total",
                                   "Raw KV bytes through the local socket as memfds: taken in from engines "
                                   "(encoder) or handed out to them (decoder).", ("role", "model"), registry=r)
        self.local_bytes.labels(role, model)  # NOTE: the series exists at 0 from the start
        self.inflight_transfers = Gauge("speckv_inflight_transfers", "Transfers in progress.",
                                        ("role", "model"), registry=r)
        self.inflight_bytes = Gauge("speckv_inflight_bytes", "KV bytes buffered by transfers in progress.",
                                    ("role", "model"), registry=r)
        self.inflight_limit = Gauge("speckv_inflight_limit_bytes", "Cap on buffered KV bytes.",
                                    ("role", "model"), registry=r)
        self.pass_prompts = Histogram("speckv_predictor_pass_prompts",
                                      "Prompts per predictor pass: concurrent transfers' prompts batched "
                                      "into one pass (server/batcher.py).", ("role", "model"),
                                      buckets=_PROMPTS, registry=r)
        self.peak_resident = Gauge("speckv_peak_resident_bytes",
                                   "Peak resident memory of this process (the kernel's VmHWM).",
                                   ("role", "model"), registry=r)
        self.peak_resident.labels(role, model).set_function(peak_rss_bytes)
        self.grpc = GrpcMetrics(r)
        self._http: Any = None

    # -- recording helpers (labels bound) -----------------------------------
    def chunk(self, dtype: str, encoding: str, raw: int, wire: int, overhead: int = 0) -> None:
        """One completed chunk; ``overhead``: wire bytes already counted for it (the
        header record, charged to a transfer's first chunk) that its savings must pay."""
        lab = (self.role, self.model, dtype, encoding)
        self.raw_bytes.labels(*lab).inc(raw)
        self.wire_bytes.labels(*lab).inc(wire)
        self.saved_bytes.labels(*lab).inc(max(raw - wire - overhead, 0))

    def local(self, raw: int) -> None:
        self.local_bytes.labels(self.role, self.model).inc(raw)

    def header(self, dtype: str, encoding: str, wire: int) -> None:
        self.wire_bytes.labels(self.role, self.model, dtype, encoding).inc(wire)

    def finished(self, outcome: str, dtype: str | None = None, encoding: str | None = None,
                 scalars: int = 0, wire: int = 0, fallback_reasons: Iterable[str] = ()) -> None:
        """A transfer ended; ``fallback_reasons``: why chunks of a completed one went stored."""
        self.transfers.labels(self.role, self.model, outcome).inc()
        if outcome != "ok":
            return
        if scalars and dtype and encoding:
            self.bytes_per_scalar.labels(self.role, self.model, dtype, encoding).observe(wire / scalars)
        for reason in sorted(set(fallback_reasons)):
            self.fallback_transfers.labels(self.role, self.model, reason).inc()

    def seconds(self, stage: str, value: float) -> None:
        self.stage_seconds[stage].labels(self.role, self.model).observe(value)

    def build_info(self, version: str, pin: str, coder: str, predictor_device: str, format_version: int) -> None:
        self.build.labels(self.role, self.model, version, pin, coder, predictor_device, str(format_version)).set(1)

    def predictor_pass(self, prompts: int) -> None:
        """One predictor pass of ``prompts`` prompts (called on the batcher's thread)."""
        self.pass_prompts.labels(self.role, self.model).observe(prompts)

    def mu_cache(self, hit: bool) -> None:
        self.mu_cache_lookups.labels(self.role, self.model, "hit" if hit else "miss").inc()

    def mu_recheck(self, outcome: str) -> None:
        self.mu_rechecks.labels(self.role, self.model, outcome).inc()

    def fallback(self, reason: str) -> None:
        self.fallbacks.labels(self.role, self.model, reason).inc()

    def integrity(self, kind: str) -> None:
        self.integrity_failures.labels(self.role, self.model, kind).inc()

    def gauges(self, transfers: int, inflight: int, limit: int) -> None:
        self.inflight_transfers.labels(self.role, self.model).set(transfers)
        self.inflight_bytes.labels(self.role, self.model).set(inflight)
        self.inflight_limit.labels(self.role, self.model).set(limit)

    # -- exposition -----------------------------------------------------------
    def start_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0 = ephemeral); returns the bound port."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = (server, thread)
        bound = server.server_address[1]
        logger.info("%s metrics on http://%s:%s/metrics", self.role, host, bound)
        return bound

    def stop_http(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None

