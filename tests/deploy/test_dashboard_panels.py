"""The dashboard's Stages, Fallbacks, gRPC and Per model rows (issue 20, item 1) on a real
Prometheus scraping a real encoder + decoder pair, with fallbacks happening.

Each of two rounds (its own prompt: every histogram and counter increases inside the
rate window) runs a speckv transfer of the model's own KV, a speckv transfer of random
bits under the same prompt (its mu a cache hit; incompressible: every chunk is sent
stored, ``larger_than_stored``, on both sides), a stored transfer and a refused one
(another model). Then every expression of those rows (variables as Grafana fills them in) must
return finite values > 0 (a share of calls not OK: >= 0) carrying the labels its legend
shows, and the panels must show what the test did: the fallback reason and its share,
one role's count (never both roles' sum), the speckv.v1 methods and codes of the calls
made, each filter (role, model, pin) narrowing the gRPC join. test_dashboard.py holds the
static checks of every panel (these included) and the live check of the others.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from dashboard_helpers import ALL, MODEL, NAMESPACE, NEW_PANELS, _panel, _series
from prom_helpers import Prometheus, binary, finite, legend_labels, substitute, wait_until

ROWS = ("Stages", "Fallbacks", "gRPC", "Per model")
ROUNDS = 2
# series that may be 0 beside positive ones: a method without failed calls, the fallback
# reasons that did not happen (their series exist at 0 from the start)
ZERO_OK = ('grpc_code!="OK"', "speckv_fallback")


def _row_panels(d: dict) -> list[dict]:
    """The charts under the rows ``ROWS`` (a row's charts follow it in the panel list)."""
    out, row = [], None
    for p in d["panels"]:
        if p["type"] == "row":
            row = p["title"]
        elif row in ROWS:
            out.append(p)
    return out


def test_the_rows_exist(dashboard):
    titles = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert set(ROWS) <= titles
    # NEW_PANELS and the Fallbacks row's "Second predictor passes by outcome" (its counter moves in
    # tests/server/test_mu_recheck.py; here it stays at 0: tests/deploy/test_dashboard.py evaluates it)
    assert len(_row_panels(dashboard)) == len(NEW_PANELS) + 1 == 16


def _round(pair, n: int, ids, kv, noise) -> None:
    from speckv.client.client import DecoderClient, EncoderClient, RpcFailed

    with EncoderClient(pair.encoder_address, timeout=60) as enc, DecoderClient(pair.decoder_address, timeout=60) as dec:
        for name, data, encoding in (("kv", kv, "speckv"), ("noise", noise, "speckv"), ("stored", kv, "stored")):
            rid = f"panels-{name}-{n}"
            res = enc.submit(rid, data, ids, pair.decoder_address, MODEL, encoding=encoding)
            assert dec.fetch(rid, wait=10) is not None
            if name == "noise":  # every chunk went stored: coding would have grown it
                assert res.stored_chunks == res.chunks > 0 and res.encoding == "speckv", res
            else:
                assert res.stored_chunks == 0, res
        with pytest.raises(RpcFailed) as ei:
            enc.submit(f"panels-other-{n}", kv, ids, pair.decoder_address, "other")
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION


def _ok(prom: Prometheus) -> dict[str, float]:
    res = prom.query(f'sum by (role) (speckv_transfers_total{{namespace="{NAMESPACE}", outcome="ok"}})')
    return {s["metric"]["role"]: float(s["value"][1]) for s in res}


def test_new_rows_on_real_prometheus(dashboard, local_pair, embedded_session, tmp_path):
    binary("prometheus")  # skip (or fail) before any transfer when it is missing
    pair = local_pair
    target = embedded_session.target
    prompts = {n: target.tokenize(f"The dashboard's new rows, round {n}: stages, fallbacks, gRPC calls, models.")
               for n in range(1, ROUNDS + 1)}
    kvs = {n: target.kv(ids) for n, ids in prompts.items()}
    gen = torch.Generator().manual_seed(20)

    def noise(kv: torch.Tensor) -> torch.Tensor:
        bits = torch.randint(-(2**15), 2**15, tuple(kv.shape), dtype=torch.int32, generator=gen).to(torch.int16)
        return bits.view(torch.bfloat16)

    targets = [pair.metrics_url(r).removeprefix("http://").removesuffix("/metrics") for r in ("encoder", "decoder")]

    with Prometheus(tmp_path, targets, {"namespace": NAMESPACE}) as prom:
        try:
            for n in range(1, ROUNDS + 1):
                _round(pair, n, prompts[n], kvs[n], noise(kvs[n]))
                want = {"encoder": 3.0 * n, "decoder": 3.0 * n}
                wait_until(lambda want=want: _ok(prom) == want, 20, f"Prometheus to scrape round {n}: {want}")
            done = time.time()

            def scraped_since() -> bool:
                r = prom.query('timestamp(up{job="speckv"})')
                return len(r) == 2 and min(float(s["value"][1]) for s in r) > done + 2

            wait_until(scraped_since, 20, "two more scrapes of both sidecars")
            at = time.time()

            results: dict[tuple[str, str], list[dict]] = {}
            for p in _row_panels(dashboard):
                if p["title"] not in NEW_PANELS:
                    continue  # NOTE: the second predictor passes' counter stays at 0 here (test_the_rows_exist)
                for t in p["targets"]:
                    where = f"{p['title']}/{t['refId']}"
                    expr = substitute(t["expr"], ALL)
                    res = prom.query(expr, at)
                    assert res, f"{where}: empty result for {expr}"
                    values = [float(s["value"][1]) for s in res]
                    assert all(finite(str(v)) for v in values), (where, values)
                    floor_ok = any(z in t["expr"] for z in ZERO_OK)
                    assert all(v >= 0 if floor_ok else v > 0 for v in values) and max(values) > 0, (where, values)
                    for lab in legend_labels(t["legendFormat"]):
                        assert all(s["metric"].get(lab) for s in res), f"{where}: legend label {lab} missing: {res}"
                    results[(p["title"], t["refId"])] = res

            # Stages: each stage on the role that records it
            stages = {t["legendFormat"].split()[0]: {s["metric"]["role"] for s in results[(
                "Mean time per transfer by stage", t["refId"])]}
                for t in _panel(dashboard, "Mean time per transfer by stage")["targets"]}
            assert stages == {"predictor": {"encoder", "decoder"}, "encode": {"encoder"}, "decode": {"decoder"},
                              "mu_wait": {"encoder", "decoder"}, "wire_wait": {"encoder"},
                              "transfer": {"encoder", "decoder"}}, stages
            assert {s["metric"]["role"] for s in results[("Wire wait (encoder)", "B")]} == {"encoder"}
            lookups = _series(results[("Predictor passes by result", "A")], "role", "result")
            assert ("encoder", "miss") in lookups and ("encoder", "hit") in lookups, lookups  # the noise: a hit

            # Fallbacks: the noise transfers' chunks, on both sides, for the size guard only
            def positive(key: tuple[str, str], *labels: str) -> dict[tuple[str, ...], float]:
                return {k: v for k, v in _series(results[key], *labels).items() if v > 0}

            chunks = positive(("Chunks sent stored by reason", "A"), "role", "reason")
            assert set(chunks) == {("encoder", "larger_than_stored"), ("decoder", "larger_than_stored")}, chunks
            per_transfer = positive(("Transfers with stored chunks by reason", "A"), "role", "reason")
            assert set(per_transfer) == set(chunks), per_transfer
            share = positive(("Share of transfers falling back", "A"), "role", "reason")
            assert set(share) == set(chunks) and all(0.2 < v < 0.5 for v in share.values()), share  # 1 of 3
            raw = prom.query(f'sum by (role, reason) (speckv_fallback_transfers_total{{namespace="{NAMESPACE}"}}) > 0')
            assert _series(raw, "role", "reason") == {k: float(ROUNDS) for k in chunks}, raw
            stat = _panel(dashboard, "Chunks sent stored (fallbacks)")["targets"][0]["expr"]
            per_role = {r: float(prom.query(substitute(stat, {**ALL, "role": r}), at)[0]["value"][1])
                        for r in ("encoder", "decoder")}
            both = float(prom.query(substitute(stat, ALL), at)[0]["value"][1])
            assert per_role["encoder"] > 0 and both == pytest.approx(max(per_role.values())), (both, per_role)

            # gRPC: the speckv.v1 calls made, by method and code; each filter narrows the join
            calls = _series(results[("gRPC calls by method and code", "A")], "grpc_method", "grpc_code")
            assert set(calls) == {("Submit", "OK"), ("Submit", "FailedPrecondition"), ("Transfer", "OK"),
                                  ("FetchKV", "OK")}, calls
            errors = _series(results[("gRPC error ratio by method", "A")], "grpc_method")
            assert 0.2 < errors[("Submit",)] < 0.3 and errors[("Transfer",)] == errors[("FetchKV",)] == 0, errors
            p95 = _series(results[("gRPC handling time", "B")], "grpc_method")
            assert set(p95) == {("Submit",), ("Transfer",), ("FetchKV",)}, p95
            by_call = _panel(dashboard, "gRPC calls by method and code")["targets"][0]["expr"]
            dec_only = prom.query(substitute(by_call, {**ALL, "role": "decoder"}), at)
            assert {s["metric"]["grpc_method"] for s in dec_only} == {"Transfer", "FetchKV"}, dec_only
            pin = embedded_session.predictor.pin
            assert prom.query(substitute(by_call, {**ALL, "pin": pin}), at)
            for other in ({"pin": "ab" * 32}, {"model": "other-model"}, {"namespace": "elsewhere"}):
                assert prom.query(substitute(by_call, {**ALL, **other}), at) == [], other

            # Per model: one model, one role's figure
            for title in ("Completed transfers by model", "Bandwidth saved by model"):
                res = results[(title, "A")]
                assert [s["metric"]["model"] for s in res] == [MODEL], (title, res)
            expr = _panel(dashboard, "Completed transfers by model")["targets"][0]["expr"]
            one = {r: float(prom.query(substitute(expr, {**ALL, "role": r}), at)[0]["value"][1])
                   for r in ("encoder", "decoder")}
            shown = float(results[("Completed transfers by model", "A")][0]["value"][1])
            assert shown == pytest.approx(max(one.values())) and shown < 1.5 * min(one.values()), (shown, one)
            ratio = _series(results[("Compression ratio by model", "A")], "model", "encoding")
            assert set(ratio) == {(MODEL, "speckv"), (MODEL, "stored")} and 0.9 < ratio[(MODEL, "stored")] <= 1.0
        except BaseException:
            print("prometheus log tail:\n" + prom.log_tail())
            raise
    assert prom.proc is not None and prom.proc.poll() is not None
