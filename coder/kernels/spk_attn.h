// The int8 attention of the W8A8 rungs with integer attention (``w8a8i``, ``w8a8i:k``); the torch
// reference is speckv/predictor/int8_attention.py and both give the same bits.
//
// Per query head h (kv head g = h / group) and query token i, keys j <= i (causal):
//
//   q8, qs = quantise(q_i)   k8, ks = quantise(k_j)   v8, vs = quantise(v_j)    int8 per token, amax / 127
//   S_ij  = sum_d q8_id k8_jd                        int32, exact
//   x_ij  = (float(S_ij) * c_i) * ks_j               c_i = qs_i * rsd, rsd = float(log2(e) / sqrt(D))
//   e_ij  = exp2_det(x_ij - max_j x_ij)              scores in log2 units; one fixed sequence of float32 steps
//   den_i = sum_j nearbyint(e_ij * 2^DEN_BITS)       int64, exact in any order
//   per key block b of ATT_KEY_BLOCK keys, unless max_(j in b) x_ij - max_j x_ij < ATT_SKIP (then nothing):
//     w_ij = e_ij * vs_j;  bm = max_j w_ij;  u_ij = nearbyint(w_ij * (255 / bm))      uint8
//     out_id += (bm / 255) * float(sum_j u_ij v8_jd)                                int32 sums, exact
//   o_id  = bf16(out_id / (float(den_i) * 2^-DEN_BITS))
//
// Every float step is one IEEE operation on one element (no sums of floats), so the AVX-512 VNNI path
// and the scalar reference agree bit for bit. NOTE: no FMA may form (the build passes -ffp-contract=off).
// The VNNI product multiplies unsigned by signed bytes: q8 + 128 as uint8, and 128 * sum_d k8_jd comes
// back off each score (ksum).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "spk_w8a8.h"

namespace spk {

constexpr int ATT_KEY_BLOCK = 64;   // keys per quantisation block of the softmax weights
constexpr float ATT_P_MAX = 255.0f; // uint8 softmax weights
constexpr int ATT_DEN_BITS = 20;    // fixed point of the denominator's integer sum
constexpr float ATT_EXP_FLOOR = -126.0f;  // exp2_det's lowest argument: 2^-126 stays normal
// A key block whose largest score is this far below the row's maximum is skipped: its weights are
// below 2^-22 (under half a step of the denominator's 2^-20).
constexpr float ATT_SKIP = -22.0f;
constexpr double ATT_LOG2E = 1.4426950408889634;
constexpr int ATT_ROWS = 16;        // query rows per task
// 2^r = 1 + r P(r) on |r| <= 1/2, P of degree 4 fitted for relative error (1.6e-7 in float32)
constexpr float EXP2_P[5] = {0.0013239749241620302f, 0.009672081097960472f, 0.055507779121398926f,
                             0.24022230505943298f, 0.6931470036506653f};

// 2^x for x <= 0: n = nearbyint(x), r = x - n (exact), 2^n from its exponent bits
inline float exp2_det(float x) {
    x = std::max(x, ATT_EXP_FLOOR);
    const float n = std::nearbyint(x);
    const float r = x - n;
    float p = EXP2_P[0];
    for (int k = 1; k < 5; ++k) p = p * r + EXP2_P[k];
    const float y = p * r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, 4);
    return y * two_n;
}

// One head's operands after quantisation: row-major (tokens, D) int8 and per-token scales.
struct AttnHead {
    const int8_t* q8; const float* qs;   // query head
    const int8_t* k8; const float* ks;   // its kv head
    const int8_t* v8; const float* vs;
};

