"""Batched calls of the fused CUDA coder for benchmarks/gpu_check.py: prompts of other lengths in
one call each way (``CudaCoder.encode_batch`` / ``decode_batch``), and concurrent callers through
``QueuedCuda`` (a sidecar under load)."""

from __future__ import annotations

from typing import Any

import numpy as np
from gpu_common import Device, _streams, affine, levels, stream_digest, timed, typical

from speckv.coder.native import EncodedChunk
from speckv.coder.residual import ResidualModel

MIXED_TOKENS = (512, 1024, 2048, 3072)  # prompts of other lengths (30 layers each: 153 MB of BF16 KV)


def mixed_requests(dev: Device, model: ResidualModel, repeats: int, tokens: tuple[int, ...] = MIXED_TOKENS,
                   layers: int = 30, epl: int = 1024) -> dict:
    """Prompts of other lengths: coded one call per prompt, and all in one call each way
    (``encode_batch`` / ``decode_batch``: one launch a pass; the native coder has no batch, so there
    both columns are a call per prompt). GB/s of their raw KV; whether each prompt's streams in the
    batch equal its own call's, and every prompt decodes bit for bit."""
    L, (a, b) = levels(model, layers, None), affine(model, layers)
    counts = [min(2, layers - i) for i in range(0, layers, 2)]
    data = [typical(11 + i, L, t) for i, t in enumerate(tokens)]
    xs = [(d["x"], dev.put(d["x"]), dev.prepare_mu(dev.put(d["mu"]), a, b, None)) for d in data]
    outs = [dev.xp.empty(x.shape, x.dtype) for x, _, _ in xs]

    def enc_one() -> list:
        return [dev.encode(xd, m, L, counts, epl, model.tables) for _, xd, m in xs]

    alone = enc_one()

    def dec_one() -> list:
        return [dev.decode(m, L, counts, epl, _streams(p), model.tables, o)
                for (_, _, m), p, o in zip(xs, alone, outs, strict=True)]

    enc, dec = enc_one, dec_one
    if dev.name == "cuda":
        from speckv.coder.cuda import Request

        def enc() -> list:
            return dev.coder.encode_batch([Request(xd, m, L, counts) for _, xd, m in xs], epl, model.tables)

        def dec() -> list:
            reqs = [Request(o, m, L, counts) for (_, _, m), o in zip(xs, outs, strict=True)]
            return dev.coder.decode_batch(reqs, epl, [_streams(p) for p in alone], model.tables)

    same = all(stream_digest(p) == stream_digest(q) for p, q in zip(enc(), alone, strict=True))
    for o in outs:
        o.fill(0)
    errors = dec()
    correct = all(e is None for e in errors) and all(
        np.array_equal(dev.get(o), x) for (x, _, _), o in zip(xs, outs, strict=True))
    raw = sum(x.nbytes for x, _, _ in xs)
    gb_s = lambda fn: raw / timed(dev, fn, repeats) / 1e9  # noqa: E731
    return {"tokens": list(tokens), "layers": layers, "raw_mb": raw / 1e6, "encode_gb_s": gb_s(enc),
            "decode_gb_s": gb_s(dec), "one_call_a_prompt_encode_gb_s": gb_s(enc_one),
            "one_call_a_prompt_decode_gb_s": gb_s(dec_one), "same_streams_as_alone": same, "decode_correct": correct}


def queued_streaming(dev: Device, model: ResidualModel, repeats: int, callers: int = 8, layers: int = 2,
                     tokens: int = 2048) -> dict:
    """A sidecar under load: ``callers`` threads each encode, then decode, one streaming call (KV and
    mu on the host, as a codec hands them over) at the same moment, through ``QueuedCuda`` (their
    calls share launches) and one after another on the coder itself. GB/s of all their raw KV; the
    launches the queue ran; every call's streams equal the coder's own and decode bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    from speckv.coder.cuda_queue import QueuedCuda

    L, (a, b) = levels(model, layers, None), affine(model, layers)
    data = [typical(21 + i, L, tokens) for i in range(callers)]
    mus = [dev.coder.prepare_mu(d["mu"], a, b, None) for d in data]
    q, counts, outs = QueuedCuda(dev.coder), [layers], [np.empty_like(d["x"]) for d in data]
    own = [dev.coder.encode(d["x"], m, L, counts, 1024, model.tables) for d, m in zip(data, mus, strict=True)]

    def both(coder: Any, i: int) -> list[EncodedChunk]:
        parts = coder.encode(data[i]["x"], mus[i], L, counts, 1024, model.tables)
        coder.decode(mus[i], L, counts, 1024, _streams(parts), model.tables, outs[i])
        return parts

    with ThreadPoolExecutor(callers) as pool:
        def queued() -> list:
            return list(pool.map(lambda i: both(q, i), range(callers)))

        same = all(stream_digest(p) == stream_digest(o) for p, o in zip(queued(), own, strict=True))
        correct = all(np.array_equal(o, d["x"]) for o, d in zip(outs, data, strict=True))
        launches0 = q.launches
        t_queued = timed(dev, queued, repeats)
    t_serial = timed(dev, lambda: [both(dev.coder, i) for i in range(callers)], repeats)
    raw = sum(d["x"].nbytes for d in data)
    return {"callers": callers, "raw_mb": raw / 1e6, "queued_gb_s": raw / t_queued / 1e9,
            "serial_gb_s": raw / t_serial / 1e9, "calls_a_launch": q.calls / max(q.launches, 1),
            "launches_first_round": launches0, "same_streams": same, "decode_correct": correct}
