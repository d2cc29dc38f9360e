// The portable rung's causal attention in integers, whole (speckv/predictor/int_attention.py is the
// torch reference; both give the same bits). Per kv head g and its query heads (GQA):
//
//   k8 = nearbyint(k * (64 / ak_d)),  ks_d = ak_d / 64       int8 per channel d over the prompt
//   v8 = nearbyint(v * (127 / av_d)), vs_d = av_d / 127
//   q'  = double(q) * ks_d;  q8 = nearbyint(q' * (127 / aq_i))      int8 per (token, head)
//   mf_i = float32(((aq_i / 127) * 2^(EXP_STEP_BITS - SCORE_SHIFT)) / sqrt(D))
//   S_ij = sum_d q8_id k8_jd                                 int32, exact; keys j <= i
//   e_ij = EXP[min(floor(float32(max_j S_ij - S_ij) * mf_i), len - 1)]    the table ends with 0
//   o_id = nearbyint((double(sum_j e_ij v8_jd) * vs_d) / double(sum_j e_ij))
//
// The reference splits e = hi * 2^6 + lo for two int8 products; sum_j e v8 is the same integer.
// NOTE: every float step is one IEEE operation on one element (-ffp-contract=off), so the VNNI
// path, the scalar path and torch agree bit for bit. The VNNI scores take q8 + 128 as uint8
// (vpdpbusd) and 128 * sum_d k8 back off; P @ V takes e as int16 pairs (vpdpwssd) and moves its
// int32 sums to int64 every IATT_FLUSH keys (4095 * 127 * 4096 < 2^31).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "spk_wide.h"

namespace spk {

constexpr int IATT_ROWS = 16;         // query rows per task
constexpr int64_t IATT_FLUSH = 4096;  // keys per int32 P @ V sum
constexpr int IATT_MAX_D = 128;       // the VNNI path: D a multiple of 16, at most this
constexpr double IATT_SCORE_UNIT = 1.0 / (double)(int64_t(1) << 24);  // 2^(EXP_STEP_BITS - SCORE_SHIFT) = 2^(8 - 32)

// One kv head, quantised per channel: k8, v8 (T, D); ks, vs (D); the VNNI layouts when built.
struct IattHead {
    std::vector<int8_t> k8, v8;
    std::vector<double> ks, vs;
    std::vector<int8_t> k4;     // (keys / 16, D / 4, 16, 4), keys padded to 16
    std::vector<int32_t> ksum;  // 128 * sum_d k8 per key
    std::vector<int16_t> v2;    // (keys / 2, D, 2), keys padded to 16
};

// Channel d of x (T rows of stride `stride`) -> nearbyint(x * (qmax / a_d)) and a_d / qmax.
inline void iatt_channel_quantise(const int64_t* x, int64_t T, int64_t stride, int64_t D, double qmax,
                                  std::vector<int8_t>& q, std::vector<double>& s) {
    std::vector<double> amax((size_t)D, 0.0), inv((size_t)D);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < D; ++d) amax[d] = std::max(amax[d], std::fabs((double)x[t * stride + d]));
    q.resize((size_t)(T * D));
    s.resize((size_t)D);
    for (int64_t d = 0; d < D; ++d) {
        inv[d] = amax[d] > 0 ? qmax / amax[d] : 0.0;
        s[d] = amax[d] / qmax;
    }
    for (int64_t t = 0; t < T; ++t)
        for (int64_t d = 0; d < D; ++d) q[t * D + d] = (int8_t)round_even((double)x[t * stride + d] * inv[d]);
}

