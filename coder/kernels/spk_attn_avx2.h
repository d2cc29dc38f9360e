// The int8 attention's AVX2 path (spk_attn.h holds the math, the scalar reference and the VNNI path),
// for CPUs without AVX-512 VNNI, where the scalar rows took 2/3 of a w8a8i:4 pass (8.8 s of 13.3 s at
// 2048 tokens on a 2-core AVX2 EPYC). Bit for bit the scalar reference:
//
//   scores   S = q8 @ k8^T for the task's rows against keys [0, i1): spk_igemm.h's exact int32 product
//   x_ij     ((float)S_ij * c_i) * ks_j, 8 lanes at a time: the same two IEEE products per element
//   weights  per key block: exp2_det lane by lane (the same float steps: max, nearbyint, Horner without
//            FMA, 2^n from exponent bits), den's integer share, w = e vs, bm = max w, u = nearbyint(w 255 / bm)
//   P @ V    acc_d += u_j v8_jd over the block, two keys per vpmaddwd: (u_j, u_j+1) against the keys'
//            interleaved int16 values (|u v| < 2^15, pair sums exact in int32)
//   out      out_d = out_d + bs * float(acc_d) per block, then bf16(out_d / den), as the reference
//
// NOTE: vpunpck{l,h}wd interleave within 128-bit lanes, so acc's int32 lanes hold channels
// {0-3, 8-11} (lo) and {4-7, 12-15} (hi) of each 16; ``attn_pv_store`` puts them back in order.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "spk_attn.h"
#include "spk_igemm.h"

namespace spk {

#define SPK_AVX2 __attribute__((target("avx2")))
constexpr int64_t ATT_AVX2_MAX_D = 128;  // D / 16 pairs of accumulators per row

SPK_AVX2 inline __m256 exp2_det_v8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(ATT_EXP_FLOOR), x);  // NOTE: max(b, a) is std::max(a, b), NaN included
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(EXP2_P[0]);
    for (int k = 1; k < 5; ++k) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP2_P[k]));
    const __m256 y = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// lanes k < valid of 8
SPK_AVX2 inline __m256 lanes_below(int64_t valid) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::clamp<int64_t>(valid, 0, 8)), idx));
}

// max of x[0, n) (n >= 1; exact in any order)
SPK_AVX2 inline float max_of(const float* x, int64_t n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(_mm256_loadu_ps(x + j), mv);  // std::max(m, x_j)
    alignas(32) float m8[8];
    _mm256_store_ps(m8, mv);
    float m = -INFINITY;
    for (int k = 0; k < 8; ++k) m = std::max(m, m8[k]);
    for (; j < n; ++j) m = std::max(m, x[j]);
    return m;
}

// Key block [b0, b0 + ATT_KEY_BLOCK) of row i (scores x, zero-padded past i to a multiple of 8; row
// max m): uint8-range weights u (int32, 0 past the row), den's share, and the block's largest weight
// bm (0: the reference skips the block; u is then all 0).
SPK_AVX2 inline float attn_block_weights8(const float* x, const float* vs, float m, int64_t i, int64_t b0,
                                          int32_t* u, int64_t& den) {
    const int64_t n = std::min<int64_t>(ATT_KEY_BLOCK, i + 1 - b0);  // keys of the block the row reads
    std::memset(u, 0, ATT_KEY_BLOCK * sizeof(int32_t));
    if (max_of(x + b0, n) - m < ATT_SKIP) return 0.0f;
    const __m256 vm = _mm256_set1_ps(m), den_scale = _mm256_set1_ps((float)(1 << ATT_DEN_BITS));
    alignas(32) float w[ATT_KEY_BLOCK];
    __m256 bmv = _mm256_setzero_ps();
    __m256i dsum = _mm256_setzero_si256();
    for (int64_t k = 0; k < n; k += 8) {
        const __m256 live = lanes_below(n - k);
        const __m256 e = _mm256_and_ps(live, exp2_det_v8(_mm256_sub_ps(_mm256_loadu_ps(x + b0 + k), vm)));
        // NOTE: cvtps rounds in the MXCSR mode, nearest even, as nearbyint does
        dsum = _mm256_add_epi32(dsum, _mm256_cvtps_epi32(_mm256_mul_ps(e, den_scale)));
        const __m256 wk = _mm256_mul_ps(e, _mm256_loadu_ps(vs + b0 + k));
        _mm256_store_ps(w + k, wk);
        bmv = _mm256_max_ps(wk, bmv);  // std::max(bm, w)
    }
    alignas(32) int32_t d8[8];
    alignas(32) float b8[8];
    _mm256_store_si256((__m256i*)d8, dsum);
    _mm256_store_ps(b8, bmv);
    float bm = 0.0f;
    for (int k = 0; k < 8; ++k) {
        den += d8[k];
        bm = std::max(bm, b8[k]);
    }
    if (!(bm > 0.0f)) return 0.0f;
    const __m256 inv = _mm256_set1_ps(ATT_P_MAX / bm);
    for (int64_t k = 0; k < n; k += 8)  // NOTE: lanes past n hold w = 0 (e masked), so u = 0 there
        _mm256_storeu_si256((__m256i*)(u + k), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(w + k), inv)));
    return bm;
}

