"""The CUDA warp emulator itself (tests/cuda_emu.py, tests/emu/): its collectives give CUDA's
results, it checks kernel arguments as CuPy packs them, and it refuses what CUDA leaves undefined.
The kernels' own tests run on it in tests/coder/test_cuda_kernels.py."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from cuda_emu import EMU_DIR, _Module, build

COLLECTIVES = r"""
extern "C" __global__ void collectives(unsigned* out, int n) {
    __shared__ unsigned across[64];
    const unsigned t = threadIdx.x, lane = t & 31u, v = 3u * t + blockIdx.x;
    unsigned* o = out + 8 * (blockIdx.x * blockDim.x + t);
    unsigned s = v;
    for (unsigned d = 1; d < 32u; d <<= 1) {  // inclusive scan
        const unsigned u = __shfl_up_sync(0xFFFFFFFFu, s, d);
        if (lane >= d) s += u;
    }
    o[0] = s;
    unsigned m = v;
    for (int d = 16; d; d >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, d));
    o[1] = m;
    o[2] = __shfl_sync(0xFFFFFFFFu, v, 31 - (int)lane);
    o[3] = __ballot_sync(0xFFFFFFFFu, lane % 3u == 0u || t >= (unsigned)n);
    o[4] = __all_sync(0xFFFFFFFFu, t < (unsigned)n), o[5] = __any_sync(0xFFFFFFFFu, t == 5u);
    across[t] = v;
    __syncthreads();
    o[6] = across[blockDim.x - 1 - t];  // another warp's value, after the barrier
    o[7] = __popc(v) + 100u * __clz(v);
}
"""


def test_emulator_collectives_have_cudas_results(tmp_path):
    """Shuffles (up, xor, indexed), votes, a barrier with a static __shared__ array, over 2 CTAs of 2
    warps, against the values CUDA defines for them (computed here in numpy)."""
    k = _module(COLLECTIVES, tmp_path).get_function("collectives")
    out = np.zeros((2, 64, 8), np.uint32)
    k((2,), (64,), (out, np.int32(40)))
    t = np.arange(64)
    for b in range(2):
        v = (3 * t + b).astype(np.uint32).reshape(2, 32)
        o = out[b].reshape(2, 32, 8)
        assert np.array_equal(o[..., 0], np.cumsum(v, axis=1))
        assert np.array_equal(o[..., 1], np.repeat(v.max(axis=1, keepdims=True), 32, axis=1))
        assert np.array_equal(o[..., 2], v[:, ::-1])
        want = [int(sum(1 << ln for ln in range(32) if ln % 3 == 0 or 32 * w + ln >= 40)) for w in range(2)]
        assert o[:, 0, 3].tolist() == want and (o[..., 3] == o[:, :1, 3]).all()
        assert o[:, :, 4].tolist() == [[1] * 32, [0] * 32] and o[:, :, 5].tolist() == [[1] * 32, [0] * 32]
        assert np.array_equal(out[b, :, 6], (3 * t[::-1] + b).astype(np.uint32))
        vv = (3 * t + b).astype(np.uint32)
        clz = np.array([32 - int(x).bit_length() for x in vv])
        assert np.array_equal(out[b, :, 7], [bin(int(x)).count("1") + 100 * c for x, c in zip(vv, clz, strict=True)])


def test_emulator_checks_arguments_as_cuda_packs_them(tmp_path):
    """An argument of another width than its parameter would shift every later one on a device (CuPy
    packs numpy scalars at their own width): the emulator refuses it, and a host array where the
    coder's kernels take device memory."""
    k = _module(COLLECTIVES, tmp_path).get_function("collectives")
    out = np.zeros((2, 64, 8), np.uint32)
    for bad, why in (((out, np.int64(40)), "signed 32-bit"), ((out, 40), "signed 32-bit"),
                     ((out, np.uint32(40)), "signed 32-bit"), ((np.int32(1), np.int32(40)), "an array"),
                     ((out,), "1 arguments for 2")):
        with pytest.raises(TypeError, match=why):
            k((2,), (64,), bad)
    dev = _Module(build(COLLECTIVES, tmp_path), device_only=True).get_function("collectives")
    with pytest.raises(TypeError, match="host array"):
        dev((2,), (64,), (out, np.int32(40)))


def _module(code, work):
    return _Module(build(code, work))


DIVERGENT = r"""
extern "C" __global__ void divergent(unsigned* out) {
    const unsigned lane = threadIdx.x & 31u;
    if (lane < 16) out[lane] = __shfl_xor_sync(0xFFFFFFFFu, lane, 1);
}
extern "C" __global__ void mixed(unsigned* out) {
    const unsigned lane = threadIdx.x & 31u;
    out[lane] = lane < 16 ? __ballot_sync(0xFFFFFFFFu, 1) : (unsigned)__any_sync(0xFFFFFFFFu, 1);
}
extern "C" __global__ void deadlock(unsigned* out) {
    if (threadIdx.x == 40) out[0] = __ballot_sync(0xFFFFFFFFu, 1);
    else __syncthreads();
}
"""


@pytest.mark.parametrize("kernel,message", [("divergent", "without every lane of the warp"),
                                            ("mixed", "lanes of one warp at different collectives"),
                                            ("deadlock", "__syncthreads not reached by every live thread")])
def test_emulator_refuses_undefined_behaviour(tmp_path, kernel, message):
    """Where CUDA leaves the result undefined (a collective half the warp skips, a barrier some
    threads never reach) the emulator stops the process with a message, instead of guessing."""
    build(DIVERGENT, tmp_path)
    tests = str(EMU_DIR.parent)
    code = (f"import sys, numpy as np; sys.path[:0] = [{tests!r}]\n"
            "from pathlib import Path; from cuda_emu import build, _Module\n"
            f"k = _Module(build(open({str(tmp_path / 'src.cu')!r}).read(), Path({str(tmp_path)!r})))"
            f".get_function({kernel!r})\n"
            "k((1,), (64,), (np.zeros(64, np.uint32),))\n")
    (tmp_path / "src.cu").write_text(DIVERGENT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


# -- the codec on the CUDA coder ----------------------------------------------------------------