inline void iatt_prepare(const int64_t* k, const int64_t* v, int64_t T, int64_t stride, int64_t D, bool vnni,
                         IattHead& h) {
    iatt_channel_quantise(k, T, stride, D, 64.0, h.k8, h.ks);
    iatt_channel_quantise(v, T, stride, D, 127.0, h.v8, h.vs);
    if (!vnni) return;
    const int64_t Tp = wide_pad(T, 16);
    h.k4.assign((size_t)(Tp * D), 0);
    h.ksum.assign((size_t)Tp, 0);
    h.v2.assign((size_t)(Tp * D), 0);
    for (int64_t t = 0; t < T; ++t) {
        int32_t sum = 0;
        for (int64_t d = 0; d < D; ++d) {
            sum += h.k8[t * D + d];
            h.k4[(((t / 16) * (D / 4) + d / 4) * 16 + t % 16) * 4 + d % 4] = h.k8[t * D + d];
            h.v2[((t / 2) * D + d) * 2 + t % 2] = h.v8[t * D + d];
        }
        h.ksum[t] = 128 * sum;
    }
}

// Query row q (D int64) of a head on kv head h -> q8 (D); returns mf.
inline float iatt_query(const int64_t* q, const IattHead& h, int64_t D, int8_t* q8) {
    thread_local std::vector<double> qf;
    qf.resize((size_t)D);
    double amax = 0.0;
    for (int64_t d = 0; d < D; ++d) {
        qf[d] = (double)q[d] * h.ks[d];
        amax = std::max(amax, std::fabs(qf[d]));
    }
    const double inv = amax > 0 ? 127.0 / amax : 0.0;
    for (int64_t d = 0; d < D; ++d) q8[d] = (int8_t)round_even(qf[d] * inv);
    return (float)(((amax / 127.0) * IATT_SCORE_UNIT) / std::sqrt((double)D));
}

// Numerators of one row's scores s[0..m) (keys <= i) into e (int16); returns their sum.
inline int64_t iatt_numerators(const int32_t* s, int64_t m, float mf, const int32_t* table, int32_t len, int16_t* e) {
    const int32_t smax = row_max(s, (int)m);  // spk_portable.h's exp stage
    const float lim = (float)(len - 1);
    int64_t sum = 0;
    for (int64_t j = 0; j < m; ++j) {
        const float x = (float)(smax - s[j]) * mf;
        e[j] = (int16_t)table[(int)(x < lim ? x : lim)];  // x >= 0: truncation is floor
        sum += e[j];
    }
    return sum;
}

inline void iatt_out(const int64_t* acc, const IattHead& h, int64_t D, int64_t sum, int64_t* o) {
    for (int64_t d = 0; d < D; ++d) o[d] = (int64_t)round_even(((double)acc[d] * h.vs[d]) / (double)sum);
}

// The scalar path: rows [i0, i1) of the query head at q (row stride q_stride), output rows of o_stride.
inline void iatt_rows_scalar(const IattHead& h, const int64_t* q, int64_t q_stride, int64_t D, const int32_t* table,
                             int32_t len, int64_t i0, int64_t i1, int64_t* o, int64_t o_stride) {
    std::vector<int8_t> q8((size_t)D);
    std::vector<int32_t> s((size_t)i1);
    std::vector<int16_t> e((size_t)i1);
    std::vector<int64_t> acc((size_t)D);
    for (int64_t i = i0; i < i1; ++i) {
        const float mf = iatt_query(q + i * q_stride, h, D, q8.data());
        for (int64_t j = 0; j <= i; ++j) {
            int32_t a = 0;
            for (int64_t d = 0; d < D; ++d) a += (int32_t)q8[d] * h.k8[j * D + d];
            s[j] = a;
        }
        const int64_t sum = iatt_numerators(s.data(), i + 1, mf, table, len, e.data());
        std::fill(acc.begin(), acc.end(), 0);
        for (int64_t j = 0; j <= i; ++j)
            for (int64_t d = 0; d < D; ++d) acc[d] += (int64_t)e[j] * h.v8[j * D + d];
        iatt_out(acc.data(), h, D, sum, o + i * o_stride);
    }
}

// ------------------------------------------------------------------ AVX-512 VNNI

