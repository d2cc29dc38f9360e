// Host orchestration of the per-element pipeline (spk_model.cuh) over rANS blocks,
// shared by the CPU extension's encoder (spk_encode.h) and decoder (spk_decode.h):
// tables, batch geometry, mu preparation, raw bit sections. A block is 32 lanes
// emulating one warp, exactly as the CUDA kernels (spk_fused.cu) run it: lane l of a
// block codes its elements l, l + 32, ... (step s = element 32 s + l).
#pragma once
#include <cstring>
#include <algorithm>
#include <functional>
#include <vector>

#include "spk_simd.h"

namespace spk {

struct Tables {  // the Gaussian rows of one residual model, flat (rans_kernels.table_arrays)
    const uint16_t* cum;
    const uint16_t* freq;
    const int32_t* off;     // first symbol of each row
    const int32_t* size;    // symbols of each row
    const int32_t* radius;  // window radius R of each row (ESC = 2R + 1)
    int32_t n_tables;
    int64_t n_symbols;
    const uint16_t* bucket = nullptr;   // decoder: (n_tables, SPK_BUCKETS) first symbol per slot bucket
    const uint16_t* cum_pad = nullptr;  // decoder: cum with a PROB_SCALE sentinel per row (DecodeTables)
};

// The decoder's lookup tables: each row's cum again with a sentinel PROB_SCALE after
// its last symbol (row r starts at off[r] + r), and bucket[t][q] = the symbol of table t
// that holds slot q << SPK_BUCKET_SHIFT.
struct DecodeTables {
    std::vector<uint16_t> cum_pad, bucket;

    explicit DecodeTables(const Tables& t) : bucket((size_t)t.n_tables * SPK_BUCKETS) {
        cum_pad.reserve((size_t)(t.n_symbols + t.n_tables));
        for (int32_t r = 0; r < t.n_tables; ++r) {
            const uint16_t* cum = t.cum + t.off[r];
            cum_pad.insert(cum_pad.end(), cum, cum + t.size[r]);
            cum_pad.push_back((uint16_t)SPK_PROB_SCALE);
            uint32_t j = 0;
            for (uint32_t q = 0; q < SPK_BUCKETS; ++q) {
                while (j + 1u < (uint32_t)t.size[r] && cum[j + 1u] <= (q << SPK_BUCKET_SHIFT)) ++j;
                bucket[(size_t)r * SPK_BUCKETS + q] = (uint16_t)j;
            }
        }
        // NOTE: the vector decoder gathers these u16 arrays 32 bits at a time (cum_pad: two entries a
        // gather, the second past a row's sentinel at most): one spare element each
        cum_pad.push_back(0), bucket.push_back(0);
    }
};

// A batch of consecutive chunks: (layers, 2, heads, tokens, dim) elements, C order.
struct Geometry {
    int64_t heads = 0, tokens = 0, dim = 0, n_rows = 0, n_elements = 0, n_blocks = 0;
    int32_t epl = 0;  // elements per lane: a block holds 32 * epl elements
    std::vector<int64_t> chunk_layers, chunk_e0, chunk_n, chunk_b0, chunk_blocks;
    std::vector<int64_t> block_chunk, block_e0, block_n;

