// The W8A8 predictor's per-element stages (speckv/predictor/w8a8.py): one pass each, the same single
// IEEE float32 operations in the same order as the torch reference there, so both give the same bits.
//
// Row quantisation, one row x[0..k) (float32, or BF16 bits widened exactly):
//
//   y_j  = x_j * f_j                      f: the smoothing 2^-e (times the norm's gain)
//   amax = max_j |y_j|
//   inv  = amax > 0 ? 127 / amax : 0      one correctly rounded division
//   q_j  = nearbyint(y_j * inv)           round half to even, |q_j| <= 127
//   xs   = amax / 127
//
// The low part of a 14-bit activation (``kv_activation_bits`` 14: a w8a8 rung's K/V projections read
// q + lo / 2^W8A8_LO_SHIFT, two int8 products):
//
//   lo_j = nearbyint((y_j * inv - q_j) * 2^W8A8_LO_SHIFT)   |lo_j| <= 64
//
// y_j * inv - q_j is exact (a float less its nearest integer), and so is the power-of-two scaling.
//
// Dequantisation of one row of int32 sums: y_j = (float(acc_j) * xs) * ws_j, then either float32 out,
// or BF16 out = bf16(float(add_j) + float(bf16(y_j))) (torch's ``add + y.to(bf16)``).
//
// NOTE: no FMA may form (the build passes -ffp-contract=off); the AVX2 loops use the same operations
// lane by lane, and round with _MM_FROUND_TO_NEAREST_INT, which is nearbyint's mode.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace spk {

constexpr float W8A8_QMAX = 127.0f;

inline float bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// round to nearest even; the inputs here are finite (w8a8.py checks the row scales)
inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <class X> inline float widen(X v);
template <> inline float widen<float>(float v) { return v; }
template <> inline float widen<uint16_t>(uint16_t v) { return bf16_to_f32(v); }

// The scalar loops over [j0, k): the reference row below, and the AVX2 row's tail.
// amax of |x_j f_j| from ``amax`` on; ``bad`` is set by a non-finite product.
template <class X>
inline float scaled_amax(const X* x, const float* f, int64_t j0, int64_t k, float amax, bool& bad) {
    for (int64_t j = j0; j < k; ++j) {
        const float a = std::fabs(widen(x[j]) * f[j]);
        bad |= !(a < INFINITY);
        amax = std::max(amax, a);
    }
    return amax;
}

constexpr int W8A8_LO_SHIFT = 7;  // lo's weight: 2^-7 of q's, so |lo| <= 64 fits int8
constexpr float W8A8_LO_SCALE = (float)(1 << W8A8_LO_SHIFT);

// q[j0..k), and with ``lo`` the low parts too.
template <class X>
inline void scaled_round(const X* x, const float* f, int64_t j0, int64_t k, float inv, int8_t* q,
                         int8_t* lo = nullptr) {
    for (int64_t j = j0; j < k; ++j) {
        const float t = (widen(x[j]) * f[j]) * inv, r = std::nearbyint(t);
        q[j] = (int8_t)r;
        if (lo) lo[j] = (int8_t)std::nearbyint((t - r) * W8A8_LO_SCALE);
    }
}

inline float row_inv(float amax) { return amax > 0.0f ? W8A8_QMAX / amax : 0.0f; }

// Scalar row, the reference loop. Returns amax.
// NOTE: a row with a non-finite y returns NaN (its q is garbage): torch's amax gives NaN or inf there,
// and w8a8.py refuses either, so both paths fail the same way.
template <class X>
inline float w8a8_quantise_row(const X* x, const float* f, int64_t k, int8_t* q, int8_t* lo = nullptr) {
    bool bad = false;
    const float amax = scaled_amax(x, f, 0, k, 0.0f, bad);
    if (bad) return NAN;
    scaled_round(x, f, 0, k, row_inv(amax), q, lo);
    return amax;
}

