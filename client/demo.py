"""``speckv demo``: the main job, end to end, on the embedded model.

Loads the embedded target and the default pinned predictor, prefills a
built-in prompt with both, encodes the target's KV under the predictor,
decodes it, verifies it bit for bit, and reports raw vs coded bytes.
"""

from __future__ import annotations

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


def run_demo(target: str | Path = "default", predictor: str | Path | None = None,
             pin: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """Prefill, encode, decode, verify bit for bit; returns the summary."""
    import time

    import numpy as np

    from speckv.coder.codec import Codec, bf16_bits
    from speckv.coder.session import Session

    from .progress import steps

    with steps(5, quiet=quiet) as step:
        step("loading target and predictor (first run converts the GGUF)")
        sess = Session.open(target, predictor, pin)
        step("prefill: target KV and predictor mu")
        pre = sess.prefill(sess.target.tokenize(DEMO_PROMPT))
        codec = Codec.from_predictor(sess.predictor)
        step("encoding the KV under the predictor")
        t0 = time.perf_counter()
        records = list(codec.encode(pre.kv, pre.ids, pre.mu))
        t1 = time.perf_counter()
        step("decoding and verifying bit for bit")
        back = codec.decode(records, pre.ids, pre.mu)
        t2 = time.perf_counter()
        lossless = bool(np.array_equal(back, bf16_bits(pre.kv)))
        step("ideal code length")
        ideal = sess.entropy(pre, "bf16")
    coded = sum(len(r) for r in records)
    n = int(pre.kv.numel())
    return {"lossless": lossless, "tokens": int(len(pre.ids)), "raw_bytes": 2 * n, "coded_bytes": coded,
            "ratio": 2 * n / coded, "bits_per_scalar": 8 * coded / n,
            "ideal_bits_per_scalar": ideal["bits_per_scalar"],
            "order0_bits_per_scalar": ideal["order0_bits_per_scalar"], "chunks": len(records) - 1,
            "encode_s": round(t1 - t0, 4), "decode_s": round(t2 - t1, 4),
            "target_s": round(pre.target_s, 3), "predictor_s": round(pre.predictor_s, 3), "pin": sess.pin}
