// The int8 attention's AMX path (spk_attn.h's math): 16 query rows per pass, both products as tile
// dot products (TDPBUSD: unsigned bytes by signed bytes, exact int32 sums), so they are the VNNI
// path's integers; every float step is the VNNI path's own (attn_block_weights' steps for 16 rows, the same
// score and output expressions in the same order), so the same bits.
//
//   scores  C[16 rows][16 keys] += A: q8 + 128 (16 rows, D bytes)  x  B: k4 (D / 4 rows, 16 keys x 4)
//   P @ V   C[16 rows][16 dims] += A: u (16 rows, 64 keys)         x  B: v4 (16 key quads, 16 dims x 4)
//
// NOTE: Linux hands a thread AMX's tile state only after arch_prctl(ARCH_REQ_XCOMP_PERM) for the
// process (amx_int8_ready); each pass loads its own tile configuration and releases it.
#pragma once
#include "spk_amx.h"
#include "spk_attn.h"

namespace spk {

#define SPK_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
constexpr int ATT_AMX_D = 64;    // the head size the tiles take: one 64-byte tile row per query row
constexpr int ATT_AMX_ROWS = 16; // query rows per pass (a tile's rows)

// The tiles (AmxTileConfig): 0 scores, then P @ V dims 0-15; 1 queries; 2 keys; 3 weights (scores:
// keys); 4 values; 5-7 P @ V dims 16-63 (5: scores too).

// One key group's int32 scores s (16 x 16) -> x: as attn_scores4, (float(S - ksum) * c) * ks.
SPK_AMX inline void attn_scores16_store(const AttnPacked& p, const int32_t (*s)[16], const float* c, int64_t kb,
                                        float* x, int64_t x_stride) {
    const __m512i ksum = _mm512_loadu_si512((const void*)(p.ksum + kb * 16));
    const __m512 ks = _mm512_loadu_ps(p.ks + kb * 16);
    for (int r = 0; r < 16; ++r) {
        const __m512 sr = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512((const void*)s[r]), ksum));
        _mm512_storeu_ps(x + r * x_stride + kb * 16, _mm512_mul_ps(_mm512_mul_ps(sr, _mm512_set1_ps(c[r])), ks));
    }
}

// Scores x (16 rows of stride x_stride) of query rows qu (16 rows x D bytes) against keys [0, 16 groups).
// NOTE: two key groups per step, in tiles 0 and 5 (keys in 2 and 3, free until P @ V), so one
// product runs while the other's result is stored and converted.
SPK_AMX inline void attn_scores16_amx(const AttnPacked& p, const uint8_t* qu, const float* c, int64_t groups,
                                      float* x, int64_t x_stride) {
    constexpr int64_t D = ATT_AMX_D, KG = (D / 4) * 64;  // bytes of one key group's tile
    alignas(64) int32_t s[2][16][16];
    _tile_loadd(1, qu, D);
    int64_t kb = 0;
    for (; kb + 2 <= groups; kb += 2) {
        _tile_zero(0);
        _tile_zero(5);
        _tile_loadd(2, p.k4 + kb * KG, 64);
        _tile_loadd(3, p.k4 + (kb + 1) * KG, 64);
        _tile_dpbusd(0, 1, 2);
        _tile_dpbusd(5, 1, 3);
        _tile_stored(0, s[0], 64);
        _tile_stored(5, s[1], 64);
        attn_scores16_store(p, s[0], c, kb, x, x_stride);
        attn_scores16_store(p, s[1], c, kb + 1, x, x_stride);
    }
    if (kb < groups) {
        _tile_zero(0);
        _tile_loadd(2, p.k4 + kb * KG, 64);
        _tile_dpbusd(0, 1, 2);
        _tile_stored(0, s[0], 64);
        attn_scores16_store(p, s[0], c, kb, x, x_stride);
    }
}