#define SPK_IATT_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// acc r0..r{N-1} += op(b, x0..x{N-1}): named vectors, as GCC spills an array of vectors to the stack here.
#define SPK_IATT_DP4(op, N, r, b, x)                 \
    r##0 = op(r##0, b, x##0);                        \
    if constexpr (N > 1) r##1 = op(r##1, b, x##1);   \
    if constexpr (N > 2) r##2 = op(r##2, b, x##2);   \
    if constexpr (N > 3) r##3 = op(r##3, b, x##3);

// The 32-bit word at p, broadcast to 16 lanes.
SPK_IATT_VNNI inline __m512i iatt_bcast(const void* p) {
    int32_t w;
    std::memcpy(&w, p, 4);
    return _mm512_set1_epi32(w);
}

// Scores of 4 query rows (qu: q8 + 128, (4, D)) against key groups [g0, g0 + NG) of 16 (s rows of
// stride ss): each q broadcast feeds NG key groups. NOTE: named accumulators (see iatt_pv4_cols).
template <int NG>
SPK_IATT_VNNI inline void iatt_scores4_g(const IattHead& h, const uint8_t* qu, int64_t D, int64_t g0, int32_t* s,
                                         int64_t ss) {
    const int64_t D4 = D / 4;
    const __m512i z = _mm512_setzero_si512();
    __m512i a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z;
    __m512i c0 = z, c1 = z, c2 = z, c3 = z, d0 = z, d1 = z, d2 = z, d3 = z;
    __m512i k0 = z, k1 = z, k2 = z, k3 = z;
    const int8_t* kg = h.k4.data() + g0 * D4 * 64;
    for (int64_t d4 = 0; d4 < D4; ++d4) {
        k0 = _mm512_loadu_si512((const void*)(kg + d4 * 64));
        if constexpr (NG > 1) k1 = _mm512_loadu_si512((const void*)(kg + (D4 + d4) * 64));
        if constexpr (NG > 2) k2 = _mm512_loadu_si512((const void*)(kg + (2 * D4 + d4) * 64));
        if constexpr (NG > 3) k3 = _mm512_loadu_si512((const void*)(kg + (3 * D4 + d4) * 64));
        const uint8_t* qd = qu + d4 * 4;
        const __m512i q0 = iatt_bcast(qd), q1 = iatt_bcast(qd + D), q2 = iatt_bcast(qd + 2 * D), q3 = iatt_bcast(qd + 3 * D);
        SPK_IATT_DP4(_mm512_dpbusd_epi32, NG, a, q0, k)
        SPK_IATT_DP4(_mm512_dpbusd_epi32, NG, b, q1, k)
        SPK_IATT_DP4(_mm512_dpbusd_epi32, NG, c, q2, k)
        SPK_IATT_DP4(_mm512_dpbusd_epi32, NG, d, q3, k)
    }
    const __m512i acc[4][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}, {c0, c1, c2, c3}, {d0, d1, d2, d3}};
    for (int g = 0; g < NG; ++g) {
        const __m512i ksum = _mm512_loadu_si512((const void*)(h.ksum.data() + (g0 + g) * 16));
        for (int r = 0; r < 4; ++r)
            _mm512_storeu_si512((void*)(s + r * ss + (g0 + g) * 16), _mm512_sub_epi32(acc[r][g], ksum));
    }
}

// Scores of 4 query rows against key groups [0, groups) of 16, 4 groups per pass.
SPK_IATT_VNNI inline void iatt_scores4(const IattHead& h, const uint8_t* qu, int64_t D, int64_t groups, int32_t* s,
                                       int64_t ss) {
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) iatt_scores4_g<4>(h, qu, D, g, s, ss);
    for (; g < groups; ++g) iatt_scores4_g<1>(h, qu, D, g, s, ss);
}

