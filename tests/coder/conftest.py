"""Fixtures shared by the codec tests: the shipped checkpoint and cached codecs.

Every test that builds its codecs with ``make_codec`` runs once per CPU coder
(``coder``: the numpy reference, then the native extension), so the golden
streams, round trips, property tests and corrupt-stream rejections all hold for
both; a missing extension skips the native half (fails in CI:
SPECKV_REQUIRE_NATIVE)."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_emu import emulated_cupy
from require import missing

from speckv.coder import backends, native
from speckv.coder.codec import Codec, CodecConfig
from speckv.coder.cuda import CudaCoder
from speckv.coder.cuda_tuning import Tuning
from speckv.predictor.checkpoint import load_checkpoint
from speckv.predictor.store import default_checkpoint_dir


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(default_checkpoint_dir())


@pytest.fixture(scope="module", params=["numpy", "native"])
def coder(request):
    """The CPU coder this module's codecs use by default."""
    if request.param == "native" and not native.available():
        missing("NATIVE", f"the native coder is not built ({native.IMPORT_ERROR})")
    return request.param


@pytest.fixture(scope="module")
def make_codec(ckpt, coder):
    """``make_codec(elems_per_lane, layers_per_chunk, threads=2, pin=None, coder=<coder>)``, one
    Codec per configuration (a Codec keeps no per-stream state)."""
    cache: dict[tuple, Codec] = {}
    default = coder

    def make(epl: int = 1024, lpc: int = 2, threads: int = 2, pin: str | None = None,
             coder: str = default) -> Codec:
        key = (epl, lpc, threads, pin, coder)
        if key not in cache:
            cfg = CodecConfig(elems_per_lane=epl, layers_per_chunk=lpc, threads=threads, coder=coder)
            # NOTE: BF16 context tables are cached per process by sigma digest (codec.py)
            cache[key] = Codec.from_checkpoint(ckpt, cfg, pin=pin)
        return cache[key]

    return make


@pytest.fixture(scope="module")
def codecs(ckpt):
    """``codecs(coder, epl, lpc, threads, model)``: one cached Codec per configuration
    (the native-coder tests, test_native_*.py)."""
    from native_helpers import native_codecs

    return native_codecs(ckpt)


# every knob off its default: 8 warps a CTA (more than some calls have blocks), a group of 3 steps
# (no divisor of any lane length), CTAs of 2 warps for the per-block passes, the decoder's word window
TUNED = Tuning(rans_warps=8, model_cta=64, ahead=3, word_window=True)


@pytest.fixture(scope="module", params=["emulator", "emulator-tuned", "device"])
def coders(request, emu_work):
    """(the CUDA coder, the native coder, layers a case has: fewer on the emulator, one thread at a time)."""
    if not native.available():
        missing("NATIVE", f"the native coder is not built ({native.IMPORT_ERROR})")
    if request.param == "device":
        if not backends.cuda_available():
            pytest.skip("no CUDA device or CuPy")
        return CudaCoder.load(), native.NativeCoder(threads=2), 30
    # NOTE: np.empty for cupyx.empty_pinned: the host copies take CudaCoder's pinned path
    tuning = TUNED if request.param == "emulator-tuned" else Tuning()
    emu = CudaCoder(emulated_cupy(emu_work), empty_pinned=np.empty, tuning=tuning)
    return emu, native.NativeCoder(threads=2), 12