// Scalar reference: query rows [i0, i1) of one head; o is (tokens, heads, D) BF16 bits at this head.
inline void attn_rows(const AttnHead& a, int64_t D, float rsd, int64_t i0, int64_t i1, uint16_t* o,
                      int64_t o_stride) {
    std::vector<float> x((size_t)i1), w(ATT_KEY_BLOCK), out((size_t)D);
    std::vector<int32_t> acc((size_t)D);
    for (int64_t i = i0; i < i1; ++i) {
        const float c = a.qs[i] * rsd;
        float m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
            int32_t s = 0;
            for (int64_t d = 0; d < D; ++d) s += (int32_t)a.q8[i * D + d] * a.k8[j * D + d];
            x[j] = ((float)s * c) * a.ks[j];
            m = std::max(m, x[j]);
        }
        int64_t den = 0;
        std::fill(out.begin(), out.end(), 0.0f);
        for (int64_t b0 = 0; b0 <= i; b0 += ATT_KEY_BLOCK) {
            const int64_t b1 = std::min<int64_t>(b0 + ATT_KEY_BLOCK, i + 1);
            float bx = -INFINITY;
            for (int64_t j = b0; j < b1; ++j) bx = std::max(bx, x[j]);
            if (bx - m < ATT_SKIP) continue;
            float bm = 0.0f;
            for (int64_t j = b0; j < b1; ++j) {
                const float e = exp2_det(x[j] - m);
                den += (int64_t)std::nearbyint(e * (float)(1 << ATT_DEN_BITS));
                w[j - b0] = e * a.vs[j];
                bm = std::max(bm, w[j - b0]);
            }
            if (!(bm > 0.0f)) continue;
            const float inv = ATT_P_MAX / bm;
            std::fill(acc.begin(), acc.end(), 0);
            for (int64_t j = b0; j < b1; ++j) {
                const int32_t u = (int32_t)std::nearbyint(w[j - b0] * inv);
                for (int64_t d = 0; d < D; ++d) acc[d] += u * a.v8[j * D + d];
            }
            const float bs = bm / ATT_P_MAX;
            for (int64_t d = 0; d < D; ++d) out[d] = out[d] + bs * (float)acc[d];
        }
        const float denf = (float)den * (1.0f / (float)(1 << ATT_DEN_BITS));
        for (int64_t d = 0; d < D; ++d) o[i * o_stride + d] = f32_to_bf16(out[d] / denf);
    }
}


// ------------------------------------------------------------------ AVX-512 VNNI

#define SPK_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
constexpr int ATT_VNNI_MAX_D = 128;  // D / 16 accumulators per row

// The VNNI path's operand layouts of one kv head (built by attn_pack_kv) and one query head.
struct AttnPacked {
    const uint8_t* qu;      // (tokens, D): q8 + 128
    const int8_t* k4;       // (key groups of 16, D / 4, 16 keys, 4 channels)
    const int32_t* ksum;    // (keys padded to 16): 128 * sum_d k8
    const float* ks;        // (keys padded to 16), 0 past the prompt
    const int8_t* v4;       // (keys padded to ATT_KEY_BLOCK, in groups of 4: group, D, 4 keys)
    const float* vs;        // (keys padded to ATT_KEY_BLOCK), 0 past the prompt
};

inline int64_t pad_to(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The calling thread's scores buffer of at least n floats, kept between tasks and calls (a task's
// rows of scores: 128 KiB at 2,048 tokens, which a fresh vector would map and zero per task).
// NOTE: stale scores past a row's computed keys are only ever read under a mask (attn_block_weights).
inline float* attn_scratch(size_t n) {
    thread_local std::vector<float> x;
    if (x.size() < n) x.assign(n, 0.0f);
    return x.data();
}

// k8, v8 (T, D) -> the packed layouts; the buffers are sized by the caller (pad_to(T, 16) * D,
// pad_to(T, 16), pad_to(T, ATT_KEY_BLOCK) * D) and zeroed.
inline void attn_pack_kv(const int8_t* k8, const int8_t* v8, int64_t T, int64_t D, int8_t* k4, int32_t* ksum,
                         int8_t* v4) {
    for (int64_t t = 0; t < T; ++t) {
        int32_t s = 0;
        for (int64_t d = 0; d < D; ++d) {
            const int8_t kv = k8[t * D + d];
            s += kv;
            k4[(((t / 16) * (D / 4) + d / 4) * 16 + t % 16) * 4 + d % 4] = kv;
            v4[((t / 4) * D + d) * 4 + t % 4] = v8[t * D + d];
        }
        ksum[t] = 128 * s;
    }
}

// exp2_det of 16 lanes; lanes outside ``keep`` are 0
SPK_VNNI inline __m512 exp2_det_v(__m512 x, __mmask16 keep) {
    x = _mm512_max_ps(x, _mm512_set1_ps(ATT_EXP_FLOOR));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(EXP2_P[0]);
    for (int k = 1; k < 5; ++k) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP2_P[k]));
    const __m512 y = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    // NOTE: y * 2^n in one rounding, as the scalar path's multiply by 2^n's bits (n >= -126: 2^n normal)
    return _mm512_maskz_scalef_ps(keep, y, n);
}