// iatt_numerators with AVX-512 (e zeroed by the caller): 16 keys per step, the same operations lane by
// lane (cvtepi32_ps exact below 2^24, one mul_ps, min_ps(x, lim) = x < lim ? x : lim, cvttps truncation);
// the table is 0 from zero_from on (iatt_zero_from).
SPK_IATT_VNNI inline int64_t iatt_numerators_v(const int32_t* s, int64_t m, float mf, const int32_t* table,
                                               int32_t len, int32_t zero_from, int16_t* e) {
    __m512i vmax = _mm512_set1_epi32(INT32_MIN);
    for (int64_t j = 0; j < m; j += 16) {
        const __mmask16 k = (__mmask16)(m - j >= 16 ? 0xFFFF : (1u << (m - j)) - 1u);
        vmax = _mm512_mask_max_epi32(vmax, k, vmax, _mm512_maskz_loadu_epi32(k, s + j));
    }
    const __m512i smax = _mm512_set1_epi32(_mm512_reduce_max_epi32(vmax));
    const __m512 vmf = _mm512_set1_ps(mf), lim = _mm512_set1_ps((float)(len - 1));
    const __m512 dead = _mm512_set1_ps((float)zero_from);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t j = 0; j < m; j += 16) {
        const __mmask16 k = (__mmask16)(m - j >= 16 ? 0xFFFF : (1u << (m - j)) - 1u);
        const __m512i d = _mm512_sub_epi32(smax, _mm512_maskz_loadu_epi32(k, s + j));
        const __m512 x = _mm512_min_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), vmf), lim);
        // NOTE: lanes at or past zero_from read 0: no gather (far below the row's maximum: most keys)
        const __mmask16 live = k & _mm512_cmp_ps_mask(x, dead, _CMP_LT_OQ);
        if (!live) continue;  // e stays 0
        const __m512i ev = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, _mm512_cvttps_epi32(x), table, 4);
        sum = _mm512_add_epi32(sum, ev);  // NOTE: < 4096 * MAX_TOKENS < 2^31 per lane
        _mm256_mask_storeu_epi16(e + j, k, _mm512_cvtepi32_epi16(ev));
    }
    return _mm512_reduce_add_epi32(sum);
}

// Where the exp table's zero tail starts (its last entries round to 0).
inline int32_t iatt_zero_from(const int32_t* table, int32_t len) {
    int32_t z = len - 1;
    while (z > 0 && table[z - 1] == 0) --z;
    return z;
}

