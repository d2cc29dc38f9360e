// The W8A8 linear on AMX tiles: the int8 product and its dequantisation in one pass (w8a8.py ``linear``).
//
//   acc[i][j] = sum_p q[i][p] * w8[j][p]                  TDPBSSD: signed bytes, exact int32 sums
//   y[i][j]   = (float(acc[i][j]) * xs[i]) * ws[j]        float32 out, or
//   out[i][j] = bf16(float(add[i][j]) + float(f32_to_bf16_v(y)))   BF16 out with the residual add
//
// Integer sums are exact in any order, and the epilogue is w8a8_dequant_row's operations lane by lane,
// so this writes the bits of torch._int_mm followed by w8a8_dequant, without the int32 sums ever
// leaving the cache (the separate dequantisation reads them back from memory: it is bound by memory).
//
// Tiles (palette 1, each 16 rows x 64 bytes): 0-3 the 32 x 32 sums of a block, 4-5 two 16-row slices
// of q (64 k each), 6-7 two 16-column panels of w8, packed per call (pack_panels) so that a tile row
// holds 4 consecutive k of 16 columns:  panel[c][r][4 * n + t] = w8[16 c + n][64 chunk + 4 r + t].
// NOTE: k must be a multiple of 64 and n of 16 (w8a8_amx_fits); rows of q past m are read from a
// zero-padded copy of the last partial block, so any m works. Each call holds the n x k packed panels
// while it runs (one layer's linear: 1.8 MB for the embedded model's gate_up), never between calls.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "spk_amx.h"  // AmxTileConfig: palette 1, eight 16 x 64-byte tiles
#include "spk_w8a8.h"

namespace spk {

#define SPK_AMX_MM __attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8")))
constexpr int64_t AMX_MM_K = AMX_TILE_BYTES;          // k per tile product: a tile row of q
constexpr int64_t AMX_MM_PANEL = AMX_TILE_ROWS;       // columns of a packed panel: a tile of sums is 16 wide
constexpr int64_t AMX_MM_CHUNK = AMX_TILE_ROWS * AMX_TILE_BYTES;  // bytes of a panel per 64 k: one tile
constexpr int64_t AMX_MM_BLOCK = 2 * AMX_TILE_ROWS;  // rows and columns of a block: 2 x 2 tiles of sums
constexpr int64_t AMX_MM_ROWS = 128;  // rows of q per task (4 blocks: each packed panel read 4 times per load)
// NOTE: int32 sums of k products of int8 (|q| <= 127, w8 >= -128) are exact only while 127 * 128 * k < 2^31,
// as for torch._int_mm (products.py); larger k is refused, not wrapped
constexpr int64_t AMX_MM_MAX_K = 131072;

inline bool w8a8_amx_fits(int64_t k, int64_t n) {
    return k > 0 && n > 0 && k <= AMX_MM_MAX_K && k % AMX_MM_K == 0 && n % AMX_MM_PANEL == 0;
}

// The 16-column panel c of w8 (n, k): (k / 64) chunks of 16 rows x 64 bytes, 1 KiB each; a row of a
// chunk gathers the same 4 bytes of 16 rows of w8 (k is a multiple of 64, so each is 4-byte aligned).
// NOTE: k <= AMX_MM_MAX_K keeps the gather's 32-bit indexes (up to 15 k / 4) far from overflow.
SPK_AMX_MM inline void pack_panel(const int8_t* w8, int64_t k, int64_t c, int8_t* out) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)(k / 4)));  // dword index of row n
    const int32_t* base = reinterpret_cast<const int32_t*>(w8 + AMX_MM_PANEL * c * k);
    for (int64_t chunk = 0; chunk < k / AMX_MM_K; ++chunk)
        for (int64_t r = 0; r < AMX_TILE_ROWS; ++r)
            _mm512_storeu_si512((void*)(out + chunk * AMX_MM_CHUNK + r * AMX_TILE_BYTES),
                                _mm512_i32gather_epi32(rows, base + chunk * (AMX_MM_K / 4) + r, 4));
}

// f32_to_bf16 of 16 lanes, in the low halves of the 32-bit lanes
SPK_AMX_MM inline __m512i f32_to_bf16_v(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
}

// The epilogue of one 16-lane run: w8a8_dequant_row's operations (float out, or BF16 with add).
SPK_AMX_MM inline void dequant16(const int32_t* acc, __m512 xs, const float* ws, const uint16_t* add, void* out,
                                 int64_t j) {
    const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)acc)), xs),
                                   _mm512_loadu_ps(ws + j));
    if (!add) {
        _mm512_storeu_ps(static_cast<float*>(out) + j, y);
        return;
    }
    const __m512 yb = _mm512_castsi512_ps(_mm512_slli_epi32(f32_to_bf16_v(y), 16));
    const __m512 a = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(add + j))), 16));
    const __m512i o = f32_to_bf16_v(_mm512_add_ps(a, yb));
    _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(out) + j), _mm512_cvtepi32_epi16(o));
}

