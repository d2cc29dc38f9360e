// The portable predictor's per-element stages (speckv/predictor/integer.py, int_attention.py): the
// same integers and single IEEE operations, in the same order, as the torch reference there.
//
// Softmax numerators, one row of scores:
//
//   d   = S_max - S_j                     int32, j <= pos (causal); S_max over those keys
//   idx = floor(float(d) * Mf)            one correctly rounded float32 product; d < 2^24 is exact
//   e   = idx < EXP_LEN ? EXP[idx] : 0    e < 2^(2 split)
//   hi  = e >> split, lo = e & (2^split - 1)   int8 halves for the two int8 P @ V products
//   sum = sum_j e                         int64
//
// NOTE: no FMA can form here (a product then a compare); the build passes -ffp-contract=off anyway.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "spk_simd.h"

namespace spk {

// One row: scores s[0..n), keys <= pos valid (pos may be >= n: all keys). NOTE: the table's last
// entry is 0 (integer.py's tables), so clamping idx to exp_len - 1 is "0 from EXP_LEN on" without a branch.
SPK_INLINE int32_t row_max(const int32_t* s, int m) {
    int32_t smax = INT32_MIN;
    for (int j = 0; j < m; ++j) smax = s[j] > smax ? s[j] : smax;
    return smax;
}

// Numerators of keys [j0, m), zeros for [m, n); returns their sum (< 2^12 per key, MAX_TOKENS =
// 2^17 keys: int_attention.py checks). NOTE: an int counter and restrict pointers help GCC.
SPK_INLINE int32_t numerators(const int32_t* __restrict s, int j0, int m, int64_t n, int32_t smax, float mf,
                              const int32_t* __restrict table, int32_t exp_len, int split,
                              int8_t* __restrict hi, int8_t* __restrict lo) {
    const float lim = (float)(exp_len - 1);
    const int32_t mask = (1 << split) - 1;
    int32_t sum = 0;
    for (int j = j0; j < m; ++j) {
        const float x = (float)(smax - s[j]) * mf;
        const int32_t e = table[(int)(x < lim ? x : lim)];  // x >= 0: truncation is floor
        hi[j] = (int8_t)(e >> split);
        lo[j] = (int8_t)(e & mask);
        sum += e;
    }
    if (m < n) {
        std::memset(hi + m, 0, (size_t)(n - m));
        std::memset(lo + m, 0, (size_t)(n - m));
    }
    return sum;
}

SPK_INLINE int64_t softmax_row_body(const int32_t* s, int64_t n, int64_t pos, float mf, const int32_t* table,
                                    int32_t exp_len, int split, int8_t* hi, int8_t* lo) {
    const int m = (int)std::min<int64_t>(pos + 1, n);
    return numerators(s, 0, m, n, row_max(s, m), mf, table, exp_len, split, hi, lo);
}

#if SPK_HAVE_AVX2_BUILD
// The same row with explicit AVX2 (GCC does not vectorise the table gather): 8 keys per step, the
// scalar body's operations lane by lane (cvtepi32_ps exact below 2^24, one mul_ps, min_ps(x, lim)
// = x < lim ? x : lim, cvttps truncation), then the body for the tail.
SPK_AVX2 inline int64_t softmax_row_avx2(const int32_t* s, int64_t n, int64_t pos, float mf, const int32_t* table,
                                         int32_t exp_len, int split, int8_t* hi, int8_t* lo) {
    const int m = (int)std::min<int64_t>(pos + 1, n);
    const int32_t smax = row_max(s, m);
    const __m256i vmax = _mm256_set1_epi32(smax), vmask = _mm256_set1_epi32((1 << split) - 1);
    const __m256 vmf = _mm256_set1_ps(mf), vlim = _mm256_set1_ps((float)(exp_len - 1));
    __m256i vsum = _mm256_setzero_si256();
    int j = 0;
    for (; j + 8 <= m; j += 8) {
        const __m256i d = _mm256_sub_epi32(vmax, _mm256_loadu_si256((const __m256i*)(s + j)));
        const __m256 x = _mm256_min_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(d), vmf), vlim);
        const __m256i e = _mm256_i32gather_epi32(table, _mm256_cvttps_epi32(x), 4);
        vsum = _mm256_add_epi32(vsum, e);
        const __m256i h = _mm256_srai_epi32(e, split), l = _mm256_and_si256(e, vmask);
        const __m256i hb = _mm256_packs_epi16(_mm256_packs_epi32(h, h), _mm256_setzero_si256());
        const __m256i lb = _mm256_packs_epi16(_mm256_packs_epi32(l, l), _mm256_setzero_si256());
        const int32_t h0 = _mm256_extract_epi32(hb, 0), h1 = _mm256_extract_epi32(hb, 4);
        const int32_t l0 = _mm256_extract_epi32(lb, 0), l1 = _mm256_extract_epi32(lb, 4);
        std::memcpy(hi + j, &h0, 4), std::memcpy(hi + j + 4, &h1, 4);
        std::memcpy(lo + j, &l0, 4), std::memcpy(lo + j + 4, &l1, 4);
    }
    alignas(32) int32_t part[8];
    _mm256_store_si256((__m256i*)part, vsum);
    const int32_t sum = part[0] + part[1] + part[2] + part[3] + part[4] + part[5] + part[6] + part[7];
    return sum + numerators(s, j, m, n, smax, mf, table, exp_len, split, hi, lo);
}
#else
inline int64_t softmax_row_avx2(const int32_t* s, int64_t n, int64_t pos, float mf, const int32_t* table,
                                int32_t exp_len, int split, int8_t* hi, int8_t* lo) {
    return softmax_row_body(s, n, pos, mf, table, exp_len, split, hi, lo);
}
#endif

