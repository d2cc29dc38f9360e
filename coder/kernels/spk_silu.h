// speckv's own SiLU, for the W8A8 rungs whose MLP runs in speckv's kernels (``w8a8x``, ``w8a8x:k``);
// the torch reference is w8a8.py's ``silu_det`` and every path here writes its bits.
//
//   e    = exp2_det(-|x| * LOG2E)        in [2^-126, 1]: exp(-|x|), never overflows (spk_attn.h)
//   silu = (x >= 0 ? x : x * e) / (1 + e)    x sigmoid(x) in both signs' stable form
//
// Every step is one IEEE float32 operation on one element, so the scalar loop, the AVX2 and AVX-512
// lanes and torch's elementwise ops agree bit for bit. NOTE: no FMA may form (the build passes
// -ffp-contract=off). Torch's own SiLU calls its vectorised exp (Sleef), whose bits this does not try
// to follow; a rung that uses this SiLU pins it by its name.
// NOTE: a NaN input gives some NaN or garbage per path; the row quantisation after it reports the
// row as non-finite, which every caller turns into an error.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "spk_attn.h"       // exp2_det, exp2_det_v (AVX-512)
#include "spk_attn_avx2.h"  // exp2_det_v8 (AVX2)

namespace spk {

constexpr float SILU_LOG2E = (float)ATT_LOG2E;  // log2(e) rounded to float32 once

inline float silu_det(float x) {
    const float e = exp2_det(-std::fabs(x) * SILU_LOG2E);
    return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

#define SPK_SILU_AVX2 __attribute__((target("avx2")))
#define SPK_SILU_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
SPK_SILU_512 inline __m512 silu_det_v(__m512 x) {
    const __m512 a = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-SILU_LOG2E));  // -(|x|) * L, one rounding
    const __m512 e = exp2_det_v(a, (__mmask16)0xFFFF);
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);  // NOTE: not x >= 0 (NaN)
    const __m512 num = _mm512_mask_mul_ps(x, neg, x, e);
    return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

SPK_SILU_AVX2 inline __m256 silu_det_v8(__m256 x) {
    const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    const __m256 e = exp2_det_v8(_mm256_mul_ps(ax, _mm256_set1_ps(-SILU_LOG2E)));
    const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), neg);
    return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// One row of the MLP's gate product: m_j = silu_det(y_j) * y_{n + j}, j < n (y: gate, then up columns).
inline void silu_mul_row(const float* y, int64_t n, float* m) {
    for (int64_t j = 0; j < n; ++j) m[j] = silu_det(y[j]) * y[n + j];
}

SPK_SILU_AVX2 inline void silu_mul_row_avx2(const float* y, int64_t n, float* m) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(m + j, _mm256_mul_ps(silu_det_v8(_mm256_loadu_ps(y + j)), _mm256_loadu_ps(y + n + j)));
    for (; j < n; ++j) m[j] = silu_det(y[j]) * y[n + j];
}

SPK_SILU_512 inline void silu_mul_row_avx512(const float* y, int64_t n, float* m) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(m + j, _mm512_mul_ps(silu_det_v(_mm512_loadu_ps(y + j)), _mm512_loadu_ps(y + n + j)));
    for (; j < n; ++j) m[j] = silu_det(y[j]) * y[n + j];
}

#undef SPK_SILU_512
#undef SPK_SILU_AVX2

}  // namespace spk
