"""Fixtures shared by the codec tests: the shipped checkpoint and cached codecs."""

from __future__ import annotations

import pytest

from speckv.coder.codec import Codec, CodecConfig
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.store import default_checkpoint_dir


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(default_checkpoint_dir())


@pytest.fixture(scope="module")
def make_codec(ckpt):
    """``make_codec(elems_per_lane, layers_per_chunk, threads=2, pin=None, coder="cpu")``, one
    Codec per configuration (a Codec keeps no per-stream state)."""
    cache: dict[tuple, Codec] = {}

    def make(epl: int = 1024, lpc: int = 2, threads: int = 2, pin: str | None = None,
             coder: str = "cpu") -> Codec:
        key = (epl, lpc, threads, pin, coder)
        if key not in cache:
            cfg = CodecConfig(elems_per_lane=epl, layers_per_chunk=lpc, threads=threads, coder=coder)
            # NOTE: BF16 context tables are cached per process by sigma digest (codec.py)
            cache[key] = Codec.from_checkpoint(ckpt, cfg, pin=pin)
        return cache[key]

    return make