// iatt_query with AVX-512 (D a multiple of 8): the same operations lane by lane.
SPK_IATT_VNNI inline float iatt_query_v(const int64_t* q, const IattHead& h, int64_t D, int8_t* q8) {
    alignas(64) double qf[IATT_MAX_D];
    __m512d vmax = _mm512_setzero_pd();
    for (int64_t d = 0; d < D; d += 8) {
        const __m512d f = _mm512_mul_pd(_mm512_cvtepi64_pd(_mm512_loadu_si512((const void*)(q + d))),
                                        _mm512_loadu_pd(h.ks.data() + d));
        _mm512_store_pd(qf + d, f);
        vmax = _mm512_max_pd(vmax, _mm512_abs_pd(f));
    }
    const double amax = _mm512_reduce_max_pd(vmax);
    const __m512d inv = _mm512_set1_pd(amax > 0 ? 127.0 / amax : 0.0);
    for (int64_t d = 0; d < D; d += 8) {
        const __m512d y = _mm512_roundscale_pd(_mm512_mul_pd(_mm512_load_pd(qf + d), inv),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storel_epi64((__m128i*)(q8 + d), _mm512_cvtepi64_epi8(_mm512_cvtpd_epi64(y)));
    }
    return (float)(((amax / 127.0) * IATT_SCORE_UNIT) / std::sqrt((double)D));
}

// iatt_out with AVX-512 (D a multiple of 8).
SPK_IATT_VNNI inline void iatt_out_v(const int64_t* acc, const IattHead& h, int64_t D, int64_t sum, int64_t* o) {
    const __m512d den = _mm512_set1_pd((double)sum);
    for (int64_t d = 0; d < D; d += 8) {
        const __m512d y = _mm512_div_pd(_mm512_mul_pd(_mm512_cvtepi64_pd(_mm512_loadu_si512((const void*)(acc + d))),
                                                      _mm512_loadu_pd(h.vs.data() + d)), den);
        _mm512_storeu_si512((void*)(o + d),
                            _mm512_cvtpd_epi64(_mm512_roundscale_pd(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
    }
}

// Whether the 4 rows' numerators of keys [j, j + 16) are all 0 (far below each row's maximum).
SPK_IATT_VNNI inline bool iatt_zero16(const int16_t* e, int64_t es, int64_t j) {
    __m256i any = _mm256_loadu_si256((const __m256i*)(e + j));
    for (int r = 1; r < 4; ++r) any = _mm256_or_si256(any, _mm256_loadu_si256((const __m256i*)(e + r * es + j)));
    return _mm256_testz_si256(any, any);
}

// Keys [j0, j1) of channels [cb * 16, cb * 16 + 16 * C4) (C4 <= 4) for 4 rows (e rows of stride es):
// int32 sums added to acc (4, D). NOTE: 16 named accumulators: GCC spills an array of vectors here.
template <int C4>
SPK_IATT_VNNI inline void iatt_pv4_cols(const int16_t* v2s, int64_t D, int64_t cb, const int16_t* e, int64_t es,
                                        int64_t j0, int64_t j1, int64_t* acc) {
    const __m512i z = _mm512_setzero_si512();
    __m512i a0 = z, a1 = z, a2 = z, a3 = z, b0 = z, b1 = z, b2 = z, b3 = z;
    __m512i c0 = z, c1 = z, c2 = z, c3 = z, d0 = z, d1 = z, d2 = z, d3 = z;
    __m512i v0 = z, v1 = z, v2 = z, v3 = z;
    for (int64_t g = j0; g < j1; g += 16) {
        if (iatt_zero16(e, es, g)) continue;  // no row weighs these 16 keys: they add 0
#pragma GCC unroll 8
        for (int64_t j = g; j < g + 16; j += 2) {
            const int16_t* vj = v2s + ((j / 2) * D + 16 * cb) * 2;
            v0 = _mm512_loadu_si512((const void*)vj);
            if constexpr (C4 > 1) v1 = _mm512_loadu_si512((const void*)(vj + 32));
            if constexpr (C4 > 2) v2 = _mm512_loadu_si512((const void*)(vj + 64));
            if constexpr (C4 > 3) v3 = _mm512_loadu_si512((const void*)(vj + 96));
            const int16_t* ej = e + j;
            const __m512i e0 = iatt_bcast(ej), e1 = iatt_bcast(ej + es), e2 = iatt_bcast(ej + 2 * es),
                          e3 = iatt_bcast(ej + 3 * es);
            SPK_IATT_DP4(_mm512_dpwssd_epi32, C4, a, e0, v)
            SPK_IATT_DP4(_mm512_dpwssd_epi32, C4, b, e1, v)
            SPK_IATT_DP4(_mm512_dpwssd_epi32, C4, c, e2, v)
            SPK_IATT_DP4(_mm512_dpwssd_epi32, C4, d, e3, v)
        }
    }
    const __m512i out[4][4] = {{a0, a1, a2, a3}, {b0, b1, b2, b3}, {c0, c1, c2, c3}, {d0, d1, d2, d3}};
    for (int r = 0; r < 4; ++r)
        for (int c = 0; c < C4; ++c) {
            alignas(64) int32_t part[16];
            _mm512_store_si512((void*)part, out[r][c]);
            for (int l = 0; l < 16; ++l) acc[r * D + 16 * (cb + c) + l] += part[l];
        }
}
#undef SPK_IATT_DP4

// sum_j e_rj v8_jd for 4 rows over keys [0, n) (n a multiple of 16; e zero past each row's keys) into
// int64 acc (4, D), C = D / 16: int32 sums moved to acc every IATT_FLUSH keys.
template <int C>
SPK_IATT_VNNI inline void iatt_pv4(const IattHead& h, const int16_t* e, int64_t es, int64_t n, int64_t* acc) {
    constexpr int64_t D = 16 * C;
    std::memset(acc, 0, sizeof(int64_t) * 4 * D);
    for (int64_t j0 = 0; j0 < n; j0 += IATT_FLUSH)
        for (int64_t cb = 0; cb < C; cb += 4)
            iatt_pv4_cols<(C < 4 ? C : 4)>(h.v2.data(), D, cb, e, es, j0, std::min(n, j0 + IATT_FLUSH), acc);
}

// The VNNI path: rows [i0, i1) of one query head, 4 at a time.
template <int C>
SPK_IATT_VNNI inline void iatt_rows_vnni_c(const IattHead& h, const int64_t* q, int64_t q_stride,
                                           const int32_t* table, int32_t len, int64_t i0, int64_t i1, int64_t* o,
                                           int64_t o_stride) {
    constexpr int64_t D = 16 * C;
    const int64_t n = wide_pad(i1, 16);  // keys the tile's last row may see, padded
    std::vector<int32_t> s((size_t)(4 * n));
    std::vector<int16_t> e((size_t)(4 * n));
    alignas(64) uint8_t qu[4 * D];
    alignas(64) int64_t acc[4 * D];
    int8_t q8[D];
    float mf[4];
    int64_t sum[4];
    const int32_t zero_from = iatt_zero_from(table, len);
    for (int64_t r0 = i0; r0 < i1; r0 += 4) {
        const int rows = (int)std::min<int64_t>(4, i1 - r0);
        std::memset(qu, 128, sizeof(qu));
        for (int r = 0; r < rows; ++r) {
            mf[r] = iatt_query_v(q + (r0 + r) * q_stride, h, D, q8);
            for (int64_t d = 0; d < D; ++d) qu[r * D + d] = (uint8_t)(q8[d] + 128);
        }
        const int64_t m = wide_pad(r0 + rows, 16);  // keys this group of rows sees, padded
        iatt_scores4(h, qu, D, m / 16, s.data(), n);
        std::memset(e.data(), 0, sizeof(int16_t) * 4 * n);
        for (int r = 0; r < rows; ++r)
            sum[r] = iatt_numerators_v(s.data() + r * n, r0 + r + 1, mf[r], table, len, zero_from, e.data() + r * n);
        iatt_pv4<C>(h, e.data(), n, m, acc);
        for (int r = 0; r < rows; ++r) iatt_out_v(acc + r * D, h, D, sum[r], o + (r0 + r) * o_stride);
    }
}

SPK_IATT_VNNI inline void iatt_rows_vnni(const IattHead& h, const int64_t* q, int64_t q_stride, int64_t D,
                                         const int32_t* table, int32_t len, int64_t i0, int64_t i1, int64_t* o,
                                         int64_t o_stride) {
    switch (D / 16) {
        case 1: return iatt_rows_vnni_c<1>(h, q, q_stride, table, len, i0, i1, o, o_stride);
        case 2: return iatt_rows_vnni_c<2>(h, q, q_stride, table, len, i0, i1, o, o_stride);
        case 4: return iatt_rows_vnni_c<4>(h, q, q_stride, table, len, i0, i1, o, o_stride);
        case 8: return iatt_rows_vnni_c<8>(h, q, q_stride, table, len, i0, i1, o, o_stride);
        default: return iatt_rows_scalar(h, q, q_stride, D, table, len, i0, i1, o, o_stride);
    }
}

}  // namespace spk
