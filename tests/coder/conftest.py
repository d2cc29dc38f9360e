"""Fixtures shared by the codec tests: the shipped checkpoint and cached codecs."""

from __future__ import annotations

import pytest

from speckv.coder.codec import Codec, CodecConfig
from speckv.coder.predictor import default_checkpoint_dir, load_checkpoint


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(default_checkpoint_dir())


@pytest.fixture(scope="module")
def make_codec(ckpt):
    """``make_codec(elems_per_lane, layers_per_chunk, threads=2, pin=None, coder="cpu")``, one
    Codec per configuration (a Codec keeps no per-stream state)."""
    cache: dict[tuple, Codec] = {}
    shared: dict[str, object] = {}

    def make(epl: int = 1024, lpc: int = 2, threads: int = 2, pin: str | None = None,
             coder: str = "cpu") -> Codec:
        key = (epl, lpc, threads, pin, coder)
        if key not in cache:
            cfg = CodecConfig(elems_per_lane=epl, layers_per_chunk=lpc, threads=threads, coder=coder)
            codec = Codec(ckpt.tables, ckpt.calib.sigma_log2_q, pin or ckpt.pin, config=cfg)
            # NOTE: the codec's lazily built BF16 context table depends only on the
            # checkpoint's sigma; build it once for the module, not once per config
            if hasattr(codec, "_bf16_contexts") and hasattr(type(codec), "bf16_contexts"):
                if "bf16" not in shared:
                    shared["bf16"] = codec.bf16_contexts
                codec._bf16_contexts = shared["bf16"]
            cache[key] = codec
        return cache[key]

    return make
