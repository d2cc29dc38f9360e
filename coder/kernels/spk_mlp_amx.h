// The W8A8 MLP with speckv's own SiLU (rungs ``w8a8x[:k]``) on AMX tiles, one pass per block of rows;
// the reference is w8a8_pass._mlp composed of w8a8.py's stages, and this writes its bits:
//
//   y        = linear(q, xs, gate_up)              float32 (rows, 2I): gate columns [0, I), up [I, 2I)
//   m        = silu_det(y_gate) * y_up              (rows, I), spk_silu.h
//   q2, xs2  = quantise(m, f_down)                  int8 rows, amax / 127 (spk_w8a8.h)
//   out      = add + bf16(linear(q2, xs2, down))    BF16 (rows, n): the residual stream's update
//
// Each task keeps its rows' m and q2 in its own buffers (768 KiB and 192 KiB for 128 rows of the
// embedded model), so the (T, 2I) float32 product never exists whole and never leaves the cache.
// A tile block pairs gate panel c with up panel c: both halves of m's 16 columns in one 32 x 32 block.
// NOTE: the epilogue is dequant16's float steps, then silu_det_v and one multiply, lane by lane: the
// same single IEEE operations as the reference (the build passes -ffp-contract=off).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "spk_silu.h"
#include "spk_w8a8.h"
#include "spk_w8a8_amx.h"

namespace spk {

#define SPK_AMX_MLP __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))

struct AmxMlp {
    const int8_t* q;         // (m, k): the gate/up product's int8 rows
    const float* xs;         // (m): their scales (the norm's factor folded in)
    const int8_t* gu_panels; // gate_up (2I, k) packed (pack_panel): gate panels [0, I/16), up [I/16, I/8)
    const float* ws_gu;      // (2I)
    const float* f_down;     // (I): the down product's input factors (smoothing)
    const int8_t* d_panels;  // down (n, I) packed
    const float* ws_d;       // (n)
    const uint16_t* add;     // (m, n) BF16: the residual stream
    uint16_t* out;           // (m, n) BF16
    float* xs2;              // (m): the down product's row scales (NaN: the row was not finite)
    int64_t k, I, n;
};

// NOTE: every size at most AMX_MM_MAX_K, so the binding's products of them cannot overflow
inline bool amx_mlp_fits(int64_t k, int64_t I, int64_t n) {
    return w8a8_amx_fits(k, 2 * I) && w8a8_amx_fits(I, n) && n <= AMX_MM_MAX_K;
}

// m's rows [0, rows) of the task at i0 (stride I): the gate/up product and its epilogue.
SPK_AMX_MLP inline void amx_mlp_gate(const AmxMlp& a, int64_t i0, int64_t rows, float* m) {
    thread_local std::vector<int8_t> pad;
    const int64_t blocks = amx_pad_tail(a.q, a.k, i0, i0 + rows, pad);
    const int64_t panel = a.k / AMX_MM_K * AMX_MM_CHUNK, gates = a.I / AMX_MM_PANEL;
    alignas(64) int32_t s[AMX_MM_BLOCK][AMX_MM_BLOCK];
    for (int64_t c = 0; c < gates; ++c) {  // NOTE: panels outside, so the pair stays in L1 for every block
        const int8_t* g = a.gu_panels + c * panel;
        const int8_t* u = a.gu_panels + (gates + c) * panel;
        const __m512 wg = _mm512_loadu_ps(a.ws_gu + AMX_MM_PANEL * c);
        const __m512 wu = _mm512_loadu_ps(a.ws_gu + a.I + AMX_MM_PANEL * c);
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t r0 = b * AMX_MM_BLOCK, nr = std::min<int64_t>(AMX_MM_BLOCK, rows - r0);
            amx_sums(nr < AMX_MM_BLOCK ? pad.data() : a.q + (i0 + r0) * a.k, g, u, a.k, s);
            for (int64_t r = 0; r < nr; ++r) {
                const __m512 x = _mm512_set1_ps(a.xs[i0 + r0 + r]);
                const __m512 yg = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(&s[r][0])), x), wg);
                const __m512 yu = _mm512_mul_ps(
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(&s[r][AMX_MM_PANEL])), x), wu);
                _mm512_storeu_ps(m + (r0 + r) * a.I + AMX_MM_PANEL * c, _mm512_mul_ps(silu_det_v(yg), yu));
            }
        }
    }
}

// Rows [i0, i1) (at most AMX_MM_ROWS) of the whole MLP.
SPK_AMX_MLP inline void amx_mlp_rows(const AmxMlp& a, int64_t i0, int64_t i1) {
    thread_local std::vector<float> m;
    thread_local std::vector<int8_t> q2;
    const int64_t rows = i1 - i0;
    m.resize((size_t)(AMX_MM_ROWS * a.I));
    q2.resize((size_t)(AMX_MM_ROWS * a.I));
    const AmxTileConfig cfg;
    _tile_loadconfig(&cfg);
    amx_mlp_gate(a, i0, rows, m.data());
    _tile_release();
    for (int64_t r = 0; r < rows; ++r)
        a.xs2[i0 + r] = w8a8_quantise_row_avx512(m.data() + r * a.I, a.f_down, a.I, q2.data() + r * a.I) / W8A8_QMAX;
    amx_rows(q2.data(), a.d_panels, a.I, a.n, 0, rows, a.xs2 + i0, a.ws_d, a.add + i0 * a.n, a.out + i0 * a.n, true);
}

#undef SPK_AMX_MLP

}  // namespace spk
