// The portable rung's linear in one pass (speckv/predictor/integer.py, wide_linear): the row
// quantisation, the integer product and the dequantisation fused, so the int32 products never go
// through memory. The torch code there is the reference; both give the same bits.
//
// Per row i of int64 fixed-point x (M, K), with the norm weights w (or none) and 1 / rms folded in
// (rms given, or computed here from an exact integer sum of squares: wide_rms):
//
//   xf_ik  = double(x_ik) * w_k                    one IEEE product per element (none without w)
//   a_i    = max_k |xf_ik|                         exact in any order
//   q_ik   = nearbyint(xf_ik * (WIDE_MAX / a_i))   14 bits: |q| <= 2^13 (0 when a_i = 0)
//   acc_ij = sum_k w8_jk q_ik                      int32, exact: 127 * 2^13 * K < 2^31 for K <= 2048
//   y_ij   = nearbyint((double(acc_ij) * r_i) * ws_j) (+ add_ij)     r_i = (a_i / WIDE_MAX) / rms_i
//
// The reference splits q = hi * 2^7 + lo into two int8 products, (w8 @ hi << 7) + w8 @ lo: the same
// integer. Here one AVX-512 VNNI vpdpwssd takes two int16 products per lane: q as int16 pairs of
// one row (broadcast) against 16 output channels' int8 weights widened to int16. Weights come
// packed by wide_pack: (N / 16, K / 2, 16, 2), N padded to WIDE_COLS and K to 2 with zeros. With the
// SiLU epilogue (integer.silu_mul), each tile of 64 rows holds 32 gate channels and the same channels'
// up rows (integer.wide_interleave), so m = round_shift(silu(y_gate) * y_up) is written, not y.
// NOTE: every float step is one IEEE operation on one element (the build passes -ffp-contract=off),
// so the VNNI path, the scalar path and torch agree bit for bit.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "spk_portable.h"  // silu_mul_body

