"""``speckv demo``: the main job, end to end, on the embedded model.

Loads the embedded target and the default pinned predictor, starts a decoder
and an encoder sidecar on loopback (real gRPC servers, ephemeral ports),
prefills a built-in prompt, submits the target's KV to the encoder, which
codes it and streams it to the decoder, fetches it back from the decoder
layer by layer (concurrently, as a decode engine would), verifies it bit for
bit against the original and reports raw vs coded vs wire bytes, the time of
each stage and the sidecars' /metrics addresses.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

DEMO_PROMPT = (
    "The night train left the valley a little after nine. In the last carriage an old "
    "engineer explained to a sleepy student why bridges hum in the wind: every span has a "
    "note of its own, and when the gusts find it the whole structure sings along. The "
    "student asked whether that was dangerous. Only, said the engineer, if nobody listens. "
    "Outside, the river kept pace with them for a while, silver under the moon, and then "
    "turned away towards the sea."
)
TRANSPORT = "grpc-loopback"


def run_demo(target: str | Path = "default", predictor: str | Path | None = None,
             pin: str | None = None, quiet: bool = False, coder: str = "auto") -> dict[str, Any]:
    """Prefill, transfer through both sidecars, verify bit for bit; returns the summary."""
    import numpy as np

    from speckv.client.client import DecoderClient, EncoderClient
    from speckv.coder.codec import bf16_bits
    from speckv.predictor.session import Session
    from speckv.server.local import LocalPair

    from .progress import steps

    with steps(5, quiet=quiet) as step:
        step("loading target and predictor (first run converts the GGUF)")
        sess = Session.open(target, predictor, pin)
        step("starting decoder and encoder sidecars on loopback")
        with LocalPair(sess.predictor, coder=coder) as pair:
            step("prefill: the target's KV")
            t0 = time.perf_counter()
            ids = sess.target.tokenize(DEMO_PROMPT)
            kv = sess.target.kv(ids)
            prefill_s = time.perf_counter() - t0
            step("transfer: encoder -> decoder, fetched back layer by layer")
            res, back, fetch = _transfer(pair, kv, ids, sess, EncoderClient, DecoderClient)
            lossless = bool(np.array_equal(back, bf16_bits(kv)))
            urls = {r: pair.metrics_url(r) for r in ("encoder", "decoder")}
            scraped = {r: scrape(urls[r]) for r in urls}
            step("ideal code length")
            from speckv.predictor.session import Prefill

            mu = sess.predictor.mu(ids)
            ideal = sess.entropy(Prefill(ids, kv, mu, prefill_s, res.predictor_seconds), "bf16")
    n = int(kv.numel())
    return {"lossless": lossless, "tokens": int(len(ids)), "transport": TRANSPORT,
            "raw_bytes": res.raw_bytes, "coded_bytes": res.wire_bytes, "wire_bytes": res.message_bytes,
            "ratio": res.raw_bytes / res.wire_bytes, "bits_per_scalar": 8 * res.wire_bytes / n,
            "ideal_bits_per_scalar": ideal["bits_per_scalar"],
            "order0_bits_per_scalar": ideal["order0_bits_per_scalar"], "chunks": res.chunks,
            "prefill_s": round(prefill_s, 3), "predictor_s": round(res.predictor_seconds, 4),
            "encode_s": round(res.encode_seconds, 4), "transfer_s": round(res.transfer_seconds, 4),
            "submit_total_s": round(res.total_seconds, 4), "first_layer_s": round(fetch["first"], 4),
            "fetch_total_s": round(fetch["total"], 4),
            "metrics": urls, "metrics_scraped": {
                f"{r}_{k}": scraped[r].get(k, 0.0) for r in scraped
                for k in ("speckv_raw_bytes_total", "speckv_wire_bytes_total", "speckv_saved_bytes_total")},
            "pin": sess.pin}


def scrape(url: str | None) -> dict[str, float]:
    """Sum of each sample name's values at a /metrics URL (labels summed over)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    if url is None:
        return {}
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _transfer(pair, kv, ids, sess, EncoderClient, DecoderClient):
    """Submit to the encoder while the decoder's FetchKV runs alongside."""
    request_id = f"demo-{time.time_ns()}"
    times: dict[str, float] = {}

    def fetch():
        with DecoderClient(pair.decoder_address, timeout=120) as dec:
            t0 = time.perf_counter()
            out = None
            for layer, arr, _ in dec.fetch_layers(request_id, wait=60):
                if out is None:
                    times["first"] = time.perf_counter() - t0
                    out = np.empty((int(kv.shape[0]),) + arr.shape, arr.dtype)
                out[layer] = arr
            times["total"] = time.perf_counter() - t0
            return out

    import numpy as np

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(fetch)
        with EncoderClient(pair.encoder_address, timeout=120) as enc:
            model = sess.predictor.checkpoint.manifest["target"]["name"]
            res = enc.submit(request_id, kv, ids, pair.decoder_address, model)
        back = fut.result(timeout=120)
    return res, back, times
