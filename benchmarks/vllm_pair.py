"""A real vLLM prefill/decode pair through speckv's sidecars, against a single vLLM
instance.

Processes, all real: an encoder and a decoder sidecar (``speckv serve``, this
environment), and vLLM engines (CPU backend, the embedded SmolLM2 from local files) in
vLLM's own environment (``--vllm-python``; ``make test-vllm`` builds it): a single
instance, a kv_producer and a kv_consumer running ``speckv.client.vllm.SpeckvConnector``,
two emulated nodes of one core each: the producer and the encoder sidecar on core 0, the
consumer and the decoder sidecar on core 1 (the single instance also runs on core 1).

    python benchmarks/vllm_pair.py --vllm-python .venv-vllm/bin/python [--ttft] [--json F]

Checks: greedy tokens through the pair equal the single instance's token for token;
every transfer was received and verified by the consumer's connector; the encoder
sidecar's raw and wire byte counters. ``--ttft``: time to first token (a prefill on the
producer, then the decode request's first token on the consumer) and the time per
further token, against the single instance, on the same prompts; ``--baseline`` also
through vLLM's own ExampleConnector (raw KV through a shared local folder, no sidecars).
On this machine a node is one core, which its engine shares with its sidecar's predictor.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load import Sidecar  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "benchmarks" / "vllm_engine.py"
CORPUS = ROOT.parent / "shared" / "corpus" / "tinyshakespeare.txt"
MODEL_ID = "SmolLM2-135M-Instruct"
READY_S = 600.0  # an engine loads in ~25 s alone; three at once on 2 cores take longer
JOB_S = 300.0
PREFILL_CORE, DECODE_CORE = 0, 1  # one core per emulated node
LOST_WAIT_S = 2.0  # the consumer's fetch wait: a transfer never started is given up on after this
PROMPT_CHARS = (200, 1200, 2600)  # ~60, ~350, ~880 tokens: one, three and seven blocks of 128


class Engine:
    """One vllm_engine.py process: READY, then one RESULT per job written to its stdin."""

    def __init__(self, python: str, role: str, model: str, extra: dict[str, Any], core: int, logdir: Path,
                 engine_args: dict[str, Any] | None = None) -> None:
        self.role = role
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.logpath = logdir / f"vllm-{role}.log"
        self.log = open(self.logpath, "w")
        argv = ["taskset", "-c", str(core), python, str(ENGINE), role, model, json.dumps(extra),
                json.dumps(engine_args or {})]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # NOTE: the engine's protocol lines only (its logs go to self.log)
            self.lines.put(line.strip())
        self.lines.put(None)

    def _next(self, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if line is None:
            raise RuntimeError(f"vLLM {self.role} engine gave no answer (exit {self.proc.poll()}); "
                               f"log {self.logpath}:\n{self.tail()}")
        return line

    def ready(self) -> float:
        return float(self._next(READY_S).split()[1])

    def run(self, prompts: list[str], params: list[Any], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        t0 = time.monotonic()
        self.proc.stdin.write(json.dumps({"prompts": prompts, "params": params, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        out: dict[str, Any] = json.loads(self._next(JOB_S)[len("RESULT "):])
        out["wall_s"] = time.monotonic() - t0
        return out

    def tail(self, n: int = 3000) -> str:
        return self.logpath.read_text(errors="replace")[-n:]

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.logpath.read_text(errors="replace")))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


def prompts_from(path: Path) -> list[str]:
    text = path.read_text()
    return [text[k * 5000:k * 5000 + n] for k, n in enumerate(PROMPT_CHARS)]


def pair_run(producer: Engine, consumer: Engine, prompts: list[str], max_tokens: int,
             decoder: str | None) -> tuple[list[list[int]], float, float, dict[str, Any]]:
    """Prefill on the producer, then decode on the consumer with its kv_transfer_params;
    (tokens, producer seconds, consumer seconds, both engines' connector metrics). ``decoder``
    None: vLLM's ExampleConnector pair, which matches requests by their prompt in a shared
    folder, without params."""
    run = uuid.uuid4().hex[:8]
    params = [None if decoder is None else
              {"do_remote_decode": True, "speckv_decoder_address": decoder, "speckv_transfer_id": f"{run}-{i}"}
              for i in range(len(prompts))]
    p = producer.run(prompts, params, 1)
    handoff = p["kv_transfer_params"] if decoder is not None else params
    if decoder is not None and any(h is None or not h.get("do_remote_prefill") for h in handoff):
        raise RuntimeError(f"the producer did not hand every request off: {handoff}")
    c = consumer.run(prompts, handoff, max_tokens)
    metrics = {"producer": p.get("connector_metrics"), "consumer": c.get("connector_metrics")}
    return c["tokens"], p["wall_s"], c["wall_s"], metrics


def lost_transfer(consumer: Engine, prompt: str, expected: list[int], max_tokens: int) -> dict[str, Any]:
    """A decode request naming a transfer its decoder sidecar never heard of: the fetch
    fails (NOT_FOUND after the wait), the connector reports the request's blocks as load
    errors, and vLLM (kv_load_failure_policy: recompute) computes the prompt itself."""
    failed_before = consumer.count(r"speckv: fetch \S+ failed")
    params = {"do_remote_prefill": True, "speckv_transfer_id": f"never-sent-{uuid.uuid4().hex[:8]}"}
    c = consumer.run([prompt], [params], max_tokens)
    return {"tokens_equal": c["tokens"][0] == expected, "fetch_failed": consumer.count(r"speckv: fetch \S+ failed")
            - failed_before, "seconds": round(c["wall_s"], 3), "connector_metrics": c.get("connector_metrics")}


def start(args: argparse.Namespace, logdir: Path, model: str) -> tuple[Sidecar, Sidecar, dict[str, Engine]]:
    # NOTE: no mu cache: every measured prompt would otherwise hit it after the correctness run
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPECKV_")}, "SPECKV_MU_CACHE_BYTES": "0"}
    # NOTE: two emulated nodes: the prefill node (producer engine + encoder sidecar) on core 0, the
    # decode node (consumer engine + decoder sidecar) on core 1; the single instance runs on core 1
    # --local: each sidecar's local socket, given to its engine (speckv_local_socket): the KV goes to the
    # encoder and comes from the decoder as sealed memfds
    sock = {r: str(logdir / f"{r}.sock") for r in ("encoder", "decoder")} if args.local else {}
    dec = Sidecar("decoder", {**env, **({"SPECKV_LOCAL_SOCKET": sock["decoder"]} if sock else {})}, str(logdir),
                  cpus=str(DECODE_CORE))
    enc = Sidecar("encoder", {**env, **({"SPECKV_LOCAL_SOCKET": sock["encoder"]} if sock else {})}, str(logdir),
                  cpus=str(PREFILL_CORE))
    pcfg = {"speckv_encoder_address": enc.address, "speckv_decoder_service": dec.address, "speckv_model_id": MODEL_ID}
    ccfg = {"speckv_decoder_address": dec.address, "speckv_model_id": MODEL_ID, "speckv_fetch_wait_s": LOST_WAIT_S}
    if sock:
        pcfg["speckv_local_socket"], ccfg["speckv_local_socket"] = sock["encoder"], sock["decoder"]
    ea = engine_args(args)
    engines = {"single": Engine(args.vllm_python, "single", model, {}, DECODE_CORE, logdir, ea),
               "producer": Engine(args.vllm_python, "producer", model, pcfg, PREFILL_CORE, logdir, ea),
               "consumer": Engine(args.vllm_python, "consumer", model, ccfg, DECODE_CORE, logdir, ea)}
    return enc, dec, engines


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM engine arguments of every engine: ``--chunk`` tokens per step, so a long prompt's
    prefill spans several steps (chunked prefill) on the producer and the single instance alike."""
    out: dict[str, Any] = {"max_num_batched_tokens": args.chunk, "enable_chunked_prefill": True} if args.chunk else {}
    if args.kv_cache_dtype != "auto":
        out["kv_cache_dtype"] = args.kv_cache_dtype
    return out


def measure(args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    from speckv.predictor.target import _embedded_dir

    model = str(_embedded_dir())
    prompts = prompts_from(Path(args.text))
    itemsize = 1 if args.kv_cache_dtype.startswith("fp8") else 2
    enc, dec, engines = start(args, logdir, model)
    try:
        load_s = {r: e.ready() for r, e in engines.items()}
        # NOTE: one prompt at a time on every engine: vLLM's CPU kernels round differently with the
        # batch's shape, and the consumer's requests start decoding as their loads finish, so a
        # batched comparison would measure batch composition, not the transfer
        single = [engines["single"].run([p], [None], args.max_tokens) for p in prompts]
        pairs = [pair_run(engines["producer"], engines["consumer"], [p], args.max_tokens, dec.address) for p in prompts]
        n_tokens = [s["prompt_tokens"][0] for s in single]
        tokens, expected = [pr[0][0] for pr in pairs], [s["tokens"][0] for s in single]
        report: dict[str, Any] = {
            "prompt_tokens": n_tokens, "max_tokens": args.max_tokens, "load_s": load_s,
            "kv_cache_dtype": args.kv_cache_dtype, "kv_bytes": [30 * 2 * 3 * n * 64 * itemsize for n in n_tokens],
            "tokens_equal": tokens == expected, "single_tokens": expected, "pair_tokens": tokens,
            "received_verified": engines["consumer"].count(r"speckv: received \S+: tokens \[\d+, \d+\), verified"),
            "fetch_failed": engines["consumer"].count(r"speckv: fetch \S+ failed"),
            "submit_failed": engines["producer"].count(r"speckv: submit \S+ failed"),
            "single_s": round(sum(s["wall_s"] for s in single), 3),
            "pair_prefill_s": round(sum(pr[1] for pr in pairs), 3),
            "pair_decode_s": round(sum(pr[2] for pr in pairs), 3), "connector_metrics": pairs[-1][3]}
        report["encoder"], report["decoder"] = sidecar_counts(enc), sidecar_counts(dec)
        report["lost_transfer"] = lost_transfer(engines["consumer"], prompts[1], expected[1], args.max_tokens)
        if args.ttft:
            report["ttft"] = ttft(engines, prompts, dec.address, args.max_tokens)
    finally:
        for e in engines.values():
            e.stop()
        for s in (enc, dec):
            s.stop()
    if args.baseline:
        report["example_connector_ttft"] = baseline(args, logdir, model, prompts)
    return report


def baseline(args: argparse.Namespace, logdir: Path, model: str, prompts: list[str]) -> list[dict[str, Any]]:
    """The same timings through vLLM's own ExampleConnector (raw KV in a shared local folder)."""
    extra = {"shared_storage_path": tempfile.mkdtemp(prefix="example-kv-", dir=logdir)}
    ea = engine_args(args)
    engines = {"single": Engine(args.vllm_python, "single", model, {}, DECODE_CORE, logdir, ea),
               "producer": Engine(args.vllm_python, "example_producer", model, extra, PREFILL_CORE, logdir, ea),
               "consumer": Engine(args.vllm_python, "example_consumer", model, extra, DECODE_CORE, logdir, ea)}
    try:
        for e in engines.values():
            e.ready()
        return ttft(engines, prompts, None, args.max_tokens)
    finally:
        for e in engines.values():
            e.stop()


def sidecar_counts(enc: Sidecar) -> dict[str, Any]:
    """A sidecar's byte counters and outcomes from its /metrics (``local_bytes``: through its socket)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{enc.metrics_port}/metrics", timeout=5).read().decode()

    def total(name: str, **labels: str) -> float:
        out = 0.0
        for line in text.splitlines():
            m = re.match(rf"{name}(?:{{(.*)}})? (\S+)$", line)
            if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
                out += float(m.group(2))
        return out

    raw, wire = total("speckv_raw_bytes_total"), total("speckv_wire_bytes_total")
    return {"raw_bytes": int(raw), "wire_bytes": int(wire), "ratio": round(raw / wire, 4) if wire else None,
            "transfers_ok": int(total("speckv_transfers_total", outcome="ok")),
            "stored_chunks": {r: int(total("speckv_fallbacks_total", reason=r)) for r in ("mu_mismatch",
                                                                                            "larger_than_stored")},
            "mu_rechecks": {o: int(total("speckv_mu_rechecks_total", outcome=o))
                            for o in ("same", "recovered", "unstable", "error")},
            "local_bytes": int(total("speckv_local_bytes_total"))}


def ttft(engines: dict[str, Engine], prompts: list[str], decoder: str | None, n: int) -> list[dict[str, Any]]:
    """Per prompt: the single instance's first token and per-token time, and the pair's
    (prefill on the producer, then the consumer's load and first token). NOTE: each run
    gets its own first word, so no engine's prefix cache (nor the sidecars') serves it."""
    rows = []
    tag = iter(range(1 << 30))

    def fresh(p: str) -> list[str]:
        return [f"Scene {next(tag)}. {p}"]

    for p in prompts:
        r1 = engines["single"].run(fresh(p), [None], 1)
        sn = engines["single"].run(fresh(p), [None], n)["wall_s"]
        _, pre1, dec1, _ = pair_run(engines["producer"], engines["consumer"], fresh(p), 1, decoder)
        _, pren, decn, _ = pair_run(engines["producer"], engines["consumer"], fresh(p), n, decoder)
        s1 = r1["wall_s"]
        rows.append({"prompt_tokens": r1["prompt_tokens"][0], "single_ttft_s": round(s1, 3),
                     "pair_ttft_s": round(pre1 + dec1, 3), "pair_prefill_s": round(pre1, 3),
                     "pair_load_first_token_s": round(dec1, 3), "single_tpot_s": round((sn - s1) / (n - 1), 4),
                     "pair_tpot_s": round((decn - dec1) / (n - 1), 4)})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--text", default=str(CORPUS))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=0,
                    help="max_num_batched_tokens of every engine (0: vLLM's default); 256 prefills the longest "
                         "prompt in four steps")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                    help="every engine's KV cache: the model's BF16, or FP8 e4m3 codes with per-layer scales")
    ap.add_argument("--local", action="store_true", help="the engines hand the KV to the encoder and fetch it "
                    "from the decoder as sealed memfds over the sidecars' local sockets")
    ap.add_argument("--ttft", action="store_true", help="also time first tokens and per-token times")
    ap.add_argument("--baseline", action="store_true", help="--ttft also through vLLM's ExampleConnector")
    ap.add_argument("--json", default=None)
    ap.add_argument("--logdir", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="speckv-vllm-"))
    logdir.mkdir(parents=True, exist_ok=True)
    report = measure(args, logdir)
    report["logs"] = str(logdir)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["tokens_equal"] and report["fetch_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