namespace spk {

constexpr int WIDE_ROWS = 4;        // rows per register tile
constexpr int WIDE_COLS = 64;       // output channels per register tile (4 x 16 lanes)
constexpr int64_t WIDE_MAX_K = 2048;  // the int32 sums stay exact up to here
constexpr int64_t WIDE_TASK_ROWS = 32;  // rows per task

inline int64_t wide_pad(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Where w8[j][k] sits in the packed layout (Np / 16, Kp / 2, 16, 2), Np = wide_pad(N, WIDE_COLS), Kp = wide_pad(K, 2).
inline int64_t wide_at(int64_t j, int64_t k, int64_t Kp) { return ((j / 16) * (Kp / 2) + k / 2) * 32 + (j % 16) * 2 + k % 2; }

// w8 (N, K) row-major -> packed; padding zero.
inline void wide_pack(const int8_t* w8, int64_t N, int64_t K, int8_t* out) {
    const int64_t Np = wide_pad(N, WIDE_COLS), Kp = wide_pad(K, 2);
    std::memset(out, 0, (size_t)(Np * Kp));
    for (int64_t j = 0; j < N; ++j)
        for (int64_t k = 0; k < K; ++k) out[wide_at(j, k, Kp)] = w8[j * K + k];
}

// One row quantised to int16 q (Kp entries, zero padded); returns a_i.
inline double wide_q_row(const int64_t* x, const double* w, int64_t K, int64_t Kp, double wide_max, int16_t* q,
                         double* xf) {
    const double amax = wide_scale_row(x, w, K, xf);
    const double inv = amax > 0 ? wide_max / amax : 0.0;
    for (int64_t k = 0; k < K; ++k) q[k] = (int16_t)round_even(xf[k] * inv);
    for (int64_t k = K; k < Kp; ++k) q[k] = 0;
    return amax;
}

// integer.rms_inv_factor of one row: sqrt(mean + eps) from an exact integer sum of squares of
// x >> shift, the shift keeping the sum inside int64; every float step one IEEE operation.
inline double wide_rms(const int64_t* x, int64_t K, int frac, double eps) {
    int bits_n = 0;
    for (int64_t m = std::max<int64_t>(K - 1, 1); m; m >>= 1) ++bits_n;
    const int ss_bits = (62 - bits_n) / 2;
    int64_t amax = 0;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, x[k] < 0 ? -x[k] : x[k]);
    int e = 0;
    std::frexp((double)amax, &e);
    const int shift = std::max(e - ss_bits, 0);
    int64_t ss = 0;
    for (int64_t k = 0; k < K; ++k) {
        const int64_t xs = x[k] >> shift;  // NOTE: arithmetic shift (floor), as torch's >> on int64
        ss += xs * xs;
    }
    const double up = std::ldexp(1.0, 2 * shift);  // exact
    const double mean = ((double)ss * up) / (double)(K << (2 * frac));
    return std::sqrt(mean + eps);
}

// What one call computes; rows [i0, i1) and channel tiles [c0, c1) make one task. rms: given per
// row, or (null, eps >= 0) computed here by wide_rms, or (null, eps < 0) none.
struct WideJob {
    const int64_t* x; const double* w; const double* rms; double eps; int frac; double wide_max;
    const int8_t* packed; const double* ws; const int64_t* add; int64_t* out;
    int64_t M, K, N;
    // SiLU(gate) x up in the epilogue (silu non-null): the N = 2 inter rows are packed as 32 gate rows, then
    // the 32 up rows of the same channels, per tile (wide_interleave); out is (M, inter)
    const int64_t* silu = nullptr; int64_t silu_len = 0; int silu_step = 0; int64_t silu_range = 0;
};

// Packed row of gate channel o (up: + WIDE_COLS / 2) in the interleaved SiLU layout.
inline int64_t wide_gate_row(int64_t o) { return (o / 32) * WIDE_COLS + o % 32; }

// integer.silu_mul of one pair: round_shift(silu(g) * u, frac), silu from the table (spk_portable.h's body).
inline int64_t wide_silu_mul(const WideJob& J, int64_t g, int64_t u) {
    int64_t m;
    silu_mul_body(&g, &u, 1, J.silu, J.silu_len, J.frac, J.silu_step, J.silu_range, &m);
    return m;
}

inline double wide_row_factor(const WideJob& J, double amax, int64_t i) {
    const double r = amax / J.wide_max;
    if (J.rms) return r / J.rms[i];
    return J.eps >= 0 ? r / wide_rms(J.x + i * J.K, J.K, J.frac, J.eps) : r;
}

// The scalar path: the same integers and float steps, one element at a time.
// The scalar path: rows [i0, i1), output channels [j0, j1) (in silu mode: output columns [j0 / 2, j1 / 2)).
inline void wide_rows_scalar(const WideJob& J, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    const int64_t Kp = wide_pad(J.K, 2);
    std::vector<int16_t> q((size_t)J.K);
    std::vector<double> xf((size_t)J.K);
    auto y_of = [&](int64_t row, int64_t ws_j, double r) {  // packed row -> y, weighed by ws[ws_j]
        int32_t acc = 0;
        for (int64_t k = 0; k < J.K; ++k) acc += (int32_t)J.packed[wide_at(row, k, Kp)] * q[k];
        return (int64_t)round_even(((double)acc * r) * J.ws[ws_j]);
    };
    for (int64_t i = i0; i < i1; ++i) {
        const double r = wide_row_factor(J, wide_q_row(J.x + i * J.K, J.w, J.K, J.K, J.wide_max, q.data(), xf.data()), i);
        if (J.silu) {
            const int64_t inter = J.N / 2;
            for (int64_t o = j0 / 2; o < j1 / 2; ++o)
                J.out[i * inter + o] = wide_silu_mul(J, y_of(wide_gate_row(o), o, r),
                                                     y_of(wide_gate_row(o) + WIDE_COLS / 2, inter + o, r));
            continue;
        }
        for (int64_t j = j0; j < j1; ++j) {
            const int64_t y = y_of(j, j, r);
            J.out[i * J.N + j] = J.add ? J.add[i * J.N + j] + y : y;
        }
    }
}

#define SPK_WIDE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

// 8 int32 lanes -> y = nearbyint((double(acc) * r) * ws) as int64 (lanes of m only).
SPK_WIDE_VNNI inline __m512i wide_y8(__m256i acc, __m512d r, const double* ws, __mmask8 m) {
    const __m512d y = _mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(acc), r), _mm512_maskz_loadu_pd(m, ws));
    return _mm512_cvtpd_epi64(_mm512_roundscale_pd(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// y (+ add) into out[0..n), n <= 8.
SPK_WIDE_VNNI inline void wide_store8(__m256i acc, __m512d r, const double* ws, const int64_t* add, int64_t* out,
                                      int n) {
    const __mmask8 m = (__mmask8)((1u << n) - 1);
    __m512i v = wide_y8(acc, r, ws, m);
    if (add) v = _mm512_add_epi64(v, _mm512_maskz_loadu_epi64(m, add));
    _mm512_mask_storeu_epi64(out, m, v);
}

// wide_silu_mul on 8 lanes: the same int64 steps (mullo and add wrap, as uint64; srai is >> on int64).
SPK_WIDE_VNNI inline __m512i wide_silu_mul8(const WideJob& J, __m512i g, __m512i u) {
    const int step = J.frac - J.silu_step;
    const __m512i idx = _mm512_add_epi64(
        _mm512_srai_epi64(_mm512_add_epi64(g, _mm512_set1_epi64(int64_t(1) << (step - 1))), step),
        _mm512_set1_epi64(J.silu_range << J.silu_step));
    const __m512i c = _mm512_max_epi64(_mm512_min_epi64(idx, _mm512_set1_epi64(J.silu_len - 1)), _mm512_setzero_si512());
    __m512i s = _mm512_i64gather_epi64(c, (const void*)J.silu, 8);
    s = _mm512_mask_mov_epi64(s, _mm512_cmpge_epi64_mask(idx, _mm512_set1_epi64(J.silu_len)), g);
    s = _mm512_maskz_mov_epi64(_mm512_cmpge_epi64_mask(idx, _mm512_setzero_si512()), s);
    const __m512i prod = _mm512_add_epi64(_mm512_mullo_epi64(s, u), _mm512_set1_epi64(int64_t(1) << (J.frac - 1)));
    return _mm512_srai_epi64(prod, J.frac);
}

// Rows [i0, i0 + WIDE_ROWS) of q (those below i_end are written) (Kp int16 each) against channel tile t: the 4 x 64 accumulators,
// then the epilogue for the rows below M and the channels below N.
SPK_WIDE_VNNI inline void wide_tile(const WideJob& J, const int16_t* q, int64_t Kp, const double* r, int64_t i0,
                                    int64_t i_end, int64_t t) {
    __m512i acc[WIDE_ROWS][4];
    for (auto& row : acc) for (auto& a : row) a = _mm512_setzero_si512();
    const int64_t pairs = Kp / 2;
    const int8_t* wt = J.packed + t * 4 * pairs * 32;
    for (int64_t p = 0; p < pairs; ++p) {
        __m512i w[4];
        for (int c = 0; c < 4; ++c)
            w[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wt + (c * pairs + p) * 32)));
        for (int rr = 0; rr < WIDE_ROWS; ++rr) {
            int32_t pair;
            std::memcpy(&pair, q + rr * Kp + 2 * p, 4);
            const __m512i a = _mm512_set1_epi32(pair);
            for (int c = 0; c < 4; ++c) acc[rr][c] = _mm512_dpwssd_epi32(acc[rr][c], a, w[c]);
        }
    }
    for (int rr = 0; rr < WIDE_ROWS && i0 + rr < i_end; ++rr) {
        const int64_t i = i0 + rr;
        const __m512d rv = _mm512_set1_pd(r[rr]);
        if (J.silu) {  // accumulators 0, 1: gate channels 32t .. 32t + 31; 2, 3: the same channels' up
            const int64_t inter = J.N / 2, o = t * (WIDE_COLS / 2);
            for (int h = 0; h < 4; ++h) {
                const __m256i ga = h & 1 ? _mm512_extracti64x4_epi64(acc[rr][h / 2], 1) : _mm512_castsi512_si256(acc[rr][h / 2]);
                const __m256i ua = h & 1 ? _mm512_extracti64x4_epi64(acc[rr][2 + h / 2], 1)
                                         : _mm512_castsi512_si256(acc[rr][2 + h / 2]);
                const __m512i g = wide_y8(ga, rv, J.ws + o + 8 * h, 0xFF);
                const __m512i u = wide_y8(ua, rv, J.ws + inter + o + 8 * h, 0xFF);
                _mm512_storeu_si512((void*)(J.out + i * inter + o + 8 * h), wide_silu_mul8(J, g, u));
            }
            continue;
        }
        for (int c = 0; c < 4; ++c)
            for (int h = 0; h < 2; ++h) {
                const int64_t j = t * WIDE_COLS + c * 16 + h * 8;
                if (j >= J.N) break;
                const __m256i a8 = h ? _mm512_extracti64x4_epi64(acc[rr][c], 1) : _mm512_castsi512_si256(acc[rr][c]);
                wide_store8(a8, rv, J.ws + j, J.add ? J.add + i * J.N + j : nullptr, J.out + i * J.N + j,
                            (int)std::min<int64_t>(8, J.N - j));
            }
    }
}

