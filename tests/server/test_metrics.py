"""/metrics of both sidecars after real transfers on a fresh pair: the byte
counters equal what the transfers report, per (dtype, encoding), on both
sides; outcomes, histograms and gauges add up; promtool accepts the text."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from collections import defaultdict

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from require import missing
from server_helpers import MODEL, WAIT, Pair, rid, wait_until

from speckv.client.client import RpcFailed


def scrape(sidecar) -> str:
    assert sidecar.metrics_port, "metrics are off"
    with urllib.request.urlopen(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of a scrape."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(snap, name: str, **labels) -> float:
    return snap.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def measured(sidecars, prompts, fp8_kv):
    """A fresh pair; its scrapes before and after three transfers and one failure."""
    p = Pair.start(sidecars)
    before = {role: scrape(s) for role, s in (("decoder", p.decoder), ("encoder", p.encoder))}
    ids, kv = prompts("short")
    fids, fkv = fp8_kv("short")
    done = defaultdict(list)  # (dtype, encoding) -> SubmitResults
    done["bf16", "speckv"].append(p.roundtrip(rid("m1"), kv, ids))
    done["bf16", "speckv"].append(p.roundtrip(rid("m2"), kv, ids))
    done["bf16", "stored"].append(p.roundtrip(rid("m3"), kv, ids, encoding="stored"))
    done["fp8", "speckv"].append(p.roundtrip(rid("m4"), fkv, fids))
    with pytest.raises(RpcFailed) as ei:  # one failure at the encoder: a model it does not serve
        p.enc.submit(rid("m5"), kv, ids, p.daddr, "other-model", timeout=WAIT)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    # FetchKV's handler may finish (gauges, budget) just after the engine saw its last layer
    for s in (p.decoder, p.encoder):
        wait_until(lambda s=s: value(samples(scrape(s)), "speckv_inflight_transfers", role=s.config.role,
                                 model=MODEL) == 0, timeout=5, what=f"{s.config.role} inflight_transfers 0")
    after = {role: scrape(s) for role, s in (("decoder", p.decoder), ("encoder", p.encoder))}
    yield p, before, after, dict(done)
    p.stop()


@pytest.mark.parametrize("role", ["encoder", "decoder"])
def test_byte_counters_match_the_transfers(measured, role):
    _, before, after, done = measured
    b, a = samples(before[role]), samples(after[role])
    for (dtype, encoding), results in done.items():
        lab = dict(role=role, model=MODEL, dtype=dtype, encoding=encoding)
        raw = sum(r.raw_bytes for r in results)
        wire = sum(r.wire_bytes for r in results)
        assert value(a, "speckv_raw_bytes_total", **lab) - value(b, "speckv_raw_bytes_total", **lab) == raw
        # wire: the 110-byte header record of each transfer and all its chunk records
        assert value(a, "speckv_wire_bytes_total", **lab) - value(b, "speckv_wire_bytes_total", **lab) == wire
        saved = value(a, "speckv_saved_bytes_total", **lab) - value(b, "speckv_saved_bytes_total", **lab)
        if encoding == "speckv":  # every chunk compresses, header records included: saved = raw - wire
            assert saved == raw - wire > 0
        else:  # stored chunks only grow (framing): nothing saved, never negative
            assert wire > raw and saved == 0
        assert value(a, "speckv_wire_bytes_per_scalar_count", **lab) \
            - value(b, "speckv_wire_bytes_per_scalar_count", **lab) == len(results)
        scalars = raw // (1 if dtype == "fp8" else 2)
        got = value(a, "speckv_wire_bytes_per_scalar_sum", **lab) - value(b, "speckv_wire_bytes_per_scalar_sum", **lab)
        assert got == pytest.approx(sum(r.wire_bytes / (r.raw_bytes // (1 if dtype == "fp8" else 2))
                                        for r in results))
        assert scalars > 0


@pytest.mark.parametrize("role", ["encoder", "decoder"])
def test_outcomes_timings_and_gauges(measured, role):
    p, before, after, done = measured
    b, a = samples(before[role]), samples(after[role])
    n = sum(len(v) for v in done.values())

    def delta(name, **lab):
        return value(a, name, role=role, model=MODEL, **lab) - value(b, name, role=role, model=MODEL, **lab)

    assert delta("speckv_transfers_total", outcome="ok") == n == 4
    # the encoder refused the unknown model itself; the decoder never saw it
    assert delta("speckv_transfers_total", outcome="failed_precondition") == (1 if role == "encoder" else 0)
    assert delta("speckv_transfer_seconds_count") == n
    # three speckv transfers of one prompt (BF16 twice, FP8 once): one predictor pass, then the
    # mu cache; none for the stored transfer
    assert delta("speckv_predictor_seconds_count") == 1
    assert (delta("speckv_mu_cache_lookups_total", result="miss"),
            delta("speckv_mu_cache_lookups_total", result="hit")) == (1, 2)
    stage = "encode" if role == "encoder" else "decode"
    assert delta(f"speckv_{stage}_seconds_count") == n
    assert delta("speckv_first_layer_seconds_count") == (n if role == "decoder" else 0)
    assert value(a, "speckv_inflight_transfers", role=role, model=MODEL) == 0
    assert value(a, "speckv_inflight_bytes", role=role, model=MODEL) == 0
    sidecar = p.encoder if role == "encoder" else p.decoder
    assert value(a, "speckv_inflight_limit_bytes", role=role, model=MODEL) == sidecar.config.max_inflight_bytes
    # only this sidecar's series: a private registry per sidecar
    assert all(dict(lab).get("role", role) == role for (_, lab) in a)


def test_integrity_failures_start_at_zero(measured):
    _, _, after, _ = measured
    for role in ("encoder", "decoder"):
        fams = {f.name: f for f in text_string_to_metric_families(after[role])}
        assert "speckv_integrity_failures" in fams  # declared (HELP/TYPE) even with no series yet
        assert all(s.value == 0 for s in fams["speckv_integrity_failures"].samples)


def _promtool(text: str) -> tuple[int, list[str]]:
    promtool = shutil.which("promtool")
    if promtool is None:
        missing("PROMTOOL", "promtool not on PATH (Debian package 'prometheus'; .ci/run installs it)")
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    return proc.returncode, (proc.stdout + proc.stderr).splitlines()


@pytest.mark.parametrize("role", ["encoder", "decoder"])
def test_promtool_accepts_the_exposition(measured, role):
    rc, lines = _promtool(measured[2][role])
    assert rc == 0 and lines == [], lines


def test_metrics_off(sidecars):
    s, _ = sidecars.start("decoder", metrics_port=-1)
    try:
        assert s.metrics_port is None
    finally:
        sidecars.stop(s, 0.1)


def test_build_info_and_process_collectors(sidecars, embedded_session):
    import speckv
    from speckv.coder import container as ct

    dec, _ = sidecars.start("decoder")
    try:
        snap = samples(scrape(dec))
        (labels,) = [dict(lab) for (name, lab) in snap if name == "speckv_build_info"]
        assert labels == {"role": "decoder", "model": MODEL, "version": speckv.__version__,
                          "pin": embedded_session.predictor.pin, "coder": dec.service.rt.codec.backend.name,
                          "predictor_device": "cpu", "format_version": str(ct.FORMAT_VERSION)}
        assert value(snap, "speckv_build_info", **labels) == 1
        names = {name for name, _ in snap}
        assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"} <= names
        assert value(snap, "process_resident_memory_bytes") > 50e6  # a loaded model's process
    finally:
        sidecars.stop(dec, 0.1)
