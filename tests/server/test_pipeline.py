"""Pipelining, end to end: while the prefill engine is still submitting later
layers, the decode engine already holds the first ones (encoder codes and
sends chunk 0 as soon as its layers are in; the decoder decodes and serves it
while later chunks are in flight)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from speckv.client.client import DecoderClient, submit_requests
from speckv.client.core import CHANNEL_OPTIONS
from speckv.coder.codec import bf16_bits
from speckv.v1 import encoder_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"
LAYER_GAP_S = 0.1  # the engine produces one layer every 100 ms


def test_first_layer_reaches_the_engine_before_the_last_is_submitted(embedded_session):
    from speckv.server.local import LocalPair

    ids = embedded_session.target.tokenize("Layer by layer, the cache crosses while prefill still runs.")
    kv = embedded_session.target.kv(ids)
    want = bf16_bits(kv)
    events: dict[str, float] = {}
    got: dict[int, np.ndarray] = {}

    def slow_requests():
        for req in submit_requests("pipe-1", kv, ids, pair.decoder_address, MODEL):
            if req.WhichOneof("kind") == "layer" and req.layer.layer > 0 and req.layer.part_index == 0:
                time.sleep(LAYER_GAP_S)
            yield req
        events["last_layer_submitted"] = time.monotonic()

    def fetch():
        with DecoderClient(pair.decoder_address, timeout=60) as dec:
            for layer, arr, _ in dec.fetch_layers("pipe-1", wait=30):
                events.setdefault("first_layer_fetched", time.monotonic())
                got[layer] = arr

    with LocalPair(embedded_session.predictor, metrics=False) as pair:
        channel = grpc.insecure_channel(pair.encoder_address, options=CHANNEL_OPTIONS)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(fetch)
            res = encoder_pb2_grpc.EncoderServiceStub(channel).Submit(slow_requests(), timeout=60)
            fut.result(timeout=60)
        channel.close()
    assert res.raw_bytes == want.nbytes
    assert sorted(got) == list(range(want.shape[0]))
    assert all(np.array_equal(got[k], want[k]) for k in got)
    # 29 gaps of 100 ms: ~2.9 s of submitting; the first layer must arrive well inside it
    assert events["first_layer_fetched"] < events["last_layer_submitted"] - 8 * LAYER_GAP_S, events