// P @ V of one key block for 16 rows of weights u (16 x 64 bytes): sums (16 x D int32).
SPK_AMX inline void attn_pv16_amx(const int8_t* vb, const uint8_t* u, int32_t* sums) {
    constexpr int64_t D = ATT_AMX_D, VS = D * 4;  // a key quad's row of v4
    _tile_loadd(3, u, ATT_KEY_BLOCK);
    // NOTE: the tile intrinsics are statements (tile numbers are immediates): one per line
    _tile_zero(0);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(4, vb, VS);
    _tile_dpbusd(0, 3, 4);
    _tile_loadd(4, vb + 64, VS);
    _tile_dpbusd(5, 3, 4);
    _tile_loadd(4, vb + 128, VS);
    _tile_dpbusd(6, 3, 4);
    _tile_loadd(4, vb + 192, VS);
    _tile_dpbusd(7, 3, 4);
    _tile_stored(0, sums, VS);
    _tile_stored(5, sums + 16, VS);
    _tile_stored(6, sums + 32, VS);
    _tile_stored(7, sums + 48, VS);
}

constexpr int64_t ATT_DACC_BLOCKS = 8;  // key blocks between folds of the lanes' denominator sums (tests cross it)

// attn_block_weights for the 16 rows at once (rows past `rows` are left alone: zero weights): each
// row's steps as there, except that
// - the two divisions per row (P_MAX / bm, bm / P_MAX) run as one vector division for all 16 rows
//   (the same IEEE quotient in each lane as the scalar division), off each row's chain of latency;
// - the denominator's integer terms stay in per-lane int32 sums (dacc) until the caller folds them
//   into den: integer sums, exact in any order. NOTE: a term is at most 2^20 (+1), four a lane per
//   block, so a lane stays under 2^31 for up to 511 blocks; folding every ATT_DACC_BLOCKS keeps
//   the fold itself on the tests' paths (1100 tokens: 17 blocks).
SPK_AMX inline void attn_block_weights16(const AttnPacked& p, const float* x, int64_t x_stride, const float* m,
                                         int64_t r0, int rows, int64_t b0, uint8_t (*u)[ATT_KEY_BLOCK],
                                         int32_t (*dacc)[16], float* bs) {
    constexpr int R = ATT_AMX_ROWS;
    alignas(64) float w[R][ATT_KEY_BLOCK];
    alignas(64) float bm[R];
    __mmask16 live = 0;  // rows whose block has a weight above 0
    for (int r = 0; r < R; ++r) {
        bm[r] = 1.0f;
        if (r >= rows) continue;
        __m512i dsum = _mm512_load_si512((const void*)dacc[r]);
        const float b = attn_block_w(p, x + r * x_stride, m[r], r0 + r, b0, w[r], dsum);
        _mm512_store_si512((void*)dacc[r], dsum);
        if (b > 0.0f) {
            bm[r] = b;
            live = (__mmask16)(live | (1u << r));
        }
    }
    const __m512 bmv = _mm512_load_ps(bm);
    alignas(64) float inv[R];
    _mm512_store_ps(inv, _mm512_maskz_div_ps(live, _mm512_set1_ps(ATT_P_MAX), bmv));
    _mm512_store_ps(bs, _mm512_maskz_div_ps(live, bmv, _mm512_set1_ps(ATT_P_MAX)));
    for (int r = 0; r < rows; ++r) {
        if ((live >> r) & 1u)
            attn_block_u(w[r], inv[r], u[r]);
        else
            std::memset(u[r], 0, ATT_KEY_BLOCK);
    }
}

// The lanes' denominator sums of each row into den (exact), the lanes zeroed.
SPK_AMX inline void attn_fold_den(int32_t (*dacc)[16], int64_t* den, int rows) {
    for (int r = 0; r < rows; ++r) {
        den[r] += _mm512_reduce_add_epi32(_mm512_load_si512((const void*)dacc[r]));
        std::memset(dacc[r], 0, sizeof(dacc[r]));
    }
}