template <class X> __attribute__((target("avx2"))) inline __m256 load8(const X* x);
template <> __attribute__((target("avx2"))) inline __m256 load8<float>(const float* x) { return _mm256_loadu_ps(x); }
template <> __attribute__((target("avx2"))) inline __m256 load8<uint16_t>(const uint16_t* x) {
    const __m128i b = _mm_loadu_si128((const __m128i*)x);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

template <class X>
__attribute__((target("avx2"))) inline float w8a8_quantise_row_avx2(const X* x, const float* f, int64_t k,
                                                                      int8_t* q, int8_t* lo = nullptr) {
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_mul_ps(load8(x + j), _mm256_loadu_ps(f + j)));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // a >= inf or NaN
        m = _mm256_max_ps(m, a);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float amax = 0.0f;
    for (float v : lanes) amax = std::max(amax, v);
    bool nonfinite = _mm256_movemask_ps(bad) != 0;
    amax = scaled_amax(x, f, j, k, amax, nonfinite);
    if (nonfinite) return NAN;
    const float inv = row_inv(amax);
    const __m256 vi = _mm256_set1_ps(inv), vs = _mm256_set1_ps(W8A8_LO_SCALE);
    for (j = 0; j + 8 <= k; j += 8) {
        const __m256 y = _mm256_mul_ps(_mm256_mul_ps(load8(x + j), _mm256_loadu_ps(f + j)), vi);
        const __m256 rf = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i r = _mm256_cvtps_epi32(rf);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storel_epi64((__m128i*)(q + j), _mm_packs_epi16(w, w));
        if (lo) {
            const __m256 l = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(y, rf), vs),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i li = _mm256_cvtps_epi32(l);
            const __m128i lw = _mm_packs_epi32(_mm256_castsi256_si128(li), _mm256_extracti128_si256(li, 1));
            _mm_storel_epi64((__m128i*)(lo + j), _mm_packs_epi16(lw, lw));
        }
    }
    scaled_round(x, f, j, k, inv, q, lo);
    return amax;
}

// One row of the dequantisation: float32 out (add == nullptr) or BF16 out with the residual add.
inline void w8a8_dequant_row(const int32_t* acc, float xs, const float* ws, int64_t n, const uint16_t* add,
                             void* out, int64_t j = 0) {
    if (!add) {
        float* o = static_cast<float*>(out);
        for (; j < n; ++j) o[j] = ((float)acc[j] * xs) * ws[j];
        return;
    }
    uint16_t* o = static_cast<uint16_t*>(out);
    for (; j < n; ++j) o[j] = f32_to_bf16(bf16_to_f32(add[j]) + bf16_to_f32(f32_to_bf16(((float)acc[j] * xs) * ws[j])));
}

__attribute__((target("avx2"))) inline void w8a8_dequant_row_avx2(const int32_t* acc, float xs, const float* ws,
                                                                   int64_t n, const uint16_t* add, void* out) {
    const __m256 vx = _mm256_set1_ps(xs);
    int64_t j = 0;
    if (!add) {
        float* o = static_cast<float*>(out);
        for (; j + 8 <= n; j += 8) {
            const __m256 a = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(acc + j)));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(a, vx), _mm256_loadu_ps(ws + j)));
        }
    }
    w8a8_dequant_row(acc, xs, ws, n, add, out, j);  // the tail (all of it for BF16 out: GCC vectorises it)
}

// The AVX-512 row quantisation: the AVX2 row's operations on 16 lanes (a row's max is exact in any order).
// NOTE: no AVX-512 dequantisation: it is bound by memory, and 16 lanes ran no faster than 8 (2026-12-04)
#define SPK_W8A8_512 __attribute__((target("avx512f,avx512bw,avx512vl")))
template <class X> SPK_W8A8_512 inline __m512 load16(const X* x);
template <> SPK_W8A8_512 inline __m512 load16<float>(const float* x) { return _mm512_loadu_ps(x); }
template <> SPK_W8A8_512 inline __m512 load16<uint16_t>(const uint16_t* x) {
    const __m256i b = _mm256_loadu_si256((const __m256i*)x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

template <class X>
SPK_W8A8_512 inline float w8a8_quantise_row_avx512(const X* x, const float* f, int64_t k, int8_t* q,
                                                   int8_t* lo = nullptr) {
    const __m512 inf = _mm512_set1_ps(INFINITY);
    __m512 m = _mm512_setzero_ps();
    __mmask16 bad = 0;
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_mul_ps(load16(x + j), _mm512_loadu_ps(f + j)));
        bad |= _mm512_cmp_ps_mask(a, inf, _CMP_NLT_UQ);  // a >= inf or NaN
        m = _mm512_max_ps(m, a);
    }
    bool nonfinite = bad != 0;
    const float amax = scaled_amax(x, f, j, k, _mm512_reduce_max_ps(m), nonfinite);
    if (nonfinite) return NAN;
    const float inv = row_inv(amax);
    const __m512 vi = _mm512_set1_ps(inv), vs = _mm512_set1_ps(W8A8_LO_SCALE);
    for (j = 0; j + 16 <= k; j += 16) {
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(load16(x + j), _mm512_loadu_ps(f + j)), vi);
        const __m512 rf = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i*)(q + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rf)));
        if (lo) {
            const __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(y, rf), vs),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i*)(lo + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(l)));
        }
    }
    scaled_round(x, f, j, k, inv, q, lo);
    return amax;
}

#undef SPK_W8A8_512