// Scores of 4 query rows qu (4, D) against keys [0, 16 * groups): x rows of stride x_stride.
SPK_VNNI inline void attn_scores4(const AttnPacked& p, const uint8_t* qu, const float* c, int64_t D,
                                  int64_t groups, float* x, int64_t x_stride) {
    const int64_t D4 = D / 4;
    for (int64_t kb = 0; kb < groups; ++kb) {
        __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                          _mm512_setzero_si512()};
        const int8_t* kg = p.k4 + kb * D4 * 64;
        for (int64_t d4 = 0; d4 < D4; ++d4) {
            const __m512i kv = _mm512_loadu_si512((const void*)(kg + d4 * 64));
            for (int r = 0; r < 4; ++r) {
                int32_t qw;
                std::memcpy(&qw, qu + r * D + d4 * 4, 4);
                acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(qw), kv);
            }
        }
        const __m512i ksum = _mm512_loadu_si512((const void*)(p.ksum + kb * 16));
        const __m512 ks = _mm512_loadu_ps(p.ks + kb * 16);
        for (int r = 0; r < 4; ++r) {
            const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], ksum));
            _mm512_storeu_ps(x + r * x_stride + kb * 16, _mm512_mul_ps(_mm512_mul_ps(s, _mm512_set1_ps(c[r])), ks));
        }
    }
}

// The largest score of row i (keys 0..i of its scores xr): the softmax's reference point.
SPK_VNNI inline float attn_row_max(const float* xr, int64_t i) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= i + 1; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(xr + j));
    float m = _mm512_reduce_max_ps(mv);
    for (; j <= i; ++j) m = std::max(m, xr[j]);
    return m;
}

// One key block [b0, b0 + ATT_KEY_BLOCK) of row i (scores x, max m) up to its quantisation: the
// weights w (ATT_KEY_BLOCK floats), the denominator's integer terms added to the lanes of dsum, and
// the block's largest weight bm; 0 when the block is skipped (w and dsum untouched) or has no weight
// above 0 (the scalar reference skips it then; its terms still count).
SPK_VNNI __attribute__((always_inline)) inline float attn_block_w(const AttnPacked& p, const float* x, float m, int64_t i, int64_t b0, float* w,
                                   __m512i& dsum) {
    const __m512 vm = _mm512_set1_ps(m), den_scale = _mm512_set1_ps((float)(1 << ATT_DEN_BITS));
    // NOTE: the block is skipped when its best score is ATT_SKIP below m: fl(x - m) is monotonic in x, so
    // testing every key's x - m is the scalar path's test of the largest one
    __mmask16 mask[ATT_KEY_BLOCK / 16];
    __m512 d[ATT_KEY_BLOCK / 16];
    __mmask16 near = 0;
    for (int k = 0; k < ATT_KEY_BLOCK / 16; ++k) {
        const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(16, i + 1 - (b0 + 16 * k)));
        mask[k] = (__mmask16)((1u << valid) - 1u);
        d[k] = _mm512_sub_ps(_mm512_loadu_ps(x + b0 + 16 * k), vm);
        near |= _mm512_mask_cmp_ps_mask(mask[k], d[k], _mm512_set1_ps(ATT_SKIP), _CMP_GE_OQ);
    }
    if (!near) return 0.0f;
    __m512 bmv = _mm512_setzero_ps();
    for (int k = 0; k < ATT_KEY_BLOCK / 16; ++k) {
        const __m512 e = exp2_det_v(d[k], mask[k]);
        // NOTE: cvtps rounds in the MXCSR mode, nearest even, as nearbyint does
        dsum = _mm512_add_epi32(dsum, _mm512_cvtps_epi32(_mm512_mul_ps(e, den_scale)));
        const __m512 wk = _mm512_mul_ps(e, _mm512_loadu_ps(p.vs + b0 + 16 * k));
        _mm512_storeu_ps(w + 16 * k, wk);
        bmv = _mm512_max_ps(bmv, wk);
    }
    const float bm = _mm512_reduce_max_ps(bmv);
    return bm > 0.0f ? bm : 0.0f;  // NOTE: NaN too
}