// The int32 sums of one 32 x 32 block: 32 rows of q (qb, stride k) against two 16-column panels b0, b1
// (each k / 64 chunks of AMX_MM_CHUNK bytes) into s (32 x 32: columns 0-15 from b0, 16-31 from b1).
// NOTE: the tile intrinsics take immediates: one statement each.
SPK_AMX_MM inline void amx_sums(const int8_t* qb, const int8_t* b0, const int8_t* b1, int64_t k,
                                int32_t (*s)[AMX_MM_BLOCK]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ch = 0; ch < k / AMX_MM_K; ++ch) {
        _tile_loadd(4, qb + ch * AMX_MM_K, k);
        _tile_loadd(5, qb + AMX_TILE_ROWS * k + ch * AMX_MM_K, k);
        _tile_loadd(6, b0 + ch * AMX_MM_CHUNK, AMX_TILE_BYTES);
        _tile_loadd(7, b1 + ch * AMX_MM_CHUNK, AMX_TILE_BYTES);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    _tile_stored(0, &s[0][0], AMX_MM_BLOCK * 4);
    _tile_stored(1, &s[0][AMX_TILE_ROWS], AMX_MM_BLOCK * 4);
    _tile_stored(2, &s[AMX_TILE_ROWS][0], AMX_MM_BLOCK * 4);
    _tile_stored(3, &s[AMX_TILE_ROWS][AMX_TILE_ROWS], AMX_MM_BLOCK * 4);
}

// One 32 x 32 block: rows [i0, i0 + rows) of q (qb: its 32 rows, stride k), columns [16 c, 16 c + 32)
// (or 16 when only one panel is left), sums and epilogue.
SPK_AMX_MM inline void amx_block(const int8_t* qb, const int8_t* panels, int64_t k, int64_t c, int64_t cols,
                                 int64_t i0, int64_t rows, const float* xs, const float* ws, const uint16_t* add,
                                 void* out, bool bf16_out, int64_t n) {
    const int64_t panel = k / AMX_MM_K * AMX_MM_CHUNK;
    const int8_t* b0 = panels + c * panel;
    const int8_t* b1 = cols > AMX_MM_PANEL ? b0 + panel : b0;  // NOTE: a lone last panel repeats; its sums are not read
    alignas(64) int32_t s[AMX_MM_BLOCK][AMX_MM_BLOCK];
    amx_sums(qb, b0, b1, k, s);
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        const __m512 x = _mm512_set1_ps(xs[i]);
        const uint16_t* ar = add ? add + i * n : nullptr;
        void* o = bf16_out ? (void*)(static_cast<uint16_t*>(out) + i * n) : (void*)(static_cast<float*>(out) + i * n);
        for (int64_t h = 0; h < cols; h += 16) dequant16(&s[r][h], x, ws, ar, o, AMX_MM_PANEL * c + h);
    }
}

// The 32-row blocks of q's rows [i0, i1) (stride k): how many, and, when the last one is partial, its rows
// copied into the zero-padded ``pad`` (tile loads read 32 whole rows), which the caller reads instead.
inline int64_t amx_pad_tail(const int8_t* q, int64_t k, int64_t i0, int64_t i1, std::vector<int8_t>& pad) {
    const int64_t blocks = (i1 - i0 + AMX_MM_BLOCK - 1) / AMX_MM_BLOCK, last = i0 + (blocks - 1) * AMX_MM_BLOCK;
    if (i1 - last < AMX_MM_BLOCK) {
        pad.assign((size_t)(AMX_MM_BLOCK * k), 0);
        std::memcpy(pad.data(), q + last * k, (size_t)((i1 - last) * k));
    }
    return blocks;
}

// Rows [i0, i1) of the product (at most AMX_MM_ROWS), every column: each pair of panels (in L1) against
// every 32-row block of the rows in turn. A partial last block of rows is copied into a zero-padded
// buffer first (tile loads read 32 whole rows).
SPK_AMX_MM inline void amx_rows(const int8_t* q, const int8_t* panels, int64_t k, int64_t n, int64_t i0, int64_t i1,
                                const float* xs, const float* ws, const uint16_t* add, void* out, bool bf16_out) {
    const AmxTileConfig cfg;
    _tile_loadconfig(&cfg);
    thread_local std::vector<int8_t> pad;
    const int64_t blocks = amx_pad_tail(q, k, i0, i1, pad);
    for (int64_t c = 0; c < n / AMX_MM_PANEL; c += 2) {
        const int64_t cols = std::min<int64_t>(AMX_MM_BLOCK, n - AMX_MM_PANEL * c);
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t r0 = i0 + b * AMX_MM_BLOCK, rows = std::min<int64_t>(AMX_MM_BLOCK, i1 - r0);
            const int8_t* qb = rows < AMX_MM_BLOCK ? pad.data() : q + r0 * k;
            amx_block(qb, panels, k, c, cols, r0, rows, xs, ws, add, out, bf16_out, n);
        }
    }
    _tile_release();
}

#undef SPK_AMX_MM

}  // namespace spk
