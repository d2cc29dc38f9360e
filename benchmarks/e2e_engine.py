"""The emulated engines of benchmarks/e2e.py, one process per node, driven by JSON
lines on stdin; each reply is one ``@@ {json}`` line on stdout. Times are
``time.monotonic()``, one clock for every process on the machine (network
namespaces do not change it), so the harness subtracts them across nodes.

``prefill`` (prefill node): loads the target, tokenizes the prompt, and checks once
that its hooked prefill gives the engine's KV bit for bit (``speckv.predictor.engines``:
target.kv(ids) for sdpa, engine_kv for the others, as ``speckv bench --engine`` codes it). A ``stream`` command runs
the prefill with a forward hook on every decoder layer: the header (with the prompt
ids) goes to the encoder sidecar when the prefill starts, each layer's K/V as its
layer finishes, while the forward pass goes on (the real engine's timing). A whole
command submits the precomputed KV at once (the loopback block). Either writes the
KV's hash (XXH3-128: any 128-bit hash of the bytes serves, this one costs the engines
least) to ``<dir>/<rid>.kvhash`` as soon as the prefill is done (a whole command: the
hash of the precomputed KV, taken before the clock starts).

``fetch`` (decode node): a ``fetch`` command pulls the layers with FetchKV, hashes
them as they come and compares with the prefill engine's hash (``lossless``); it
also reports the decoder sidecar's decode and predictor seconds (its /metrics,
before and after). A ``recompute`` command runs the hooked prefill here instead and
compares its hash the same way (no bytes moved).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import xxhash

from speckv import frames
from speckv.client.client import DecoderClient, EncoderClient
from speckv.client.core import ENCODINGS, submit_stub
from speckv.client.local import LocalHandoff, local_submit_requests
from speckv.kv import bf16_bits
from speckv.predictor.engines import STREAM_ENGINES, engine_kv, stream_model
from speckv.predictor.target import Target, extract_kv, load_target
from speckv.v1 import common_pb2 as pb
from speckv.v1 import encoder_pb2 as epb
from speckv.wire import PART_BYTES, kv_shape, layer_frames

TIMEOUT = 600.0


def reply(**kw: Any) -> None:
    print("@@ " + json.dumps(kw), flush=True)


def hooked_prefill(model: Any, ids: np.ndarray, on_layer: Callable[[int, np.ndarray], None]) -> np.ndarray:
    """One prefill of the engine's ``model``; ``on_layer(i, bits)`` gets layer i's ``(2, kv_heads,
    tokens, head_dim)`` BF16 bits as soon as that decoder layer has run (extract_kv's hooks)."""
    return bf16_bits(extract_kv(model, ids, on_layer))


def kv_hash(kv: np.ndarray) -> str:
    return xxhash.xxh3_128(np.ascontiguousarray(kv)).hexdigest()


def submit_stream(header: epb.SubmitHeader, n_layers: int, layers: "queue.Queue[np.ndarray]",
                  shape: pb.KVShape) -> Iterator["epb.SubmitRequest | bytes"]:
    """The SubmitRequest stream, fed layer by layer while the prefill runs (its layer parts
    pre-serialised, for ``submit_stub``). NOTE: EncoderClient.submit wants the whole KV; this
    is client/core.py's stream, streamed."""
    yield epb.SubmitRequest(header=header)
    for i in range(n_layers):
        bits = layers.get(timeout=TIMEOUT)
        for p in layer_frames(i, bits, pb.DTYPE_BF16, shape, PART_BYTES):
            yield frames.join(frames.submessage(2, p))  # NOTE: SubmitRequest.layer is field 2


def variant(ids: np.ndarray, v: int, vocab: int) -> np.ndarray:
    """Prompt variant ``v`` (0: the prompt itself): the first token shifted by ``v``, so every
    later position's KV (and mu) differs too and no sidecar's mu cache can hit; same length."""
    out = ids.copy()
    out[0] = (int(ids[0]) + v) % vocab
    return out


class Prefill:
    def __init__(self, args: argparse.Namespace, target: Target, model: Any, ids: np.ndarray) -> None:
        self.args, self.target, self.model, self.ids = args, target, model, ids
        self.enc = EncoderClient(args.encoder, timeout=TIMEOUT)
        self.handoff = LocalHandoff(args.local_socket) if args.local_socket else None
        self.submit = submit_stub(self.enc.channel)
        self.pool = ThreadPoolExecutor(1)
        self.kvs = {0: hooked_prefill(model, ids, lambda i, b: None)}  # by variant, for stream=False
        self.hashes = {0: kv_hash(self.kvs[0])}
        ref = engine_kv(target, ids, args.engine)  # None: sdpa, the sidecars' own
        self.matches = self.hashes[0] == kv_hash(bf16_bits(target.kv(ids) if ref is None else ref))

    def header(self, rid: str, encoding: str, shape: pb.KVShape, ids: np.ndarray) -> epb.SubmitHeader:
        return epb.SubmitHeader(request_id=rid, decoder_address=self.args.decoder, model_id=self.target.name,
                                dtype=pb.DTYPE_BF16, shape=shape, prompt_token_ids=[int(t) for t in ids],
                                encoding=ENCODINGS[encoding])

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        ids = variant(self.ids, cmd.get("variant", 0), self.target.config.vocab_size)
        if not cmd["stream"] and cmd.get("variant", 0) not in self.kvs:  # prefilled before the clock starts
            self.kvs[cmd["variant"]] = hooked_prefill(self.model, ids, lambda i, b: None)
            self.hashes[cmd["variant"]] = kv_hash(self.kvs[cmd["variant"]])
        layers: queue.Queue[np.ndarray] = queue.Queue()
        L = len(self.target.model.model.layers)
        cfg = self.target.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = kv_shape((L, 2, cfg.num_key_value_heads, len(ids), head_dim))
        reqs = submit_stream(self.header(cmd["rid"], cmd["encoding"], shape, ids), L, layers, shape)
        out: dict[str, Any] = {}
        t0 = time.monotonic()
        if cmd.get("local"):  # the whole prefilled KV as one sealed memfd (client/local.py), timed from here
            assert self.handoff is not None and not cmd["stream"], "local: --local-socket, stream=False"
            header = epb.SubmitRequest(header=self.header(cmd["rid"], cmd["encoding"], shape, ids))
            reqs = local_submit_requests(self.handoff, header, self.kvs[cmd.get("variant", 0)], None)
            layers.put(np.empty(0))  # NOTE: unused: the queue below is never read
        fut = self.pool.submit(lambda: (self.submit(reqs, timeout=TIMEOUT), time.monotonic()))  # header goes now
        if cmd.get("local"):
            kv = self.kvs[cmd.get("variant", 0)]
        elif cmd["stream"]:
            def put(i: int, bits: np.ndarray) -> None:
                out.setdefault("first_layer_out", time.monotonic())
                layers.put(bits)
            kv = hooked_prefill(self.model, ids, put)
        else:
            kv = self.kvs[cmd.get("variant", 0)]
            for layer in kv:
                layers.put(layer)
        out["prefill_s"] = time.monotonic() - t0
        write_atomic(cmd["expect"], kv_hash(kv) if cmd["stream"] else self.hashes[cmd.get("variant", 0)])
        r, end = fut.result(timeout=TIMEOUT)
        # NOTE: the header's arrival at the encoder, from t0, to within the reply's way back and this
        # thread's wake-up (a little late: ~RTT/2)
        arrival = end - r.total_seconds - t0
        timeline = [[arrival + x for x in (t.layers_in_seconds, t.ready_seconds, t.coded_seconds, t.written_seconds)]
                    + [t.wire_bytes] + [arrival + x for x in (t.mu_seconds, t.peer_mu_seconds)]
                    for t in r.chunk_timings]  # NOTE: e2e.paced_path's row layout
        return {**out, "t0": t0, "submit_end": end, "timeline": timeline, "raw_bytes": r.raw_bytes,
                "wire_bytes": r.wire_bytes, "chunks": r.chunks, "predictor_s": r.predictor_seconds,
                "encode_s": r.encode_seconds, "encoding": r.encoding, "fallback": r.fallback,
                "stored_chunks": r.stored_chunks, "mu_wait_s": r.mu_wait_seconds, "wire_wait_s": r.wire_wait_seconds}


def metrics(port: int) -> dict[str, float]:
    """The decoder sidecar's decode / predictor / mu-wait seconds so far (Prometheus text)."""
    if port <= 0:
        return {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    got: dict[str, float] = {}
    for line in text.splitlines():
        for stage in ("decode", "predictor", "mu_wait"):
            if line.startswith(f"speckv_{stage}_seconds_sum{{"):
                got[stage] = got.get(stage, 0.0) + float(line.rsplit(" ", 1)[1])
    return got


def write_atomic(path: str, text: str) -> None:
    """NOTE: the fetch engine reads the file as soon as it exists (wait_expect): a plain write_text
    could be read empty or half-written (it once failed a 1 Gb/s stored row), so rename it in."""
    tmp = Path(path + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_expect(path: str) -> str:
    deadline = time.monotonic() + TIMEOUT
    while not Path(path).exists():  # NOTE: written right after the prefill, long before the last layer lands
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.005)
    return Path(path).read_text().strip()


class Fetch:
    def __init__(self, args: argparse.Namespace, target: Target, model: Any, ids: np.ndarray) -> None:
        self.args, self.target, self.model, self.ids = args, target, model, ids
        self.dec = DecoderClient(args.decoder, timeout=TIMEOUT)
        # cmd "local": the layers as one sealed memfd over the decoder's local socket (client/local.py)
        self.local = DecoderClient(args.decoder, timeout=TIMEOUT, local_socket=args.local_socket) \
            if args.local_socket else None

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return self.recompute(cmd) if cmd["op"] == "recompute" else self.fetch(cmd)

    def fetch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        before = metrics(self.args.metrics_port)
        h, n = xxhash.xxh3_128(), 0
        out: dict[str, float] = {}
        reply(ack=True)  # NOTE: the harness starts the prefill only after this line
        dec = self.dec
        if cmd.get("local"):
            assert self.local is not None, "local: --local-socket"
            dec = self.local
        for layer, arr, _ in dec.fetch_layers(cmd["rid"], wait=TIMEOUT):
            out.setdefault("first", time.monotonic())
            if layer != n:
                raise RuntimeError(f"layer {layer} arrived as the {n}th")
            h.update(np.ascontiguousarray(arr))
            n += 1
        ok = h.hexdigest() == wait_expect(cmd["expect"])
        done = time.monotonic()
        after = metrics(self.args.metrics_port)
        stages = {f"decoder_{k}_s": after[k] - before.get(k, 0.0) for k in after}
        return {**out, "done": done, "lossless": ok, "layers": n, **stages}

    def recompute(self, cmd: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        t0 = time.monotonic()
        ids = variant(self.ids, cmd.get("variant", 0), self.target.config.vocab_size)
        kv = hooked_prefill(self.model, ids, lambda i, b: out.setdefault("first", time.monotonic()))
        prefill_s = time.monotonic() - t0
        ok = kv_hash(kv) == wait_expect(cmd["expect"])
        return {**out, "t0": t0, "done": time.monotonic(), "lossless": ok, "prefill_s": prefill_s}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=("prefill", "fetch"))
    ap.add_argument("--encoder", default="")
    ap.add_argument("--decoder", required=True)
    ap.add_argument("--metrics-port", type=int, default=-1)
    ap.add_argument("--local-socket", default="", help="the local socket of this node's sidecar: the encoder's "
                    "hand-off (prefill), the decoder's local fetch (fetch)")
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--engine", choices=STREAM_ENGINES, default="sdpa", help="the engine computing the KV")
    args = ap.parse_args(argv)
    from speckv.predictor.calibrate import read_text

    target = load_target()
    model = stream_model(target, args.engine)
    ids = target.tokenize(read_text(args.text, chars=args.tokens * 32), args.tokens)
    role = Prefill if args.role == "prefill" else Fetch
    engine: Prefill | Fetch = role(args, target, model, ids)
    reply(ready=True, tokens=int(len(ids)), hook_matches_target_kv=getattr(engine, "matches", None))
    for line in sys.stdin:
        try:
            reply(**engine.run(json.loads(line)))
        except Exception as e:  # noqa: BLE001 -- the harness gets every failure as a reply
            reply(error=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
