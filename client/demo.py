"""``speckv demo``: the main job, end to end, on the embedded model.

Loads the embedded target and the default pinned predictor, prefills a
built-in prompt with both, and reports the ideal code length of its KV under
the predictor next to the raw BF16 size.
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
    from speckv.coder.session import Session

    from .progress import steps

    with steps(3, quiet=quiet) as step:
        step("loading target and predictor (first run converts the GGUF)")
        sess = Session.open(target, predictor, pin)
        step("prefill: target KV and predictor mu")
        pre = sess.prefill(sess.target.tokenize(DEMO_PROMPT))
        step("ideal code length under the predictor")
        rep = sess.entropy(pre, "bf16")
    raw_bytes = pre.kv.numel() * 2
    return {"tokens": rep["tokens"], "raw_bytes": raw_bytes,
            "ideal_bytes": int(rep["bits_per_scalar"] * pre.kv.numel() / 8),
            "bits_per_scalar": rep["bits_per_scalar"],
            "order0_bits_per_scalar": rep["order0_bits_per_scalar"], "pin": rep["pin"],
            "target_s": rep["target_s"], "predictor_s": rep["predictor_s"]}