// RoPE of one token's heads, as w8a8_pass._rope computes it with torch's BF16 ops (llama.py ``rope``):
// float32 x (heads * D) -> BF16 out (heads * D), per head, with h = D / 2 and BF16 cos, sin (D):
//
//   b_d   = bf16(x_d)
//   r_d   = -b_{d+h} (d < h), b_{d-h} (d >= h)           rotate_half: exact
//   out_d = bf16(bf16(b_d * cos_d) + bf16(r_d * sin_d))   each torch op: float32, then one rounding
//
// A product of two BF16 values is exact in float32, so only the roundings to BF16 count, and the sum
// is rounded to float32 first, as torch's BF16 add does. Returns true when some input or output is not
// finite. NOTE: then the caller must compute it again with torch (w8a8_pass._rope does): f32_to_bf16
// keeps no NaN payload (some wrap to zeros), and torch's own NaN bits differ between its vector and
// scalar loops. Real activations stay far below the overflow (|x| about 1e38 and up, by cos and sin).
__attribute__((always_inline)) inline bool rope_token_body(const float* __restrict x, const uint16_t* __restrict cos,
                                                           const uint16_t* __restrict sin, int64_t heads, int64_t D,
                                                           uint16_t* __restrict out) {
    const int64_t h = D / 2;
    uint32_t bad = 0;
    // NOTE: two straight loops (first half: r = -b_{d+h}, second: r = b_{d-h}) so the compiler vectorises both
    auto half = [&](const float* __restrict xb, const float* __restrict xr, float sign, const uint16_t* __restrict cs,
                    const uint16_t* __restrict sn, uint16_t* __restrict oh) {
        for (int64_t d = 0; d < h; ++d) {
            const float b = bf16_to_f32(f32_to_bf16(xb[d]));
            const float r = sign * bf16_to_f32(f32_to_bf16(xr[d]));  // exact: a sign
            const float a = bf16_to_f32(f32_to_bf16(b * bf16_to_f32(cs[d])));
            const float c = bf16_to_f32(f32_to_bf16(r * bf16_to_f32(sn[d])));
            const uint16_t o = f32_to_bf16(a + c);
            oh[d] = o;
            uint32_t u;
            std::memcpy(&u, xb + d, 4);  // NOTE: the two halves read every input once as xb
            bad |= (uint32_t)((o & 0x7F80u) == 0x7F80u) | (uint32_t)((u & 0x7F800000u) == 0x7F800000u);
        }
    };
    for (int64_t head = 0; head < heads; ++head) {
        const float* xh = x + head * D;
        uint16_t* oh = out + head * D;
        half(xh, xh + h, -1.0f, cos, sin, oh);
        half(xh + h, xh, 1.0f, cos + h, sin + h, oh + h);
    }
    return bad != 0;
}

inline bool w8a8_rope_token(const float* x, const uint16_t* cos, const uint16_t* sin, int64_t heads, int64_t D,
                            uint16_t* out) {
    return rope_token_body(x, cos, sin, heads, D, out);
}

// bf16(v) of 8 floats, as floats (round to nearest even; the low 16 bits cleared)
__attribute__((target("avx2"))) inline __m256 bf16_round8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
}

// The same steps, 8 lanes at a time (head size a multiple of 16; else the scalar loop)
__attribute__((target("avx2"))) inline bool w8a8_rope_token_avx2(const float* x, const uint16_t* cos,
                                                                  const uint16_t* sin, int64_t heads, int64_t D,
                                                                  uint16_t* out) {
    const int64_t h = D / 2;
    if (h % 8) return rope_token_body(x, cos, sin, heads, D, out);
    const __m256 neg = _mm256_set1_ps(-0.0f);
    const __m256i exp_mask = _mm256_set1_epi32(0x7F80), in_mask = _mm256_set1_epi32(0x7F800000);
    __m256i bad = _mm256_setzero_si256();
    for (int64_t head = 0; head < heads; ++head) {
        const float* xh = x + head * D;
        uint16_t* oh = out + head * D;
        for (int64_t d = 0; d < D; d += 8) {
            const bool first = d < h;  // r = -b_{d+h}, else b_{d-h}
            const __m256 xd = _mm256_loadu_ps(xh + d);  // NOTE: every input passes here once
            const __m256i xe = _mm256_and_si256(_mm256_castps_si256(xd), in_mask);
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(xe, in_mask));
            const __m256 b = bf16_round8(xd);
            __m256 r = bf16_round8(_mm256_loadu_ps(xh + (first ? d + h : d - h)));
            if (first) r = _mm256_xor_ps(r, neg);
            const __m256 a = bf16_round8(_mm256_mul_ps(b, load8(cos + d)));
            const __m256 c = bf16_round8(_mm256_mul_ps(r, load8(sin + d)));
            const __m256i o = _mm256_srli_epi32(_mm256_castps_si256(bf16_round8(_mm256_add_ps(a, c))), 16);
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(o, exp_mask), exp_mask));
            const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(o, o), 0xD8);  // 8 u16 in the low half
            _mm_storeu_si128((__m128i*)(oh + d), _mm256_castsi256_si128(p));
        }
    }
    return !_mm256_testz_si256(bad, bad);
}

}  // namespace spk
