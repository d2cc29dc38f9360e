// The two products of vLLM's CPU attention over an FP8 e4m3 cache on its `amx` kernel, replayed
// with the same AMX instruction (TDPBF16PS) on the same operands in the same order, so the same
// FP32 bits (speckv/predictor/amx_fp8.py does the softmax between them; tests/predictor and
// benchmarks/research/vllm_amx_attention.py check it against vLLM's own op).
//
// What vLLM's kernel does, and so this file: each e4m3 code is widened to BF16 *unscaled*
// (sign << 15 | code_bits << 4: the code's value times 2^-120; its scale and 2^120 go onto the
// logits and the output in FP32). AMX treats denormal inputs as zero and flushes tiny partial
// sums, so at that offset the products lose what an FP32 attention keeps: no float model of it
// was found (benchmarks/RESULTS.md), hence the replay.
//
//   scores  C[row][16 keys]  = sum over 2 instructions (dims 0-31, 32-63) of
//                              A: q BF16 (32 dims as 16 pairs)  x  B: 16 dim pairs x 16 keys
//   P @ V   C[row][16 dims] += per 32 keys (16 key pairs), in key order:
//                              A: P BF16 (32 keys)              x  B: 16 key pairs x 16 dims
//
// NOTE: a C element's sum depends only on its own row and column and on the order of the pairs
// (checked: the replay equals vLLM's op bit for bit at 4-880 tokens whatever the tile rows), so
// rows run in passes of up to 16 and keys or dims in groups of 16.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "spk_amx.h"

