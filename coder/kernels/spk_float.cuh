// The model's float32 primitives (SPK_FMUL, SPK_FADD, SPK_FSUB, SPK_FDIV, SPK_ISNAN) and bit casts,
// for the CPU build (plain IEEE float32: -ffp-contract=off, no -ffast-math) and the device (float64
// emulation, below), so both round every operation the same way (spk_model.cuh uses them).
#pragma once
#include "rans_lane.cuh"

#ifdef __CUDA_ARCH__
// NOTE: CuPy compiles every RawModule with -ftz=true appended to the caller's options (the last
// one wins), so the device's float32 instructions flush subnormal inputs and results to zero and
// the CPU's do not: a lent H200 (2026-12-04) gave 879 of 49,152 FP8 mu' / scale quotients other
// bits than the CPU. So each device float32 operation runs in float64, which ftz leaves alone:
// operands widened exactly from their bits (spk_widen), one correctly rounded float64 operation,
// then one rounding to float32 from the bits (spk_narrow). One rounding after another is still the
// correctly rounded float32 result: for normal results float64 has at least 2p + 2 bits of the
// p = 24 bit result (Figueroa, "When is double rounding innocuous?", 1995); subnormal results of a
// sum or product are exact in float64, and a subnormal quotient lies farther from a midpoint than
// half a float64 ulp. Float32 compares are made on bits for the same reason (spk_affine_bf16).
SPK_HD float spk_f32(uint32_t u) { return __uint_as_float(u); }
SPK_HD uint32_t spk_u32(float f) { return __float_as_uint(f); }
SPK_HD double spk_pow2(int k) { return __longlong_as_double((long long)(k + 1023) << 52); }  // normal k only
SPK_HD double spk_widen(float f) {
    const uint32_t u = __float_as_uint(f), e = (u >> 23) & 0xFFu, m = u & 0x7FFFFFu;
    if (e == 0xFFu) return (double)f;  // inf, NaN: no subnormal to flush
    const double v = e ? (double)(m | 0x800000u) * spk_pow2((int)e - 150) : (double)m * spk_pow2(-149);
    return (u >> 31) ? -v : v;
}
SPK_HD float spk_narrow(double d) {
    const double a = fabs(d);
    if (!(a < 0x1p-126)) return __double2float_rn(d);  // normal, inf or NaN result
    const uint32_t units = (uint32_t)__double2ull_rn(a * 0x1p149);  // exact scaling; ties to even
    return __uint_as_float((__double_as_longlong(d) < 0 ? 0x80000000u : 0u) | units);  // 2^23 units: 2^-126
}
#define SPK_FMUL(a, b) spk_narrow(__dmul_rn(spk_widen(a), spk_widen(b)))
#define SPK_FADD(a, b) spk_narrow(__dadd_rn(spk_widen(a), spk_widen(b)))
#define SPK_FSUB(a, b) spk_narrow(__dsub_rn(spk_widen(a), spk_widen(b)))
#define SPK_FDIV(a, b) spk_narrow(__ddiv_rn(spk_widen(a), spk_widen(b)))
#define SPK_ISNAN(a) isnan(a)
SPK_HD int32_t spk_clz32(uint32_t v) { return __clz(v); }
SPK_HD int32_t spk_clz64(uint64_t v) { return __clzll(v); }
#else
#include <cmath>
#include <cstring>
#define SPK_FMUL(a, b) ((a) * (b))
#define SPK_FADD(a, b) ((a) + (b))
#define SPK_FSUB(a, b) ((a) - (b))
#define SPK_FDIV(a, b) ((a) / (b))
#define SPK_ISNAN(a) std::isnan(a)
SPK_HD float spk_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
SPK_HD uint32_t spk_u32(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
SPK_HD int32_t spk_clz32(uint32_t v) { return __builtin_clz(v); }
SPK_HD int32_t spk_clz64(uint64_t v) { return __builtin_clzll(v); }
#endif