inline int64_t int_softmax_row(const int32_t* s, int64_t n, int64_t pos, float mf, const int32_t* table,
                               int32_t exp_len, int split, int8_t* hi, int8_t* lo, bool scalar = false) {
    if (!scalar && cpu_has_avx2()) return softmax_row_avx2(s, n, pos, mf, table, exp_len, split, hi, lo);
    return softmax_row_body(s, n, pos, mf, table, exp_len, split, hi, lo);
}

// nearbyint in the default rounding mode (to nearest, ties to even) without a libm call: below 2^52,
// |x| + 2^52 lands where the spacing is 1, so the addition rounds it; the subtraction is exact.
// NOTE: needs -fno-fast-math (no reassociation), as the build sets; the sign of a zero may differ
// from nearbyint's, which no integer conversion sees.
inline double round_even(double x) {
    constexpr double BIG = 4503599627370496.0;  // 2^52
    const double a = std::fabs(x);
    return a >= BIG ? x : std::copysign((a + BIG) - BIG, x);
}

// A row of int64 fixed point times the norm weights w (or none): xf = x (* w), one IEEE product per
// element; returns max |xf| (exact in any order).
SPK_INLINE double wide_scale_row(const int64_t* x, const double* w, int64_t k, double* xf) {
    double amax = 0.0;
    for (int64_t j = 0; j < k; ++j) {
        xf[j] = w ? (double)x[j] * w[j] : (double)x[j];
        const double a = std::fabs(xf[j]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

// Wide row quantisation (integer.quantise_wide): xf = x (* w), q = nearbyint(xf * (WIDE_MAX / amax)),
// hi = (q + 2^(split-1)) >> split, lo = q - hi * 2^split. Returns amax.
SPK_INLINE double wide_quantise_body(const int64_t* x, const double* w, int64_t k, double wide_max, int split,
                                     int8_t* hi, int8_t* lo, double* xf) {
    const double amax = wide_scale_row(x, w, k, xf);
    const double inv = amax > 0 ? wide_max / amax : 0.0;
    for (int64_t j = 0; j < k; ++j) {
        const int64_t q = (int64_t)round_even(xf[j] * inv);
        const int64_t h = (q + (int64_t(1) << (split - 1))) >> split;
        hi[j] = (int8_t)h;
        lo[j] = (int8_t)(q - (h << split));
    }
    return amax;
}

// Wide dequantisation of one row (integer.dequantise of wide_linear_acc): out = nearbyint((acc * row) * ws)
// (+ add), acc = (hi << split) + lo already composed by wide_dequant_rows.
SPK_INLINE void wide_dequant_body(const int64_t* acc, int64_t n, double row, const double* ws, const int64_t* add,
                                  int64_t* out) {
    for (int64_t j = 0; j < n; ++j) {
        const int64_t v = (int64_t)round_even(((double)acc[j] * row) * ws[j]);
        out[j] = add ? add[j] + v : v;
    }
}

SPK_AVX2 inline double wide_quantise_avx2(const int64_t* x, const double* w, int64_t k, double wide_max, int split,
                                          int8_t* hi, int8_t* lo, double* xf) {
    return wide_quantise_body(x, w, k, wide_max, split, hi, lo, xf);
}

SPK_AVX2 inline void wide_dequant_avx2(const int64_t* acc, int64_t n, double row, const double* ws,
                                       const int64_t* add, int64_t* out) {
    wide_dequant_body(acc, n, row, ws, add, out);
}

inline double wide_quantise_row(const int64_t* x, const double* w, int64_t k, double wide_max, int split,
                                int8_t* hi, int8_t* lo, double* xf) {
    if (cpu_has_avx2()) return wide_quantise_avx2(x, w, k, wide_max, split, hi, lo, xf);
    return wide_quantise_body(x, w, k, wide_max, split, hi, lo, xf);
}

// Rows [i0, i1) of the wide dequantisation from the int32 product (n, 2m) of w8 @ [hi; lo]^T: the
// rows' accumulators are gathered (a transposition) into acc (i1 - i0, n) first, then each row runs.
inline void wide_dequant_rows(const int32_t* prod, int64_t m, int64_t n, int split, const double* row,
                              const double* ws, const int64_t* add, int64_t* out, int64_t i0, int64_t i1,
                              int64_t* acc) {
    const int64_t r = i1 - i0;
    for (int64_t j = 0; j < n; ++j) {
        const int32_t* ph = prod + j * 2 * m + i0;
        const int32_t* pl = ph + m;
        for (int64_t ii = 0; ii < r; ++ii) acc[ii * n + j] = ((int64_t)ph[ii] << split) + pl[ii];
    }
    const bool avx2 = cpu_has_avx2();
    for (int64_t ii = 0; ii < r; ++ii) {
        const int64_t i = i0 + ii;
        const int64_t* a = add ? add + i * n : nullptr;
        if (avx2) wide_dequant_avx2(acc + ii * n, n, row[i], ws, a, out + i * n);
        else wide_dequant_body(acc + ii * n, n, row[i], ws, a, out + i * n);
    }
}

// The gated MLP's product (integer.silu_mul): m = round_shift(silu(g) * u, frac) with silu from the table
// over idx = round_shift(g, frac - step) + range * 2^step in [0, len): g itself above it, 0 below.
SPK_INLINE void silu_mul_body(const int64_t* g, const int64_t* u, int64_t n, const int64_t* table, int64_t len,
                              int frac, int step_bits, int64_t range, int64_t* out) {
    const int step = frac - step_bits;
    const int64_t off = range << step_bits, half_step = int64_t(1) << (step - 1), half = int64_t(1) << (frac - 1);
    for (int64_t j = 0; j < n; ++j) {
        const int64_t idx = ((g[j] + half_step) >> step) + off;
        const int64_t c = idx < 0 ? 0 : (idx >= len ? len - 1 : idx);
        const int64_t s = idx >= len ? g[j] : (idx < 0 ? 0 : table[c]);
        // NOTE: wrapping unsigned arithmetic, as torch's int64 ops (signed overflow is UB in C++)
        out[j] = (int64_t)((uint64_t)s * (uint64_t)u[j] + (uint64_t)half) >> frac;
    }
}

SPK_AVX2 inline void silu_mul_avx2(const int64_t* g, const int64_t* u, int64_t n, const int64_t* table, int64_t len,
                                   int frac, int step_bits, int64_t range, int64_t* out) {
    silu_mul_body(g, u, n, table, len, frac, step_bits, range, out);
}

inline void silu_mul_row(const int64_t* g, const int64_t* u, int64_t n, const int64_t* table, int64_t len, int frac,
                         int step_bits, int64_t range, int64_t* out) {
    if (cpu_has_avx2()) return silu_mul_avx2(g, u, n, table, len, frac, step_bits, range, out);
    silu_mul_body(g, u, n, table, len, frac, step_bits, range, out);
}

// ---------------------------------------------------------------- q, k, v of a layer (integer.split_qkv)

// round(x / 2^bits), halves up, in int64 with torch's wrapping products (integer.round_shift)
SPK_INLINE int64_t round_shift64(uint64_t x, int bits) { return (int64_t)(x + (uint64_t(1) << (bits - 1))) >> bits; }

// Rotary embedding of one head's row x (D) at one position (integer.rope): int tables c, s (D / 2).
inline void rope_row(const int64_t* x, const int32_t* c, const int32_t* s, int64_t D, int frac, int64_t* out) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; ++i) {
        const uint64_t x1 = (uint64_t)x[i], x2 = (uint64_t)x[half + i], ci = (uint64_t)(int64_t)c[i],
                       si = (uint64_t)(int64_t)s[i];
        out[i] = round_shift64(x1 * ci - x2 * si, frac);
        out[half + i] = round_shift64(x2 * ci + x1 * si, frac);
    }
}

// BF16 bits of int64 fixed-point x with unit = 2^-frac (frac fractional bits), rounded once to nearest even in
// integers (integer.to_bf16): 8 significant bits kept, so the float conversions are exact.
inline uint16_t to_bf16_bits(int64_t x, double unit) {
    const uint64_t a = x < 0 ? (uint64_t)0 - (uint64_t)x : (uint64_t)x;
    int e = 0;  // frexp's exponent of double(a): a's bit length while a converts exactly
    if (a < (uint64_t(1) << 53)) e = a ? 64 - __builtin_clzll(a) : 0;
    else std::frexp((double)(int64_t)a, &e);
    const int shift = std::max(e - 8, 0);
    const uint64_t q = a >> shift, rem = a - (q << shift), half = shift > 0 ? uint64_t(1) << (shift - 1) : 0;
    const bool up = rem > half || (rem == half && shift > 0 && (q & 1));
    const int64_t r = (int64_t)((q + (up ? 1 : 0)) << shift);
    const float f = (float)((double)(x < 0 ? -r : r) * unit);  // unit = 2^-frac: a product, as torch's
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return (uint16_t)(bits >> 16);
}

// One token t of a layer's fused projection row (H query heads, then Hk keys, then Hk values, D each):
// q and k roped into q (H, D) and k (Hk, D), v copied into v (Hk, D), and k, v as BF16 into mu
// (2, Hk, T, D) at token t.
inline void split_qkv_row(const int64_t* row, const int32_t* c, const int32_t* s, int64_t H, int64_t Hk, int64_t D,
                          int64_t T, int64_t t, int rope_frac, int frac, int64_t* q, int64_t* k, int64_t* v,
                          uint16_t* mu) {
    for (int64_t h = 0; h < H; ++h) rope_row(row + h * D, c, s, D, rope_frac, q + h * D);
    for (int64_t g = 0; g < Hk; ++g) {
        rope_row(row + (H + g) * D, c, s, D, rope_frac, k + g * D);
        std::memcpy(v + g * D, row + (H + Hk + g) * D, sizeof(int64_t) * D);
        uint16_t* mk = mu + (g * T + t) * D;
        uint16_t* mv = mu + ((Hk + g) * T + t) * D;
        const double unit = std::ldexp(1.0, -frac);
        for (int64_t d = 0; d < D; ++d) mk[d] = to_bf16_bits(k[g * D + d], unit), mv[d] = to_bf16_bits(v[g * D + d], unit);
    }
}

}  // namespace spk
