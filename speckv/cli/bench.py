"""``speckv bench``: coder figures on a real KV cache, against peers, in one run.

Lifecycle: load the target and the pinned predictor, prefill the text once,
then time speckv's encode and decode (coder alone, mu given, one process),
verify the round trip bit for bit, and push the same raw KV bytes through the
peers (zstd 3 and 19, lz4, byte-split + zstd as ZipNN does, and the order-0
entropy bound). All throughputs are raw KV bytes per second. Last (unless
``--no-memory``), child processes do each sidecar's work on this transfer
(``speckv.server.memprobe``) and report their peak RSS (``sidecar_memory``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

DEFAULT_TEXT = Path("../shared/corpus/tinyshakespeare.txt")
REPEATS = 2  # best of this many timed runs


def best_time(fn: Callable[[], Any], repeats: int = REPEATS) -> tuple[float, Any]:
    """(fastest wall time, last result) over ``repeats`` calls.

    NOTE: each call's result is released before the next call, as a caller that hands it on
    would: holding it doubles the footprint and, for a decode (a fresh 47 MB KV), changes how
    the kernel backs the next output (huge or small pages), which moved decode times by up
    to 2x on this VM."""
    best, out = float("inf"), None
    for _ in range(repeats):
        out = None
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _peer(name: str, raw: bytes, enc: Callable[[bytes], Any], dec: Callable[[Any], bytes],
          size: Callable[[Any], int] = len, repeats: int = REPEATS) -> dict[str, Any]:
    te, blob = best_time(lambda: enc(raw), repeats)
    td, back = best_time(lambda: dec(blob), repeats)
    if back != raw:
        raise AssertionError(f"peer {name} did not round-trip")
    mb = len(raw) / 1e6
    return {"name": name, "ratio": len(raw) / size(blob), "encode_mb_s": mb / te, "decode_mb_s": mb / td}


def peers(raw: bytes, symbol_bytes: int, order0_bits: float) -> list[dict[str, Any]]:
    """Generic compressors on the same raw bytes (those installed), plus the order-0 bound."""
    out: list[dict[str, Any]] = []
    try:
        import zstandard as zstd

        for level in (3, 19):
            c, d = zstd.ZstdCompressor(level=level), zstd.ZstdDecompressor()
            out.append(_peer(f"zstd-{level}", raw, c.compress, d.decompress, repeats=1 if level > 9 else REPEATS))
        if symbol_bytes == 2:
            out.append(_byte_split_peer(raw, zstd))
    except ImportError:
        out.append({"name": "zstd", "error": "zstandard not installed"})
    try:
        import lz4.frame as lz4f

        out.append(_peer("lz4", raw, lz4f.compress, lz4f.decompress))
    except ImportError:
        out.append({"name": "lz4", "error": "lz4 not installed"})
    out.append({"name": "order0-bound", "ratio": 8 * symbol_bytes / max(order0_bits, 1e-9),
                "bits_per_scalar": order0_bits, "encode_mb_s": None, "decode_mb_s": None})
    return out


def _byte_split_peer(raw: bytes, zstd: Any) -> dict[str, Any]:
    """High and low bytes of each 16-bit symbol compressed apart (ZipNN's byte grouping)."""
    c, d = zstd.ZstdCompressor(level=3), zstd.ZstdDecompressor()

    def enc(b: bytes) -> tuple[bytes, bytes]:
        a = np.frombuffer(b, np.uint8).reshape(-1, 2)
        return c.compress(a[:, 1].tobytes()), c.compress(a[:, 0].tobytes())

    def dec(blobs: tuple[bytes, bytes]) -> bytes:
        hi, lo = (np.frombuffer(d.decompress(x), np.uint8) for x in blobs)
        return np.stack([lo, hi], axis=1).tobytes()

    return _peer("byte-split+zstd-3", raw, enc, dec, size=lambda t: len(t[0]) + len(t[1]))


def load_text(path: str | None) -> tuple[str, str]:
    """(text, its name): the given file, the default corpus if present, else the built-in text."""
    from speckv.predictor.calibrate import read_text

    from .demo import DEMO_PROMPT

    if path:
        return read_text(path), str(path)
    if DEFAULT_TEXT.is_file():
        return read_text(DEFAULT_TEXT), str(DEFAULT_TEXT)
    return (DEMO_PROMPT + "\n") * 64, "built-in demo text (repeated)"


def run_bench(text_path: str | None = None, tokens: int = 2048, dtype: str = "bf16",
              target: str = "default", predictor: str | None = None, pin: str | None = None,
              quiet: bool = False, coder: str = "auto", model: str = "auto",
              timing_runs: int = 3, threads: int | None = None, engine: str = "sdpa",
              fp8_toward_zero: bool = False, memory: bool = True) -> dict[str, Any]:
    from speckv.coder.backends import backend_name
    from speckv.coder.codec import Codec, CodecConfig, Fp8KV, bf16_bits
    from speckv.predictor.engines import engine_kv, fp8_cache_attention, fp8_cache_codes, fp8_cache_kv
    from speckv.predictor.fp8 import kv_to_fp8
    from speckv.predictor.session import Session

    from .progress import steps
    from .sidecar_memory import sidecar_memory
    from .wait_policy import policy

    with steps(6 if memory else 5, quiet=quiet) as step:
        step("loading target and predictor")
        sess = Session.open(target, predictor, pin)
        text, name = load_text(text_path)
        ids = sess.target.tokenize(text, tokens)
        step(f"prefill of {len(ids)} tokens, target (own process) and predictor timed alternately x{timing_runs}")
        fp8_copy = None if sess.predictor.checkpoint.rung.name == "fp8" else fp8_copy_forward(sess.target)
        pre, target_s, predictor_s, fp8_s, target_policy = timed_prefill(sess, ids, timing_runs, fp8_copy, str(target))
        cfg = CodecConfig(coder=coder, model=model, **({"threads": threads} if threads else {}))
        codec = Codec.from_predictor(sess.predictor, cfg)
        # NOTE: fp8cache's static scales come from the sidecars' own KV, already computed
        fa = fp8_cache_attention(pre.kv) if engine == "fp8cache" else None
        other = engine_kv(sess.target, ids, engine) if fa is None else fp8_cache_kv(sess.target, ids, fa)
        if other is not None:  # the KV the encoder codes comes from that engine; mu stays the sidecar's
            pre.kv = other
        if dtype == "fp8" and fa is not None:  # the engine's codes at its static scales, not re-quantised
            kv = fp8_cache_codes(pre.kv, fa)
            raw = kv.codes.tobytes()
        elif dtype == "fp8":
            q, scale = kv_to_fp8(pre.kv, toward_zero=fp8_toward_zero)
            kv, raw = Fp8KV(q.numpy(), scale.numpy()), q.numpy().tobytes()
        else:
            kv = pre.kv
            raw = bf16_bits(pre.kv).tobytes()
        step("speckv encode")
        te, records = best_time(lambda: list(codec.encode(kv, ids, pre.mu)))
        step("speckv decode + verify")
        td, back = best_time(lambda: codec.decode(records, ids, pre.mu))
        lossless = _equal(back, kv)
        digest_s = digest_time(raw, bf16_bits(pre.mu).tobytes())
        step("ideal code length and peers")
        ideal = sess.entropy(pre, dtype)
        peer_rows = peers(raw, 2 if dtype == "bf16" else 1, ideal["order0_bits_per_scalar"])
        if memory:
            step("each sidecar's peak memory, in child processes")
            mem = sidecar_memory(ids, kv, records, back, codec, pre.mu, predictor, pin, target, _equal)
    coded = sum(len(r) for r in records)
    n = int(pre.kv.numel())
    mb = len(raw) / 1e6
    return {"dtype": dtype, "engine": engine, "text": name,
            "fp8_rounding": ("toward zero" if fp8_toward_zero else "nearest") if dtype == "fp8" else None,
            "tokens": int(len(ids)), "scalars": n,
            "raw_bytes": len(raw), "coded_bytes": coded, "bits_per_scalar": 8 * coded / max(n, 1),
            # NOTE: the seed model's ideal code length (static sigma, the published mixture, mu as
            # predicted); the tuned model the codec uses by default can code below it
            "ideal_bits_per_scalar": ideal["bits_per_scalar"], "ideal_model": "seed", "ratio": len(raw) / coded,
            "lossless": lossless, "encode_mb_s": mb / te, "decode_mb_s": mb / td,
            "predictor_s": predictor_s, "target_s": target_s, "timing_runs": timing_runs,
            "predictor_cost": predictor_s / max(target_s, 1e-12), "model": _model_name(codec.model_id),
            # the OpenMP wait policy each ran under: the predictor as in a sidecar, the target as in an
            # engine (its own process); wait_policy.py
            "predictor_policy": policy(), "target_policy": target_policy,
            "fp8_copy_cost": (fp8_s if fp8_s is not None else predictor_s) / max(target_s, 1e-12),
            "rung": sess.predictor.checkpoint.rung.name, "pin": sess.pin, "peers": peer_rows,
            "coder": backend_name(codec.backend), "threads": codec.config.threads,
            "simd": getattr(codec.backend, "simd", "none"),
            # where the time goes: the format's two digests (raw KV, mu) that every encode
            # and every decode computes, on one thread, against the whole encode / decode
            "digest_s": digest_s, "encode_s": te, "decode_s": td,
            "vs_zstd3": _vs(mb / te, mb / td, peer_rows), "memory": mem if memory else None}


def digest_time(raw: bytes, mu: bytes) -> float:
    """Seconds to digest the raw KV and mu once (one thread) with the digest of the streams the
    codec writes (coder/FORMAT.md: xxh3-128 from version 3): a floor of both sides."""
    from speckv.coder import container as ct
    from speckv.digests import algorithm_of, digest

    algorithm = algorithm_of(ct.FORMAT_VERSION)
    t0 = time.perf_counter()
    for b in (raw, mu):
        digest(b, algorithm=algorithm)
    return time.perf_counter() - t0


def _vs(enc: float, dec: float, peer_rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """speckv's throughputs as fractions of zstd-3's, measured in the same run."""
    z = next((p for p in peer_rows if p["name"] == "zstd-3" and "error" not in p), None)
    return None if z is None else {"encode": enc / z["encode_mb_s"], "decode": dec / z["decode_mb_s"]}


def timed_prefill(sess: Any, ids: np.ndarray, runs: int, fp8_copy: Callable[[np.ndarray], Any] | None,
                  target: str) -> tuple[Any, float, float, float | None, str]:
    """The prefill, the median seconds of the target, the predictor and (if given) the FP8 copy
    over ``runs`` alternating timings (alternating, so a busy machine slows them alike), and the
    target's wait policy; every run's mu must agree. The target's prefill is timed in a child
    process under the engine's wait policy (``wait_policy.TargetTimer``), the rest in this one."""
    from speckv.coder.codec import bf16_bits

    from .wait_policy import agreed_timer

    pre = sess.prefill(ids)
    target_s, predictor_s, fp8_s = [], [], []
    timer, pre.kv = agreed_timer(target, ids, pre.kv, lambda: sess.target.kv(ids))
    with timer:
        for _ in range(runs):
            if fp8_copy is not None:
                t0 = time.perf_counter()
                fp8_copy(ids)
                fp8_s.append(time.perf_counter() - t0)
            target_s.append(timer.time())
            t0 = time.perf_counter()
            mu = sess.predictor.mu(ids)
            predictor_s.append(time.perf_counter() - t0)
            if not np.array_equal(bf16_bits(mu), bf16_bits(pre.mu)):
                raise RuntimeError("the predictor's mu differs between two runs (not deterministic)")
    med = float(np.median(fp8_s)) if fp8_s else None
    return pre, float(np.median(target_s)), float(np.median(predictor_s)), med, timer.policy


def fp8_copy_forward(target: Any) -> Callable[[np.ndarray], Any]:
    """A prefill of the target's plain FP8 copy (rung fp8), to time it next to a rung."""
    from speckv.predictor.checkpoint import fp8_state
    from speckv.predictor.predict import build_model
    from speckv.predictor.target import extract_kv

    model = build_model(type(target.config).from_dict(target.config.to_dict()), fp8_state(target.state))
    return lambda ids: extract_kv(model, ids)


def _model_name(model_id: int) -> str:
    from speckv.coder.residual import MODEL_NAMES

    return {v: k for k, v in MODEL_NAMES.items()}[model_id]


def _equal(back: Any, kv: Any) -> bool:
    from speckv.coder.codec import Fp8KV, bf16_bits

    if isinstance(kv, Fp8KV):
        return (np.array_equal(back.codes, kv.codes) and
                back.scales.view(np.uint32).tolist() == kv.scales.view(np.uint32).tolist())
    return bool(np.array_equal(back, bf16_bits(kv)))


def print_report(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"speckv bench: {r['tokens']} tokens of {r['text']}, {r['dtype']}, "
                    f"lossless={r['lossless']}")
    for col in ("coder", "bits/scalar", "ratio", "encode MB/s", "decode MB/s"):
        t.add_column(col, justify="right")
    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    bits = 8 * (2 if r["dtype"] == "bf16" else 1)
    t.add_row(f"speckv ({r['coder']}, {r['threads']} threads)", fmt(r["bits_per_scalar"]), fmt(r["ratio"]),
              fmt(r["encode_mb_s"]), fmt(r["decode_mb_s"]))
    t.add_row("seed-model ideal", fmt(r["ideal_bits_per_scalar"]), fmt(bits / r["ideal_bits_per_scalar"]), "-", "-")
    for p in r["peers"]:
        if "error" in p:
            t.add_row(p["name"], p["error"], "", "", "")
            continue
        t.add_row(p["name"], fmt(bits / p["ratio"]), fmt(p["ratio"]), fmt(p["encode_mb_s"]), fmt(p["decode_mb_s"]))
    Console().print(t)
    if r.get("vs_zstd3"):
        Console().print(f"speckv at {r['vs_zstd3']['encode']:.2f}x / {r['vs_zstd3']['decode']:.2f}x zstd-3's encode / "
                        f"decode speed; of its {r['encode_s']:.3f} s encode and {r['decode_s']:.3f} s decode, the "
                        f"format's digests (xxh3-128) take {r['digest_s']:.3f} s on one thread")
    if (m := r.get("memory")) is not None:
        for role in ("decoder", "encoder"):
            Console().print(f"{role} sidecar peak RSS {m[role + '_peak_mib']:.0f} MiB = "
                            f"{fmt(m[role + '_peak_x_weights'])} x the target's BF16 weights "
                            f"({m['target_bf16_mib']:.0f} MiB), {fmt(m[role + '_above_floor_x_weights'])} x above "
                            f"the runtime floor ({m['runtime_floor_mib']:.0f} MiB: torch, transformers, grpc "
                            f"imported); loaded {m[role + '_loaded_peak_mib']:.0f} MiB; its bytes lossless")
    Console().print(f"model {r['model']}; predictor ({r['rung']}) {r['predictor_s']:.2f} s = "
                    f"{r['predictor_cost']:.2f} x the target prefill {r['target_s']:.2f} s "
                    f"(medians of {r['timing_runs']}), pin {r['pin'][:16]}")