// wide_q_row with AVX-512, 8 elements a step: the same IEEE operations lane by lane (cvtepi64_pd
// rounds to nearest as the (double) cast does; roundscale to nearest even is round_even), a scalar
// tail; max is exact in any order.
SPK_WIDE_VNNI inline double wide_q_row_v(const int64_t* x, const double* w, int64_t K, int64_t Kp, double wide_max,
                                         int16_t* q, double* xf) {
    __m512d vmax = _mm512_setzero_pd();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m512d f = _mm512_cvtepi64_pd(_mm512_loadu_si512((const void*)(x + k)));
        if (w) f = _mm512_mul_pd(f, _mm512_loadu_pd(w + k));
        _mm512_storeu_pd(xf + k, f);
        vmax = _mm512_max_pd(vmax, _mm512_abs_pd(f));
    }
    double amax = _mm512_reduce_max_pd(vmax);
    for (; k < K; ++k) {
        xf[k] = w ? (double)x[k] * w[k] : (double)x[k];
        amax = std::max(amax, std::fabs(xf[k]));
    }
    const double inv = amax > 0 ? wide_max / amax : 0.0;
    const __m512d vinv = _mm512_set1_pd(inv);
    for (k = 0; k + 8 <= K; k += 8) {
        const __m512d y = _mm512_roundscale_pd(_mm512_mul_pd(_mm512_loadu_pd(xf + k), vinv),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtepi64_epi16(_mm512_cvtpd_epi64(y)));
    }
    for (; k < K; ++k) q[k] = (int16_t)round_even(xf[k] * inv);
    for (k = K; k < Kp; ++k) q[k] = 0;
    return amax;
}

// A task: rows [i0, i1) quantised once, then channel tiles [t0, t1) of them.
SPK_WIDE_VNNI inline void wide_rows_vnni(const WideJob& J, int64_t i0, int64_t i1, int64_t t0, int64_t t1) {
    const int64_t Kp = wide_pad(J.K, 2), rows = wide_pad(i1 - i0, WIDE_ROWS);
    std::vector<int16_t> q((size_t)(rows * Kp), 0);
    std::vector<double> xf((size_t)J.K), r((size_t)rows, 0.0);
    for (int64_t i = i0; i < i1; ++i)
        r[i - i0] = wide_row_factor(J, wide_q_row_v(J.x + i * J.K, J.w, J.K, Kp, J.wide_max, q.data() + (i - i0) * Kp,
                                                  xf.data()), i);
    for (int64_t t = t0; t < t1; ++t)
        for (int64_t b = 0; b < rows; b += WIDE_ROWS) wide_tile(J, q.data() + b * Kp, Kp, r.data() + b, i0 + b, i1, t);
}

}  // namespace spk