namespace spk {

#define SPK_AMX_BF16 __attribute__((target("amx-tile,amx-bf16")))
#define SPK_AMX_FP8_MATH __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define SPK_AMX_BF16_MATH __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16")))
constexpr int FP8_AMX_D = 64;     // head size: two 32-dim instructions per score
constexpr int FP8_AMX_ROWS = 16;  // query rows per tile pass

// Whether this CPU and kernel let this process use AMX BF16 tiles (asked once).
inline bool amx_bf16_ready() {
    static const bool yes = amx_granted(AMX_BF16_BIT);
    return yes;
}

// An e4m3 code as vLLM's amx kernel widens it: BF16 bits of value * 2^-120.
inline uint16_t e4m3_unscaled_bf16(uint8_t code) {
    return (uint16_t)(((code & 0x80u) << 8) | ((code & 0x7Fu) << 4));
}

struct alignas(64) Fp8AmxConfig {  // tile 0: C (rows x 16 fp32), 1: A (rows x 32 BF16), 2: B (16 x 32 BF16)
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    explicit Fp8AmxConfig(int r) {
        colsb[0] = colsb[1] = colsb[2] = 64;
        rows[0] = rows[1] = (uint8_t)r, rows[2] = 16;
    }
};

// K's B tiles: kp (U16 / 16, 2, 16 x 32) BF16 bits; tile (g, h) row p: dims (32h + 2p, +1) of keys
// 16g .. 16g + 15 (keys >= U are 0). k: codes (U, 64).
inline void fp8_amx_pack_k(const uint8_t* k, int64_t U, int64_t U16, uint16_t* kp) {
    constexpr int D = FP8_AMX_D;
    for (int64_t g = 0; g < U16 / 16; ++g)
        for (int h = 0; h < 2; ++h)
            for (int p = 0; p < 16; ++p)
                for (int n = 0; n < 16; ++n)
                    for (int e = 0; e < 2; ++e) {
                        const int64_t u = 16 * g + n;
                        kp[((g * 2 + h) * 16 + p) * 32 + 2 * n + e] =
                            u < U ? e4m3_unscaled_bf16(k[u * D + 32 * h + 2 * p + e]) : 0;
                    }
}

// V's B tiles: vp (U32 / 32, 4, 16 x 32) BF16 bits; tile (g, j) row r: keys (32g + 2r, +1) of dims
// 16j .. 16j + 15 (keys >= U are 0). v: codes (U, 64).
inline void fp8_amx_pack_v(const uint8_t* v, int64_t U, int64_t U32, uint16_t* vp) {
    constexpr int D = FP8_AMX_D;
    for (int64_t g = 0; g < U32 / 32; ++g)
        for (int j = 0; j < D / 16; ++j)
            for (int r = 0; r < 16; ++r)
                for (int n = 0; n < 16; ++n)
                    for (int e = 0; e < 2; ++e) {
                        const int64_t u = 32 * g + 2 * r + e;
                        vp[((g * 4 + j) * 16 + r) * 32 + 2 * n + e] = u < U ? e4m3_unscaled_bf16(v[u * D + 16 * j + n]) : 0;
                    }
}

// The tile loops (tile config loaded by the caller). Scores'' (unscaled) of query rows
// [r0, r0 + rows) (q BF16 bits (T, 64)) against key groups [0, groups) of kp: row r's 16 x groups
// scores to S + r * s_stride.
SPK_AMX_BF16 inline void fp8_amx_score_tiles(const uint16_t* q, const uint16_t* kp, int64_t groups, int64_t r0,
                                             int rows, float* S, int64_t s_stride) {
    constexpr int D = FP8_AMX_D;
    alignas(64) float C[FP8_AMX_ROWS * 16];
    for (int64_t g = 0; g < groups; ++g) {
        _tile_zero(0);
        for (int h = 0; h < 2; ++h) {  // NOTE: dims 0-31, then 32-63, into one accumulator: vLLM's order
            _tile_loadd(1, q + r0 * D + 32 * h, D * 2);
            _tile_loadd(2, kp + (g * 2 + h) * 512, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, C, 64);
        for (int r = 0; r < rows; ++r) std::memcpy(S + r * s_stride + 16 * g, C + r * 16, 64);
    }
}

// P @ V'' (unscaled) for dims 16j .. 16j + 15: weights P (rows of p_stride BF16, zero past each row's
// keys) over key groups [0, groups) of vp, 32 keys per instruction, in order, into one accumulator;
// the (rows x 16) sums to C (stride 16).
SPK_AMX_BF16 inline void fp8_amx_pv_tiles(const uint16_t* P, int64_t p_stride, const uint16_t* vp, int64_t groups,
                                          int j, float* C) {
    _tile_zero(0);
    for (int64_t g = 0; g < groups; ++g) {
        _tile_loadd(1, P + 32 * g, p_stride * 2);
        _tile_loadd(2, vp + (g * 4 + j) * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, C, 64);
}

// Scores'' (unscaled) of query rows [r0, r0 + rows) against keys [0, U16): out (T, U16) fp32.
SPK_AMX_BF16 inline void fp8_amx_scores(const uint16_t* q, const uint16_t* kp, int64_t U16, int64_t r0, int rows,
                                        float* out) {
    const Fp8AmxConfig cfg(rows);
    _tile_loadconfig(&cfg);
    fp8_amx_score_tiles(q, kp, U16 / 16, r0, rows, out + r0 * U16, U16);
    _tile_release();
}

// P @ V'' (unscaled) of rows [r0, r0 + rows): p BF16 bits (T, U32), out (T, 64) fp32.
SPK_AMX_BF16 inline void fp8_amx_pv(const uint16_t* p, const uint16_t* vp, int64_t U32, int64_t r0, int rows,
                                    float* out) {
    constexpr int D = FP8_AMX_D;
    const Fp8AmxConfig cfg(rows);
    _tile_loadconfig(&cfg);
    alignas(64) float C[FP8_AMX_ROWS * 16];
    for (int j = 0; j < D / 16; ++j) {
        fp8_amx_pv_tiles(p + r0 * U32, U32, vp, U32 / 32, j, C);
        for (int r = 0; r < rows; ++r) std::memcpy(out + (r0 + r) * D + 16 * j, C + r * 16, 64);
    }
    _tile_release();
}

// exp(x) for x <= 0 (a softmax's x - max; -inf gives 0): x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two
// parts, Cody-Waite), e^r by its degree-7 Taylor polynomial (relative error < 2^-25 there), times
// 2^n; below -87.3 it returns 0 (e^x < 2^-126 would be denormal). Within 2 ulp of expf; the kernel
// rounds its weights to BF16 (8 bits), so a last-bit difference moves a weight only at a BF16
// rounding boundary.
SPK_AMX_FP8_MATH inline __m512 exp_nonpositive(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187045e-06f)));
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~zero, p, _mm512_castsi512_ps(e));
}