    void init(int64_t h, int64_t t, int64_t d, int32_t el, const std::vector<int64_t>& layers) {
        heads = h, tokens = t, dim = d, epl = el, chunk_layers = layers;
        const int64_t per = (int64_t)SPK_LANES * el;
        for (int64_t c : layers) {
            const int64_t n = c * 2 * h * t * d, nb = (n + per - 1) / per;
            chunk_e0.push_back(n_elements), chunk_n.push_back(n), chunk_b0.push_back(n_blocks);
            chunk_blocks.push_back(nb);
            for (int64_t b = 0; b < nb; ++b) {
                block_chunk.push_back((int64_t)chunk_n.size() - 1);
                block_e0.push_back(n_elements + b * per);
                block_n.push_back(std::min(per, n - b * per));
            }
            n_elements += n, n_blocks += nb, n_rows += c * 2 * h;
        }
    }
};

// Element index -> channel (layer, kv, head, dim) of the per-channel arrays, stepped in order.
struct Cursor {
    int64_t dim, tokens, d, tok, ch;  // ch = row * dim + d
    Cursor(const Geometry& g, int64_t e) : dim(g.dim), tokens(g.tokens) {
        d = e % g.dim, tok = (e / g.dim) % g.tokens, ch = e / (g.dim * g.tokens) * g.dim + d;
    }
    int64_t channel() const { return ch; }
    // the levels of the next n elements (then stepped past them), copied a row of dims at a time
    void fill_levels(const int32_t* __restrict L, int64_t n, int32_t* __restrict out) {
        for (int64_t e = 0; e < n;) {
            const int64_t run = std::min<int64_t>(dim - d, n - e);
            std::memcpy(out + e, L + ch, (size_t)run * sizeof(int32_t));
            e += run, d += run, ch += run;
            if (d == dim) {
                d = 0, ch -= dim;
                if (++tok == tokens) tok = 0, ch += dim;
            }
        }
    }
    void next() {
        ++ch;
        if (++d == dim) {
            d = 0, ch -= dim;
            if (++tok == tokens) tok = 0, ch += dim;
        }
    }
};

// -- mu ----------------------------------------------------------------------------
struct MuJob {
    const uint16_t* mu;  // predictor BF16 bit patterns
    const float *a, *b;  // model 2's (a, b) per channel, or null
    const float* scales; // FP8: per (layer, kv), or null (BF16 KV)
    int64_t heads, tokens, dim;
    void* out;           // u16 BF16 mu' (BF16 KV) or u32 fp32 mu' / scale (FP8 KV)
    bool vector = false; // the AVX2 loops (cpu_has_avx2)
    bool wide = false;   // their AVX-512 builds (cpu_has_avx512)
};

inline void prepare_mu_row(const MuJob& j, int64_t row) {  // row = (layer, kv, head)
    const int64_t e0 = row * j.tokens * j.dim;
    const float scale = j.scales ? j.scales[row / j.heads] : 1.0f;
    if (j.vector) {  // the same bits, a token's dim channels at a time (spk_simd.h)
        thread_local std::vector<uint16_t> tmp;
        tmp.resize((size_t)j.dim);
        for (int64_t tok = 0, e = e0; tok < j.tokens; ++tok, e += j.dim) {
            const uint16_t* m = j.mu + e;
            if (j.a) {
                uint16_t* dst = j.scales ? tmp.data() : static_cast<uint16_t*>(j.out) + e;
                if (j.wide) affine_bf16_avx512(m, j.a + row * j.dim, j.b + row * j.dim, j.dim, dst);
                else affine_bf16_avx2(m, j.a + row * j.dim, j.b + row * j.dim, j.dim, dst);
                m = dst;
            } else if (!j.scales) {
                std::memcpy(static_cast<uint16_t*>(j.out) + e, m, (size_t)j.dim * 2);
            }
            if (j.scales && j.wide) fp8_mu_avx512(m, scale, j.dim, static_cast<uint32_t*>(j.out) + e);
            else if (j.scales) fp8_mu_avx2(m, scale, j.dim, static_cast<uint32_t*>(j.out) + e);
        }
        return;
    }
    for (int64_t tok = 0; tok < j.tokens; ++tok)
        for (int64_t d = 0; d < j.dim; ++d) {
            const int64_t e = e0 + tok * j.dim + d, c = row * j.dim + d;
            uint32_t m = j.mu[e];
            if (j.a) m = spk_affine_bf16(m, j.a[c], j.b[c]);
            if (j.scales) static_cast<uint32_t*>(j.out)[e] = spk_fp8_mu(m, scale);
            else static_cast<uint16_t*>(j.out)[e] = (uint16_t)m;
        }
}

// -- raw bit sections, MSB first (coder/bitpack.py) ------------------------------------
struct BitWriter {
    std::vector<uint8_t> bytes;  // the first len are written; finish() trims to them
    size_t len = 0;
    uint64_t acc = 0, nbits = 0;
    int nacc = 0;  // pending bits in acc (< 32 between calls)

    void put(uint32_t v, int w) {  // v < 2^w, w <= 32
        acc = (acc << w) | v, nacc += w, nbits += (uint64_t)w;
        if (nacc >= 32) {
            nacc -= 32;
            const uint32_t be = __builtin_bswap32((uint32_t)(acc >> nacc));  // MSB first
            if (len + 4 > bytes.size()) bytes.resize(2 * bytes.size() + 256);
            std::memcpy(bytes.data() + len, &be, 4);
            len += 4;
        }
    }
    void put_unary(uint32_t delta) {  // delta zeros, then a one
        for (; delta >= 16; delta -= 16) put(0, 16);
        put(1, (int)delta + 1);
    }
    void finish() {  // pad with zero bits to a byte boundary
        bytes.resize(len);
        while (nacc >= 8) bytes.push_back((uint8_t)(acc >> (nacc - 8))), nacc -= 8;
        if (nacc) bytes.push_back((uint8_t)(acc << (8 - nacc))), nacc = 0;
        len = bytes.size();
    }
    void append(const BitWriter& src) {  // src finished: its first src.nbits bits
        uint64_t left = src.nbits;
        const uint8_t* p = src.bytes.data();
        for (; left >= 32; left -= 32, p += 4)
            put((uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3], 32);
        for (; left >= 8; left -= 8, ++p) put(*p, 8);
        if (left) put((uint32_t)*p >> (8 - left), (int)left);
    }
};

// w <= 16 bits at bit position pos of a buffer padded with >= 8 readable bytes
inline uint32_t read_bits(const uint8_t* buf, uint64_t pos, uint32_t w) {
    uint32_t v;
    std::memcpy(&v, buf + (pos >> 3), 4);  // NOTE: the stream is MSB-first: a big-endian load
    v = __builtin_bswap32(v);
    return (uint32_t)((uint64_t)(v << (pos & 7)) >> (32 - w));  // NOTE: u64: w = 0 shifts by 32
}

// The BF16 context table of spk_context_bf16_lookup, built once per process (~1 ms).
inline const uint32_t* bf16_context_table() {
    struct Table {
        std::vector<uint32_t> v;
        Table() : v(SPK_CTX_ENTRIES) { for (int32_t i = 0; i < SPK_CTX_ENTRIES; ++i) v[(size_t)i] = spk_ctx_entry(i); }
    };
    static const Table t;  // NOTE: thread-safe initialisation (C++11 statics)
    return t.v.data();
}

// The context of mu at level lv: looked up in the table (BF16) or computed.
template <class FX, class FM, bool TAB>
inline SpkContext context_of(const uint32_t* __restrict tab, uint32_t mu, int32_t lv) {
    if (TAB) return spk_context_bf16_lookup(tab, mu, lv);
    return spk_context<FX, FM>(mu, lv);
}

template <class F> inline uint32_t load(const void* a, int64_t i) {
    if (F::bits == 8) return static_cast<const uint8_t*>(a)[i];
    if (F::bits == 16) return static_cast<const uint16_t*>(a)[i];
    return static_cast<const uint32_t*>(a)[i];
}

}  // namespace spk
