// Stage C2 of the decoder (spk_decode.h, decode_block_values_vector): where each element's raw
// field starts in its kind's section, and how many zero-bin elements come before it: running sums
// over the block's elements, scalar and on AVX-512 as prefix scans (the same integers).
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <array>
#include <cstdint>

#include "spk_simd.h"

namespace spk {

#if SPK_HAVE_AVX2_BUILD
// Inclusive prefix sum of 16 u32 lanes: four shifted adds (alignr against zero moves lane i to i + k).
SPK_AVX512 inline __m512i scan16(__m512i v) {
    const __m512i z = _mm512_setzero_si512();
    v = _mm512_add_epi32(v, _mm512_alignr_epi32(v, z, 15));
    v = _mm512_add_epi32(v, _mm512_alignr_epi32(v, z, 14));
    v = _mm512_add_epi32(v, _mm512_alignr_epi32(v, z, 12));
    return _mm512_add_epi32(v, _mm512_alignr_epi32(v, z, 8));
}

// C2's running sums over whole groups of 16 elements (the rest is the caller's): pos = the start
// of each element's field in its kind's section (ESC's for any kind but NORMAL and ZERO), zi = the
// zero-bin elements before it; the sums advance as the scalar loop's do. Returns the elements done.
// NOTE: an element adds only to its own kind's sum, so its exclusive prefix is the inclusive one
// less its own width.
SPK_AVX512 inline int64_t positions_avx512(const uint32_t* __restrict info, int64_t n, uint32_t sums[4],
                                           uint32_t* __restrict pos, uint32_t* __restrict zi) {
    const __m512i three = _mm512_set1_epi32(3), wbits = _mm512_set1_epi32(31), one = _mm512_set1_epi32(1);
    const __m512i last = _mm512_set1_epi32(15);
    __m512i low = _mm512_set1_epi32((int)sums[0]), zman = _mm512_set1_epi32((int)sums[1]);
    __m512i esc = _mm512_set1_epi32((int)sums[2]), z = _mm512_set1_epi32((int)sums[3]);
    int64_t e = 0;
    for (; e + 16 <= n; e += 16) {
        const __m512i in = _mm512_loadu_si512((const void*)(info + e));
        const __m512i kind = _mm512_and_si512(_mm512_srli_epi32(in, 22), three);
        const __m512i w = _mm512_and_si512(_mm512_srli_epi32(in, INFO_WIDTH_SHIFT), wbits);
        const __mmask16 mn = _mm512_cmpeq_epi32_mask(kind, _mm512_set1_epi32((int)SPK_KIND_NORMAL));
        const __mmask16 mz = _mm512_cmpeq_epi32_mask(kind, _mm512_set1_epi32((int)SPK_KIND_ZERO));
        const __mmask16 me = _mm512_cmpeq_epi32_mask(kind, _mm512_set1_epi32((int)SPK_KIND_ESC));
        const __m512i wn = _mm512_maskz_mov_epi32(mn, w), wz = _mm512_maskz_mov_epi32(mz, w);
        const __m512i we = _mm512_maskz_mov_epi32(me, w), cz = _mm512_maskz_mov_epi32(mz, one);
        const __m512i in_n = scan16(wn), in_z = scan16(wz), in_e = scan16(we), in_c = scan16(cz);
        __m512i p = _mm512_add_epi32(esc, _mm512_sub_epi32(in_e, we));
        p = _mm512_mask_mov_epi32(p, mz, _mm512_add_epi32(zman, _mm512_sub_epi32(in_z, wz)));
        p = _mm512_mask_mov_epi32(p, mn, _mm512_add_epi32(low, _mm512_sub_epi32(in_n, wn)));
        _mm512_storeu_si512((void*)(pos + e), p);
        _mm512_storeu_si512((void*)(zi + e), _mm512_add_epi32(z, _mm512_sub_epi32(in_c, cz)));
        low = _mm512_add_epi32(low, _mm512_permutexvar_epi32(last, in_n));
        zman = _mm512_add_epi32(zman, _mm512_permutexvar_epi32(last, in_z));
        esc = _mm512_add_epi32(esc, _mm512_permutexvar_epi32(last, in_e));
        z = _mm512_add_epi32(z, _mm512_permutexvar_epi32(last, in_c));
    }
    sums[0] = (uint32_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(low));
    sums[1] = (uint32_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(zman));
    sums[2] = (uint32_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(esc));
    sums[3] = (uint32_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(z));
    return e;
}
#endif

// pos[e] = the field's start in its kind's section (LOW, ZMAN, or ESC for any other kind), zi[e] =
// the zero-bin elements before it; the sections' first bits and the first zero-bin index in
// `start` (LOW, ZMAN, ESC, zero bins). NOTE: positions in uint32 (the caller checks the chunk's size)
inline void field_positions(const uint32_t* __restrict info, int64_t n, std::array<uint32_t, 4> start, bool wide,
                            uint32_t* __restrict pos, uint32_t* __restrict zi) {
    int64_t e = 0;
#if SPK_HAVE_AVX2_BUILD
    if (wide) e = positions_avx512(info, n, start.data(), pos, zi);  // whole groups of 16; the rest below
#endif
    uint32_t low = start[0], zman = start[1], esc = start[2], z = start[3];
    for (; e < n; ++e) {
        const uint32_t kind = info[e] >> 22 & 3u, w = info[e] >> INFO_WIDTH_SHIFT & 31u;
        const uint32_t normal = kind == SPK_KIND_NORMAL, zero = kind == SPK_KIND_ZERO;
        pos[e] = normal ? low : zero ? zman : esc;
        zi[e] = z;
        low += normal ? w : 0, zman += zero ? w : 0, esc += kind == SPK_KIND_ESC ? w : 0, z += zero;
    }
}

}  // namespace spk