// acc += sum over the block's keys of u_j * v8_j (C = D / 16 pairs of accumulators, lanes interleaved).
template <int C>
SPK_AVX2 inline void attn_pv8(const int8_t* v8, const int32_t* u, int64_t b0, int64_t n, __m256i* lo, __m256i* hi) {
    constexpr int64_t D = 16 * C;
    for (int64_t j = 0; j < n; j += 2) {
        const int32_t u1 = j + 1 < n ? u[j + 1] : 0;
        const __m256i uu = _mm256_set1_epi32((int32_t)((uint32_t)u[j] | ((uint32_t)u1 << 16)));
        const int8_t* r0 = v8 + (b0 + j) * D;
        const int8_t* r1 = j + 1 < n ? r0 + D : r0;  // NOTE: weight 0 there: any row adds nothing
        for (int c = 0; c < C; ++c) {
            const __m256i a = widen16(r0 + 16 * c), b = widen16(r1 + 16 * c);
            lo[c] = _mm256_add_epi32(lo[c], _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), uu));
            hi[c] = _mm256_add_epi32(hi[c], _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), uu));
        }
    }
}

template <int C>
SPK_AVX2 inline void attn_pv_store(const __m256i* lo, const __m256i* hi, int32_t* acc) {
    alignas(32) int32_t l[8], h[8];
    for (int c = 0; c < C; ++c) {
        _mm256_store_si256((__m256i*)l, lo[c]);
        _mm256_store_si256((__m256i*)h, hi[c]);
        for (int t = 0; t < 4; ++t) {
            acc[16 * c + t] = l[t];
            acc[16 * c + 4 + t] = h[t];
            acc[16 * c + 8 + t] = l[4 + t];
            acc[16 * c + 12 + t] = h[4 + t];
        }
    }
}

// One row i from its scores x (zero-padded to whole key blocks): softmax weights per block, P @ V, out.
template <int C>
SPK_AVX2 inline void attn_row8(const AttnHead& a, const float* x, int64_t i, uint16_t* orow) {
    constexpr int64_t D = 16 * C;
    const float m = max_of(x, i + 1);
    alignas(32) float out[D] = {};
    alignas(32) int32_t u[ATT_KEY_BLOCK], acc[D];
    int64_t den = 0;
    for (int64_t b0 = 0; b0 <= i; b0 += ATT_KEY_BLOCK) {
        const float bm = attn_block_weights8(x, a.vs, m, i, b0, u, den);
        if (!(bm > 0.0f)) continue;  // as the reference: a skipped block, or one with no weight
        const float bs = bm / ATT_P_MAX;
        __m256i lo[C], hi[C];
        for (int c = 0; c < C; ++c) lo[c] = hi[c] = _mm256_setzero_si256();
        attn_pv8<C>(a.v8, u, b0, std::min<int64_t>(ATT_KEY_BLOCK, i + 1 - b0), lo, hi);
        attn_pv_store<C>(lo, hi, acc);
        const __m256 vb = _mm256_set1_ps(bs);
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 add = _mm256_mul_ps(vb, _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)(acc + d))));
            _mm256_store_ps(out + d, _mm256_add_ps(_mm256_load_ps(out + d), add));
        }
    }
    const float denf = (float)den * (1.0f / (float)(1 << ATT_DEN_BITS));
    for (int64_t d = 0; d < D; ++d) orow[d] = f32_to_bf16(out[d] / denf);
}

template <int C>
SPK_AVX2 inline void attn_rows_avx2_c(const AttnHead& a, float rsd, int64_t i0, int64_t i1, uint16_t* o,
                                      int64_t o_stride) {
    constexpr int64_t D = 16 * C;
    const int64_t rows = i1 - i0, keys = i1, stride = pad_to(i1, ATT_KEY_BLOCK);
    std::vector<int32_t> S((size_t)(rows * keys));
    igemm_rows_avx2(a.q8 + i0 * D, a.k8, S.data(), 0, rows, keys, D);
    std::vector<float> x((size_t)stride, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        const __m256 c = _mm256_set1_ps(a.qs[i] * rsd);
        const int32_t* s = S.data() + r * keys;
        int64_t j = 0;
        for (; j + 8 <= i + 1; j += 8) {
            const __m256 sf = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(s + j)));
            _mm256_storeu_ps(x.data() + j, _mm256_mul_ps(_mm256_mul_ps(sf, c), _mm256_loadu_ps(a.ks + j)));
        }
        for (; j <= i; ++j) x[j] = ((float)s[j] * (a.qs[i] * rsd)) * a.ks[j];
        std::fill(x.begin() + i + 1, x.begin() + std::min(stride, pad_to(i + 1, 8)), 0.0f);  // lanes read past i
        attn_row8<C>(a, x.data(), i, o + i * o_stride);
    }
}

// AVX2 path of attn_rows: query rows [i0, i1) of one head (D a multiple of 16, at most ATT_AVX2_MAX_D).
SPK_AVX2 inline void attn_rows_avx2(const AttnHead& a, int64_t D, float rsd, int64_t i0, int64_t i1, uint16_t* o,
                                    int64_t o_stride) {
    switch (D / 16) {
        case 1: return attn_rows_avx2_c<1>(a, rsd, i0, i1, o, o_stride);
        case 2: return attn_rows_avx2_c<2>(a, rsd, i0, i1, o, o_stride);
        case 3: return attn_rows_avx2_c<3>(a, rsd, i0, i1, o, o_stride);
        case 4: return attn_rows_avx2_c<4>(a, rsd, i0, i1, o, o_stride);
        case 5: return attn_rows_avx2_c<5>(a, rsd, i0, i1, o, o_stride);
        case 6: return attn_rows_avx2_c<6>(a, rsd, i0, i1, o, o_stride);
        case 7: return attn_rows_avx2_c<7>(a, rsd, i0, i1, o, o_stride);
        default: return attn_rows_avx2_c<8>(a, rsd, i0, i1, o, o_stride);
    }
}

#undef SPK_AVX2

}  // namespace spk