// The block's uint8 weights u = nearbyint(w * inv), inv = P_MAX / bm.
SPK_VNNI __attribute__((always_inline)) inline void attn_block_u(const float* w, float inv, uint8_t* u) {
    const __m512 vi = _mm512_set1_ps(inv);
    for (int k = 0; k < ATT_KEY_BLOCK / 16; ++k) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(w + 16 * k), vi));
        _mm_storeu_si128((__m128i*)(u + 16 * k), _mm512_cvtepi32_epi8(q));
    }
}

// One key block of row i: its uint8 weights u, the denominator's share (added to den) and the
// block's scale bm / 255 (0: no weight, u all 0).
SPK_VNNI inline float attn_block_weights(const AttnPacked& p, const float* x, float m, int64_t i, int64_t b0,
                                         uint8_t* u, int64_t& den) {
    alignas(64) float w[ATT_KEY_BLOCK];
    __m512i dsum = _mm512_setzero_si512();
    const float bm = attn_block_w(p, x, m, i, b0, w, dsum);
    den += _mm512_reduce_add_epi32(dsum);
    if (bm == 0.0f) {
        std::memset(u, 0, ATT_KEY_BLOCK);
        return 0.0f;
    }
    attn_block_u(w, ATT_P_MAX / bm, u);
    return bm / ATT_P_MAX;
}

// Rows r0 .. r0 + rows - 1 (at most 4) from their scores x (stride x_stride): softmax weights per key
// block, then P @ V for the 4 rows at once (each V load feeds 4 rows). C = D / 16.
// NOTE: a block past a row's last key has u = 0 and scale 0: out + 0 * 0 leaves out as it is.
template <int C>
SPK_VNNI inline void attn_rows4_pv(const AttnPacked& p, const float* x, int64_t x_stride, int64_t r0, int rows,
                                   uint16_t* o, int64_t o_stride) {
    constexpr int64_t D = 16 * C;
    float m[4];
    alignas(64) float out[4][D];
    int64_t den[4] = {0, 0, 0, 0};
    for (int r = 0; r < rows; ++r) {
        m[r] = attn_row_max(x + r * x_stride, r0 + r);
        std::memset(out[r], 0, sizeof(out[r]));
    }
    const int64_t last = r0 + rows - 1;
    alignas(64) uint8_t u[4][ATT_KEY_BLOCK];
    for (int64_t b0 = 0; b0 <= last; b0 += ATT_KEY_BLOCK) {
        float bs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int r = 0; r < 4; ++r) {
            if (r < rows) bs[r] = attn_block_weights(p, x + r * x_stride, m[r], r0 + r, b0, u[r], den[r]);
            else std::memset(u[r], 0, ATT_KEY_BLOCK);
        }
        __m512i acc[4][C];
        for (int r = 0; r < 4; ++r)
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
        const int64_t steps = (std::min<int64_t>(b0 + ATT_KEY_BLOCK, last + 1) - b0 + 3) / 4;
        const int8_t* vb = p.v4 + (b0 / 4) * D * 4;
        for (int64_t s = 0; s < steps; ++s) {
            __m512i vv[C];
            for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_si512((const void*)(vb + (s * D + c * 16) * 4));
            for (int r = 0; r < 4; ++r) {
                int32_t uw;
                std::memcpy(&uw, u[r] + 4 * s, 4);
                const __m512i ub = _mm512_set1_epi32(uw);
                for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], ub, vv[c]);
            }
        }
        // NOTE: spilled once here with compile-time indices; read by the runtime row loop, acc itself
        // would live on the stack through the product loop (GCC)
        alignas(64) int32_t sums[4][D];
        for (int r = 0; r < 4; ++r)
            for (int c = 0; c < C; ++c) _mm512_store_si512((void*)(sums[r] + 16 * c), acc[r][c]);
        for (int r = 0; r < rows; ++r) {
            const __m512 vs = _mm512_set1_ps(bs[r]);
            for (int c = 0; c < C; ++c) {
                const __m512 add = _mm512_mul_ps(vs, _mm512_cvtepi32_ps(_mm512_load_si512((const void*)(sums[r] + 16 * c))));
                _mm512_store_ps(out[r] + 16 * c, _mm512_add_ps(_mm512_load_ps(out[r] + 16 * c), add));
            }
        }
    }
    for (int r = 0; r < rows; ++r) {
        const __m512 denf = _mm512_set1_ps((float)den[r] * (1.0f / (float)(1 << ATT_DEN_BITS)));
        for (int c = 0; c < C; ++c) _mm512_store_ps(out[r] + 16 * c, _mm512_div_ps(_mm512_load_ps(out[r] + 16 * c), denf));
        uint16_t* orow = o + (r0 + r) * o_stride;
        for (int64_t d = 0; d < D; ++d) orow[d] = f32_to_bf16(out[r][d]);
    }
}