// Positive finite floats to BF16 bits, rounded to nearest even.
SPK_AMX_FP8_MATH inline __m256i bf16_rne(__m512 x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
    return _mm512_cvtepi32_epi16(r);
}

// One head's causal attention, query rows [r0, r0 + rows) (positions U - T + r), as vLLM's amx
// kernel computes it over an FP8 cache: out (T, out_stride) BF16 bits at column 0 of each row.
// kp, vp: fp8_amx_pack_k / _v; s = softmax scale * k_scale * 2^120 and bias = v_scale * 2^120,
// each folded in FP32 as the kernel folds them. NOTE: keys past a pass's last row are skipped (their
// weights are 0 in every row of the pass).
SPK_AMX_BF16_MATH inline void fp8_amx_rows(const uint16_t* q, const uint16_t* kp, const uint16_t* vp, int64_t T,
                                           int64_t U, float s, float bias, int64_t r0, int rows, uint16_t* out,
                                           int64_t out_stride) {
    constexpr int D = FP8_AMX_D;
    const int64_t last = U - T + r0 + rows - 1;  // the pass's last key
    const int64_t n16 = last / 16 + 1, n32 = last / 32 + 1, w = n32 * 32;
    thread_local std::vector<float> S;
    thread_local std::vector<uint16_t> P;
    S.assign((size_t)(rows * n16 * 16), 0.0f);
    P.assign((size_t)(rows * w), 0);
    const Fp8AmxConfig cfg(rows);
    _tile_loadconfig(&cfg);
    fp8_amx_score_tiles(q, kp, n16, r0, rows, S.data(), n16 * 16);
    float total[FP8_AMX_ROWS];
    for (int r = 0; r < rows; ++r) {  // the softmax of each row: FP32 logits, max, exp, sum, BF16 weights
        const int64_t n = U - T + r0 + r + 1;  // keys 0 .. n - 1
        float* x = S.data() + r * n16 * 16;
        const __m512 sv = _mm512_set1_ps(s);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 m = j + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
            const __m512 l = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + j), sv);
            _mm512_mask_storeu_ps(x + j, m, l);
            mx = _mm512_mask_max_ps(mx, m, mx, l);
        }
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 m = j + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
            const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), top)));
            sum = _mm512_add_ps(sum, e);
            _mm256_mask_storeu_epi16(P.data() + r * w + j, m, bf16_rne(e));
        }
        total[r] = _mm512_reduce_add_ps(sum);
    }
    alignas(64) float C[FP8_AMX_ROWS * 16];
    for (int j = 0; j < D / 16; ++j) {
        fp8_amx_pv_tiles(P.data(), w, vp, n32, j, C);
        for (int r = 0; r < rows; ++r) {  // out'' * bias / total, to BF16
            const __m512 o = _mm512_div_ps(_mm512_mul_ps(_mm512_loadu_ps(C + r * 16), _mm512_set1_ps(bias)),
                                           _mm512_set1_ps(total[r]));
            const __m512i b = _mm512_castps_si512(o);  // NOTE: signed: round |o| and keep the sign
            const __m512i sign = _mm512_and_si512(b, _mm512_set1_epi32((int)0x80000000u));
            const __m256i mag = bf16_rne(_mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32((int)0x80000000u), b)));
            const __m256i sg = _mm512_cvtepi32_epi16(_mm512_srli_epi32(sign, 16));
            _mm256_storeu_si256((__m256i*)(out + (r0 + r) * out_stride + 16 * j), _mm256_or_si256(mag, sg));
        }
    }
    _tile_release();
}

#undef SPK_AMX_BF16
#undef SPK_AMX_FP8_MATH
#undef SPK_AMX_BF16_MATH

}  // namespace spk
