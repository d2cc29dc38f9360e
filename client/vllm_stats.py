"""The vLLM connector's own telemetry, through vLLM's connector-stats API: each worker
counts what its transfers did; vLLM aggregates the counts of every worker, logs them
("KV Transfer metrics: ...") and exports them on its /metrics as ``vllm:speckv_*``.

The sidecars' Prometheus metrics stay the full story (bytes per stage, fallbacks,
waits); these say what the engine saw: transfers sent and received, failures that made
vLLM recompute, and the wire bytes the connector's submits were coded into.

Imported only inside vLLM's process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTS = ("sent", "send_failed", "raw_bytes_sent", "wire_bytes_sent", "received", "receive_failed",
          "raw_bytes_received")
FETCH_SECONDS = "fetch_seconds"  # one entry per received transfer: FetchKV until verified
PROM = {  # count -> (vLLM metric name, help)
    "sent": ("vllm:speckv_transfers_sent", "Requests whose KV the prefill engine handed to its speckv encoder"),
    "send_failed": ("vllm:speckv_transfers_send_failed", "speckv submits that failed (the decode side recomputes)"),
    "raw_bytes_sent": ("vllm:speckv_raw_bytes_sent", "Raw KV bytes handed to the speckv encoder"),
    "wire_bytes_sent": ("vllm:speckv_wire_bytes_sent", "Bytes the speckv encoder sent for them"),
    "received": ("vllm:speckv_transfers_received", "Transfers the decode engine loaded, verified"),
    "receive_failed": ("vllm:speckv_transfers_receive_failed",
                       "Transfers the decode engine could not load or verify (vLLM recomputed them)"),
    "raw_bytes_received": ("vllm:speckv_raw_bytes_received", "Raw KV bytes loaded into the decode engine's blocks"),
}


@dataclass
class SpeckvConnectorStats(KVConnectorStats):
    """Counts since the last collection (``data``: COUNTS and FETCH_SECONDS)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        fresh: dict[str, Any] = {**{k: 0 for k in COUNTS}, FETCH_SECONDS: []}
        self.data = fresh

    def add(self, **counts: int) -> None:
        for k, v in counts.items():
            self.data[k] += v

    def fetched(self, raw_bytes: int, seconds: float) -> None:
        self.add(received=1, raw_bytes_received=raw_bytes)
        self.data[FETCH_SECONDS].append(seconds)

    def aggregate(self, other: KVConnectorStats) -> "SpeckvConnectorStats":
        for k in COUNTS:
            self.data[k] += other.data.get(k, 0)
        self.data[FETCH_SECONDS] = self.data[FETCH_SECONDS] + list(other.data.get(FETCH_SECONDS, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        d: dict[str, Any] = self.data
        fetch = d[FETCH_SECONDS]
        return {"Transfers sent": d["sent"], "Send failures": d["send_failed"],
                "Ratio": round(d["raw_bytes_sent"] / d["wire_bytes_sent"], 3) if d["wire_bytes_sent"] else 0.0,
                "Transfers received": d["received"], "Receive failures": d["receive_failed"],
                "MB received": round(d["raw_bytes_received"] / 1e6, 3),
                "Avg fetch (ms)": round(1e3 * sum(fetch) / len(fetch), 1) if fetch else 0.0}

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in COUNTS)

    def clone_and_reset(self) -> "SpeckvConnectorStats":
        out = SpeckvConnectorStats(data=self.data)
        self.reset()
        return out


class SpeckvPromMetrics(KVConnectorPromMetrics):
    """vLLM's /metrics: one counter per COUNTS entry, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {k: create_metric_per_engine(self._counter_cls(name=name, documentation=doc,
                                                                       labelnames=labelnames),
                                                     self.per_engine_labelvalues)
                         for k, (name, doc) in PROM.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, per_engine in self.counters.items():
            v = transfer_stats_data.get(k, 0)
            if v:
                per_engine[engine_idx].inc(v)
