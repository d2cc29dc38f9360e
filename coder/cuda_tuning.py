"""The fused CUDA coder's launch and compile knobs (``coder/cuda.py`` takes a ``Tuning``): warps a
CTA, threads a CTA, steps loaded ahead, the decoder's word window. They change speed, never bytes:
tests/coder/test_cuda_kernels.py runs a tuned coder against the native one on the CPU's warp emulator,
and ``benchmarks/gpu_check.py --sweep`` times ``SWEEP`` on a device."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuning:
    """Launch and compile choices of the kernels: they change speed, never bytes (the emulator's
    tests run a tuned coder against the native one; ``benchmarks/gpu_check.py --sweep`` times them)."""

    rans_warps: int = 4  # rANS blocks (warps) per CTA of the lane passes; <= 8 (spk_device.cuh SPK_MAX_CTA)
    model_cta: int = 256  # threads per CTA of CTA_KERNELS, <= 512 (spk_device.cuh SPK_MODEL_CTA)
    ahead: int = 8  # steps of model output a lane loads ahead (SPK_AHEAD)
    word_window: bool = False  # the rANS decoder reads its words from registers (SPK_WORD_WINDOW)

    def __post_init__(self) -> None:
        # NOTE: model_cta <= 512: at 1024 threads spk_decode_values_* spills (nvcc sm_90)
        if not (1 <= self.rans_warps <= 8 and self.model_cta % 32 == 0 and 32 <= self.model_cta <= 512
                and 1 <= self.ahead <= 32):
            raise ValueError(f"bad tuning {self}")

    def defines(self) -> tuple[str, ...]:
        return (f"-DSPK_MODEL_CTA={self.model_cta}", f"-DSPK_AHEAD={self.ahead}",
                f"-DSPK_WORD_WINDOW={int(self.word_window)}")


DEFAULT = Tuning()

# what ``benchmarks/gpu_check.py --sweep`` times on a device: the defaults, each knob moved alone, and
# together (tests/coder/test_cuda_source.py builds each with nvcc: no spills)
SWEEP = (DEFAULT, Tuning(word_window=True), Tuning(rans_warps=8), Tuning(ahead=4), Tuning(ahead=16),
         Tuning(model_cta=128), Tuning(model_cta=512), Tuning(rans_warps=8, ahead=16, word_window=True))