template <int C>
SPK_VNNI inline void attn_rows_vnni_c(const AttnPacked& p, const float* qs, float rsd, int64_t i0, int64_t i1,
                                      uint16_t* o, int64_t o_stride) {
    constexpr int64_t D = 16 * C;
    const int64_t stride = pad_to(i1, ATT_KEY_BLOCK);  // NOTE: a row's last key block is read whole
    float* x = attn_scratch((size_t)(4 * stride));
    for (int64_t r0 = i0; r0 < i1; r0 += 4) {
        const int rows = (int)std::min<int64_t>(4, i1 - r0);
        float c[4];
        for (int r = 0; r < 4; ++r) c[r] = r < rows ? qs[r0 + r] * rsd : 0.0f;
        // NOTE: rows past i1 repeat the last row's operands (their scores are never read)
        alignas(64) uint8_t qpad[4 * D];
        const uint8_t* qu = p.qu + r0 * D;
        if (rows < 4) {
            for (int r = 0; r < 4; ++r) std::memcpy(qpad + r * D, qu + std::min(r, rows - 1) * D, D);
            qu = qpad;
        }
        attn_scores4(p, qu, c, D, pad_to(r0 + rows, 16) / 16, x, stride);
        attn_rows4_pv<C>(p, x, stride, r0, rows, o, o_stride);
    }
}

// VNNI path of attn_rows: query rows [i0, i1) of one head (D a multiple of 16, at most ATT_VNNI_MAX_D).
SPK_VNNI inline void attn_rows_vnni(const AttnPacked& p, const float* qs, int64_t D, float rsd, int64_t i0,
                                    int64_t i1, uint16_t* o, int64_t o_stride) {
    switch (D / 16) {
        case 1: return attn_rows_vnni_c<1>(p, qs, rsd, i0, i1, o, o_stride);
        case 2: return attn_rows_vnni_c<2>(p, qs, rsd, i0, i1, o, o_stride);
        case 3: return attn_rows_vnni_c<3>(p, qs, rsd, i0, i1, o, o_stride);
        case 4: return attn_rows_vnni_c<4>(p, qs, rsd, i0, i1, o, o_stride);
        case 5: return attn_rows_vnni_c<5>(p, qs, rsd, i0, i1, o, o_stride);
        case 6: return attn_rows_vnni_c<6>(p, qs, rsd, i0, i1, o, o_stride);
        case 7: return attn_rows_vnni_c<7>(p, qs, rsd, i0, i1, o, o_stride);
        default: return attn_rows_vnni_c<8>(p, qs, rsd, i0, i1, o, o_stride);
    }
}

#undef SPK_VNNI

}  // namespace spk