// Rows r0 .. r0 + rows - 1 (at most 16) from their scores: attn_rows4_pv's steps for 16 rows.
SPK_AMX inline void attn_rows16_pv_amx(const AttnPacked& p, const float* x, int64_t x_stride, int64_t r0, int rows,
                                       uint16_t* o, int64_t o_stride) {
    constexpr int64_t D = ATT_AMX_D, R = ATT_AMX_ROWS;
    float m[R];
    alignas(64) float out[R][D];
    alignas(64) uint8_t u[R][ATT_KEY_BLOCK];
    alignas(64) int32_t sums[R][D];
    int64_t den[R] = {};
    alignas(64) int32_t dacc[R][16] = {};
    for (int r = 0; r < rows; ++r) {
        m[r] = attn_row_max(x + r * x_stride, r0 + r);
        std::memset(out[r], 0, sizeof(out[r]));
    }
    std::memset(u, 0, sizeof(u));  // NOTE: rows past `rows` keep zero weights
    const int64_t last = r0 + rows - 1;
    for (int64_t b0 = 0; b0 <= last; b0 += ATT_KEY_BLOCK) {
        alignas(64) float bs[R];
        attn_block_weights16(p, x, x_stride, m, r0, rows, b0, u, dacc, bs);
        if ((b0 / ATT_KEY_BLOCK + 1) % ATT_DACC_BLOCKS == 0) attn_fold_den(dacc, den, rows);
        attn_pv16_amx(p.v4 + (b0 / 4) * D * 4, u[0], sums[0]);
        for (int r = 0; r < rows; ++r) {
            const __m512 vs = _mm512_set1_ps(bs[r]);
            for (int c = 0; c < D / 16; ++c) {
                const __m512 add = _mm512_mul_ps(vs, _mm512_cvtepi32_ps(_mm512_load_si512((const void*)(sums[r] + 16 * c))));
                _mm512_store_ps(out[r] + 16 * c, _mm512_add_ps(_mm512_load_ps(out[r] + 16 * c), add));
            }
        }
    }
    attn_fold_den(dacc, den, rows);
    for (int r = 0; r < rows; ++r) {
        const __m512 denf = _mm512_set1_ps((float)den[r] * (1.0f / (float)(1 << ATT_DEN_BITS)));
        for (int c = 0; c < D / 16; ++c)
            _mm512_store_ps(out[r] + 16 * c, _mm512_div_ps(_mm512_load_ps(out[r] + 16 * c), denf));
        uint16_t* orow = o + (r0 + r) * o_stride;
        for (int64_t d = 0; d < D; ++d) orow[d] = f32_to_bf16(out[r][d]);
    }
}

// AMX path of attn_rows: query rows [i0, i1) of one head, D == ATT_AMX_D (amx_int8_ready() first).
SPK_AMX inline void attn_rows_amx(const AttnPacked& p, const float* qs, float rsd, int64_t i0, int64_t i1,
                                  uint16_t* o, int64_t o_stride) {
    constexpr int64_t D = ATT_AMX_D, R = ATT_AMX_ROWS;
    const AmxTileConfig cfg;
    _tile_loadconfig(&cfg);
    const int64_t stride = pad_to(i1, ATT_KEY_BLOCK);  // NOTE: a row's last key block is read whole
    float* x = attn_scratch((size_t)(R * stride));
    for (int64_t r0 = i0; r0 < i1; r0 += R) {
        const int rows = (int)std::min<int64_t>(R, i1 - r0);
        float c[R];
        for (int r = 0; r < R; ++r) c[r] = r < rows ? qs[r0 + r] * rsd : 0.0f;
        // NOTE: rows past i1 repeat the last row's operands (their scores are never read)
        alignas(64) uint8_t qpad[R * D];
        const uint8_t* qu = p.qu + r0 * D;
        if (rows < R) {
            for (int r = 0; r < R; ++r) std::memcpy(qpad + r * D, qu + std::min(r, rows - 1) * D, D);
            qu = qpad;
        }
        attn_scores16_amx(p, qu, c, pad_to(r0 + rows, 16) / 16, x, stride);
        attn_rows16_pv_amx(p, x, stride, r0, rows, o, o_stride);
    }
    _tile_release();
}

#undef SPK_AMX

}  // namespace spk
