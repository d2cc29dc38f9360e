// The CPU extension's encoder (spk_native.cpp): per block, contexts, symbols and the
// block's own raw bit sections in element order, then its 32 lanes' rANS steps (last
// first); per chunk, words and sections concatenated (FORMAT.md's layout).
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <array>

#include "spk_block.h"

namespace spk {

// -- encode ----------------------------------------------------------------------------
struct EncodeJob {
    const Geometry& g;
    const Tables& t;
    const void* x;     // u16 BF16 / u8 e4m3 bit patterns
    const void* mu;    // u16 BF16 mu' / u32 fp32 mu' / scale
    const int32_t* L;  // log2 sigma per channel (1/8 octave, in x's units)
    bool fp8;
    const uint32_t* ctx_table = nullptr;  // BF16: bf16_context_table() (or null: computed)
    const SimdTables* simd = nullptr;     // on an AVX2 CPU: the vector stages' tables and ISA (or null)
};

struct EncodedBlock {
    uint32_t states[SPK_LANES];
    std::vector<uint16_t> words;  // encoder order
    BitWriter sec[4];             // LOW, ZMAN, ESC, UNARY
};

// Stage A, scalar (any format; the fallback of the vector stages): ops and bit descriptors
template <class FX, class FM, bool TAB>
void symbols_scalar(const EncodeJob& J, int64_t e0, int64_t n, const int32_t* __restrict lev,
                    uint32_t* __restrict ops, uint32_t* __restrict desc) {
    const int32_t* __restrict toff = J.t.off;
    const int32_t* __restrict trad = J.t.radius;
    const uint16_t* __restrict cum = J.t.cum;
    const uint16_t* __restrict freq = J.t.freq;
    for (int64_t e = 0; e < n; ++e) {
        const SpkContext ctx = context_of<FX, FM, TAB>(J.ctx_table, load<FM>(J.mu, e0 + e), lev[e]);
        const SpkSymbol s = spk_symbolize<FX>(load<FX>(J.x, e0 + e), ctx, trad[ctx.t]);
        const int64_t idx = toff[ctx.t] + s.j;
        ops[e] = cum[idx] | (uint32_t)freq[idx] << 16;
        desc[e] = pack_desc(s.field, s.width, s.kind, ctx.k);
    }
}

// Stage B: the block's raw bit sections, in element order. LOW (most elements) goes through a
// 64-bit container whose pending bits sit at its top, MSB first: each field is OR-ed in just below
// them, and after every low_batch<FX>() fields the container's whole bytes are stored at once (8
// bytes written, the pointer moved by the whole ones), so no branch depends on the bit count. The
// rare kinds go through their BitWriters.
// NOTE: a LOW field is at most FX::mant bits (spk_low_bits), so a batch adds at most 56 bits to the
// <= 7 left after a store: the container never overflows, and 63 - k - w >= 0 in the OR's shift.
template <class FX>
constexpr int low_batch() { return 56 / FX::mant; }

struct LowWriter {  // the container: k pending bits at the top of `top`, whole bytes stored at out
    uint64_t top;
    int k;
    uint8_t* out;

    void put(uint64_t field, int w) {  // field < 2^w, k + w <= 63; NOTE: two shifts: w = 0 at k = 0
        top |= field << (63 - k - w) << 1;
        k += w;
    }
    void store() {  // the whole bytes out (8 written: the buffer has room), at most 7 bits stay
        const uint64_t be = __builtin_bswap64(top);
        std::memcpy(out, &be, 8);
        const int whole = k & ~7;
        out += whole >> 3;
        top <<= whole;  // NOTE: whole < 64 (k <= 63)
        k -= whole;
    }
};

// The LOW section's container, opened over its BitWriter's bytes with room for n more fields.
template <class FX>
inline LowWriter open_low(BitWriter& low, int64_t n) {
    // room for the pending bits (< 32), every LOW field, and the last 8-byte store
    low.bytes.resize(low.len + (size_t)(n * FX::mant / 8 + 16));
    // the writer's pending bits (its acc's low nacc) at the container's top
    LowWriter lw{low.nacc ? low.acc << (64 - low.nacc) : 0, low.nacc, low.bytes.data() + low.len};
    lw.store();
    return lw;
}

// ... and closed: its bits back into the BitWriter, every section finished.
inline void close_low(LowWriter& lw, EncodedBlock& o) {
    BitWriter& low = o.sec[SPK_KIND_NORMAL];
    lw.store();
    // NOTE: the LOW bits written, from where the container ends (no running sum in the loop)
    low.nbits += (uint64_t)(8 * (lw.out - (low.bytes.data() + low.len)) + lw.k - low.nacc);
    low.acc = lw.k ? lw.top >> (64 - lw.k) : 0, low.nacc = lw.k;
    low.len = (size_t)(lw.out - low.bytes.data());
    for (auto& s : o.sec) s.finish();
}

// A rare kind's bits (ZERO: ZMAN and UNARY; ESC), to its own sections.
template <class FX>
inline void put_rare(uint32_t d, const void* x, int64_t e, EncodedBlock& o) {
    const uint32_t kind = d >> 21 & 3u;
    o.sec[kind].put(d & 0xFFFFu, (int)(d >> 16 & 31u));
    if (kind == SPK_KIND_ZERO) {  // unary exponent distance below the grid: k + bias - 1 - e
        const int32_t kk = (int32_t)(d >> 23) - 128;
        o.sec[3].put_unary((uint32_t)(kk + FX::bias - 1 - (int32_t)((load<FX>(x, e) >> FX::mant) & FX::exp_mask)));
    }
}

template <class FX>
void put_bits(const uint32_t* __restrict desc, const void* x, int64_t e0, int64_t n, EncodedBlock& o) {
    LowWriter lw = open_low<FX>(o.sec[SPK_KIND_NORMAL], n);
    int batch = 0;
    for (int64_t e = 0; e < n; ++e) {
        const uint32_t d = desc[e], kind = d >> 21 & 3u, w = d >> 16 & 31u;
        if (kind == SPK_KIND_NORMAL) {  // NOTE: a well-predicted branch
            lw.put(d & 0xFFFFu, (int)w);
            if (++batch == low_batch<FX>()) lw.store(), batch = 0;  // NOTE: periodic: predicted
            continue;
        }
        put_rare<FX>(d, x, e0 + e, o);
    }
    close_low(lw, o);
}

// Stage C: the block's 32 lanes' rANS steps, last op first.
inline void rans_block(const uint32_t* __restrict ops, int64_t steps, EncodedBlock& o) {
    thread_local std::vector<uint16_t> words_buf;  // at most one word per op
    words_buf.resize((size_t)(steps * SPK_LANES) + 1);
    uint16_t* __restrict words = words_buf.data();
    uint32_t* x = o.states;
    for (uint32_t l = 0; l < SPK_LANES; ++l) x[l] = SPK_RANS_L;
    size_t count = 0;
    for (int64_t s = steps - 1; s >= 0; --s) {  // NOTE: LIFO, the last op first
        const uint32_t* op = ops + s * SPK_LANES;
        for (uint32_t l = 0; l < SPK_LANES; ++l) {  // lanes in ascending order = ballot order
            uint16_t w;
            const uint32_t emit = enc_put(&x[l], op[l] & 0xFFFFu, op[l] >> 16, &w);
            words[count] = w;
            count += emit;
        }
    }
    o.words.assign(words, words + count);
}

#if SPK_HAVE_AVX2_BUILD
// Stage C on AVX-512: rans_block's steps (enc_put) for the 32 lanes as two vectors of 16, lane for
// lane the same integers; each step's renormalisation words leave in lane order (compressed, then
// narrowed to 16 bits), as the scalar loop's ballot order.
// NOTE: s / freq from a float32 division, then one exact correction: float(s) and the quotient each
// round once (< 2^-23 relative together), so the estimate of q = floor(s / freq) < 2^17 is off by at
// most one, and r = s - q * freq (exact mod 2^32: |r| < 2 freq) says which way.
static_assert(SPK_LANES == 32, "rans_block_avx512 holds a block's lanes in two vectors of 16");
SPK_AVX512 inline void rans_block_avx512(const uint32_t* __restrict ops, int64_t steps, EncodedBlock& o) {
    thread_local std::vector<uint16_t> words_buf;
    words_buf.resize((size_t)(steps * SPK_LANES) + 16);  // NOTE: each step's store writes 16 words
    uint16_t* __restrict words = words_buf.data();
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    __m512i x[2] = {_mm512_set1_epi32((int)SPK_RANS_L), _mm512_set1_epi32((int)SPK_RANS_L)};
    size_t count = 0;
    for (int64_t s = steps - 1; s >= 0; --s) {  // NOTE: LIFO, the last op first
        for (int h = 0; h < 2; ++h) {
            const __m512i op = _mm512_loadu_si512((const void*)(ops + s * SPK_LANES + 16 * h));
            const __m512i start = _mm512_and_si512(op, low16), freq = _mm512_srli_epi32(op, 16);
            const __mmask16 emit = _mm512_cmpge_epu32_mask(_mm512_srli_epi32(x[h], SPK_X_MAX_SHIFT), freq);
            const __m512i w = _mm512_maskz_compress_epi32(emit, _mm512_and_si512(x[h], low16));
            _mm256_storeu_si256((__m256i*)(words + count), _mm512_cvtepi32_epi16(w));
            count += (size_t)__builtin_popcount(emit);
            const __m512i v = _mm512_mask_srli_epi32(x[h], emit, x[h], SPK_WORD_BITS);
            __m512i q = _mm512_cvttps_epu32(_mm512_div_ps(_mm512_cvtepu32_ps(v), _mm512_cvtepu32_ps(freq)));
            __m512i r = _mm512_sub_epi32(v, _mm512_mullo_epi32(q, freq));
            const __mmask16 over = _mm512_cmplt_epi32_mask(r, _mm512_setzero_si512());  // q one too large
            q = _mm512_mask_sub_epi32(q, over, q, _mm512_set1_epi32(1)), r = _mm512_mask_add_epi32(r, over, r, freq);
            const __mmask16 under = _mm512_cmpge_epi32_mask(r, freq);  // q one too small
            q = _mm512_mask_add_epi32(q, under, q, _mm512_set1_epi32(1)), r = _mm512_mask_sub_epi32(r, under, r, freq);
            x[h] = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(q, SPK_PROB_BITS), r), start);
        }
    }
    _mm512_storeu_si512((void*)o.states, x[0]);
    _mm512_storeu_si512((void*)(o.states + 16), x[1]);
    o.words.assign(words, words + count);
}

// Per 8-lane mask: the lanes it sets, in ascending order (the rest 0): a compress as a permutation.
constexpr std::array<std::array<uint8_t, 8>, 256> compress_lut8() {
    std::array<std::array<uint8_t, 8>, 256> t{};
    for (unsigned m = 0; m < 256; ++m)
        for (unsigned l = 0, k = 0; l < 8; ++l)
            if (m >> l & 1u) t[m][k++] = (uint8_t)l;
    return t;
}
inline constexpr auto COMPRESS_LUT8 = compress_lut8();

// Stage C on AVX2: the same steps for the 32 lanes as four vectors of 8, the quotient as on AVX-512
// (AVX2 converts only signed int32: s goes to float by its 16-bit halves). The compare of s >> 17
// (< 2^15) with freq (<= 2^15) is signed. Each vector's emitting lanes' words leave in lane order,
// compressed by a permutation (COMPRESS_LUT8).
SPK_AVX2 inline void rans_block_avx2(const uint32_t* __restrict ops, int64_t steps, EncodedBlock& o) {
    const auto& lut = COMPRESS_LUT8;
    thread_local std::vector<uint16_t> words_buf;
    words_buf.resize((size_t)(steps * SPK_LANES) + 8);  // NOTE: each store writes 8 words
    uint16_t* __restrict words = words_buf.data();
    const __m256i low16 = _mm256_set1_epi32(0xFFFF);
    __m256i x[4];
    for (auto& v : x) v = _mm256_set1_epi32((int)SPK_RANS_L);
    size_t count = 0;
    for (int64_t s = steps - 1; s >= 0; --s) {  // NOTE: LIFO, the last op first
        for (int h = 0; h < 4; ++h) {
            const __m256i op = _mm256_loadu_si256((const __m256i*)(ops + s * SPK_LANES + 8 * h));
            const __m256i start = _mm256_and_si256(op, low16), freq = _mm256_srli_epi32(op, 16);
            // emit where (s >> 17) >= freq: not freq > (s >> 17)
            const __m256i keep = _mm256_cmpgt_epi32(freq, _mm256_srli_epi32(x[h], SPK_X_MAX_SHIFT));
            const unsigned emit = ~(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(keep)) & 0xFFu;
            const __m256i w = _mm256_permutevar8x32_epi32(_mm256_and_si256(x[h], low16),
                                                          _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)lut[emit].data())));
            // NOTE: packus saturates int32 to uint16: the words are 0..0xFFFF, so it narrows exactly
            _mm_storeu_si128((__m128i*)(words + count),
                             _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
            count += (size_t)__builtin_popcount(emit);
            const __m256i v = _mm256_blendv_epi8(_mm256_srli_epi32(x[h], SPK_WORD_BITS), x[h], keep);
            // float(v) for v < 2^32 in one rounding: its halves convert exactly, 2^16 hi is exact
            const __m256 vf = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 16)),
                                                          _mm256_set1_ps(65536.0f)),
                                            _mm256_cvtepi32_ps(_mm256_and_si256(v, low16)));
            __m256i q = _mm256_cvttps_epi32(_mm256_div_ps(vf, _mm256_cvtepi32_ps(freq)));
            __m256i r = _mm256_sub_epi32(v, _mm256_mullo_epi32(q, freq));
            const __m256i over = _mm256_cmpgt_epi32(_mm256_setzero_si256(), r);  // q one too large
            q = _mm256_add_epi32(q, over), r = _mm256_add_epi32(r, _mm256_and_si256(over, freq));
            const __m256i under = _mm256_cmpgt_epi32(r, _mm256_sub_epi32(freq, _mm256_set1_epi32(1)));  // r >= freq
            q = _mm256_sub_epi32(q, under), r = _mm256_sub_epi32(r, _mm256_and_si256(under, freq));
            x[h] = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(q, SPK_PROB_BITS), r), start);
        }
    }
    for (int h = 0; h < 4; ++h) _mm256_storeu_si256((__m256i*)(o.states + 8 * h), x[h]);
    o.words.assign(words, words + count);
}
#endif

#if SPK_HAVE_AVX2_BUILD
// Stage B on AVX-512, eight elements a step, the same bits as put_bits. A step's LOW fields (a
// rare kind's: width 0) become one value, MSB first: with s_i the inclusive prefix sum of the
// widths and W = s_7, field i sits at bit W - s_i; W <= 8 FX::mant <= 56, so one put and one store
// a step keep LowWriter's invariant. The rare kinds follow, in element order, to their sections.
template <class FX>
SPK_AVX512 void put_bits_avx512(const uint32_t* __restrict desc, const void* x, int64_t e0, int64_t n,
                                EncodedBlock& o) {
    static_assert(8 * FX::mant <= 56, "a step's LOW bits fit one put");
    LowWriter lw = open_low<FX>(o.sec[SPK_KIND_NORMAL], n);
    const __m512i three = _mm512_set1_epi64(3), w31 = _mm512_set1_epi64(31), f16 = _mm512_set1_epi64(0xFFFF);
    const __m512i up1 = _mm512_set_epi64(6, 5, 4, 3, 2, 1, 0, 0), up2 = _mm512_set_epi64(5, 4, 3, 2, 1, 0, 0, 0);
    const __m512i up4 = _mm512_set_epi64(3, 2, 1, 0, 0, 0, 0, 0), last = _mm512_set1_epi64(7);
    int64_t e = 0;
    for (; e + 8 <= n; e += 8) {
        const __m512i d = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i*)(desc + e)));
        const __mmask8 normal = _mm512_testn_epi64_mask(_mm512_srli_epi64(d, 21), three);  // kind 0
        const __m512i w = _mm512_maskz_and_epi64(normal, _mm512_srli_epi64(d, 16), w31);
        __m512i s = w;  // inclusive prefix sums over the 8 lanes
        s = _mm512_add_epi64(s, _mm512_maskz_permutexvar_epi64(0xFE, up1, s));
        s = _mm512_add_epi64(s, _mm512_maskz_permutexvar_epi64(0xFC, up2, s));
        s = _mm512_add_epi64(s, _mm512_maskz_permutexvar_epi64(0xF0, up4, s));
        const __m512i total = _mm512_permutexvar_epi64(last, s);
        const __m512i fields = _mm512_sllv_epi64(_mm512_maskz_and_epi64(normal, d, f16), _mm512_sub_epi64(total, s));
        lw.put((uint64_t)_mm512_reduce_or_epi64(fields), (int)_mm_cvtsi128_si64(_mm512_castsi512_si128(total)));
        lw.store();
        for (unsigned m = ~(unsigned)normal & 0xFFu; m; m &= m - 1) {
            const int i = __builtin_ctz(m);
            put_rare<FX>(desc[e + i], x, e0 + e + i, o);
        }
    }
    for (; e < n; ++e) {  // the tail: under 8 fields, at most 49 bits on the <= 7 a store leaves
        const uint32_t d = desc[e];
        if ((d >> 21 & 3u) == SPK_KIND_NORMAL) lw.put(d & 0xFFFFu, (int)(d >> 16 & 31u));
        else put_rare<FX>(d, x, e0 + e, o);
    }
    close_low(lw, o);
}
#endif

template <class FX, class FM, bool TAB>
void encode_block_t(const EncodeJob& J, int64_t b, EncodedBlock& o) {
    const int64_t e0 = J.g.block_e0[b], n = J.g.block_n[b], steps = J.g.epl;
    // NOTE: per-thread scratch, kept across calls (fresh pages would fault every call)
    thread_local std::vector<uint32_t> ops_buf, desc_buf;
    thread_local std::vector<int32_t> lev_buf;
    ops_buf.resize((size_t)(steps * SPK_LANES)), desc_buf.resize((size_t)n), lev_buf.resize((size_t)n);
    std::fill(ops_buf.begin() + n, ops_buf.end(), SPK_PROB_SCALE << 16);  // padding: the no-op
    Cursor(J.g, e0).fill_levels(J.L, n, lev_buf.data());
    if (J.simd)
        symbols_vec<FX>(static_cast<const typename Io<FX>::X*>(J.x) + e0,
                         static_cast<const typename Io<FX>::Mu*>(J.mu) + e0, lev_buf.data(), n, *J.simd,
                         ops_buf.data(), desc_buf.data());
    else
        symbols_scalar<FX, FM, TAB>(J, e0, n, lev_buf.data(), ops_buf.data(), desc_buf.data());
#if SPK_HAVE_AVX2_BUILD
    if (J.simd && J.simd->wide) put_bits_avx512<FX>(desc_buf.data(), J.x, e0, n, o);
    else put_bits<FX>(desc_buf.data(), J.x, e0, n, o);
#else
    put_bits<FX>(desc_buf.data(), J.x, e0, n, o);
#endif
#if SPK_HAVE_AVX2_BUILD
    if (J.simd) return J.simd->wide ? rans_block_avx512(ops_buf.data(), steps, o)
                                    : rans_block_avx2(ops_buf.data(), steps, o);
#endif
    rans_block(ops_buf.data(), steps, o);
}

// -- the encoder's cost sample (coder/adapt.py element_costs) -------------------------------
// Exact coded cost (1/256 bits: sym_cost[freq] plus the raw bits) and surprises (escapes,
// and symbols costing >= surprise) of one group's n elements at levels lev (one a scalar).
struct CostJob {
    const EncodeJob& J;      // x, mu and tables; J.L unused (levels come per element)
    const int32_t* lev;      // (groups, n) levels, shifts applied
    const int32_t* sym_cost; // per frequency 0..PROB_SCALE
    int32_t surprise;        // a symbol costing this much or more is a surprise
    int64_t n;               // elements per group
};

template <class FX, class FM, bool TAB>
void group_cost_t(const CostJob& C, int64_t g, int64_t* cost, int64_t* surprises) {
    const int64_t e0 = g * C.n, n = C.n;
    thread_local std::vector<uint32_t> ops_buf, desc_buf;
    ops_buf.resize((size_t)n), desc_buf.resize((size_t)n);
    uint32_t* ops = ops_buf.data();
    uint32_t* desc = desc_buf.data();
    if (C.J.simd)
        symbols_vec<FX>(static_cast<const typename Io<FX>::X*>(C.J.x) + e0,
                         static_cast<const typename Io<FX>::Mu*>(C.J.mu) + e0, C.lev + e0, n, *C.J.simd, ops, desc);
    else
        symbols_scalar<FX, FM, TAB>(C.J, e0, n, C.lev + e0, ops, desc);
    int64_t total = 0, hits = 0;
    for (int64_t e = 0; e < n; ++e) {
        const uint32_t d = desc[e], kind = d >> 21 & 3u;
        const int32_t sym = C.sym_cost[ops[e] >> 16];
        int32_t raw = (int32_t)(d >> 16 & 31u);
        if (kind == SPK_KIND_ZERO)  // the unary code too: delta zeros and a one
            raw += (int32_t)(d >> 23) - 128 + FX::bias - (int32_t)((load<FX>(C.J.x, e0 + e) >> FX::mant) & FX::exp_mask);
        total += sym + ((int64_t)raw << 8);
        hits += (kind == SPK_KIND_ESC) | (sym >= C.surprise);
    }
    cost[g] = total, surprises[g] = hits;
}

inline void group_cost(const CostJob& C, int64_t g, int64_t* cost, int64_t* surprises) {
    if (C.J.fp8) group_cost_t<SpkE4M3, SpkFP32, false>(C, g, cost, surprises);
    else if (C.J.ctx_table) group_cost_t<SpkBF16, SpkBF16, true>(C, g, cost, surprises);
    else group_cost_t<SpkBF16, SpkBF16, false>(C, g, cost, surprises);
}

inline void encode_block(const EncodeJob& J, int64_t b, EncodedBlock& o) {
    if (J.fp8) encode_block_t<SpkE4M3, SpkFP32, false>(J, b, o);
    else if (J.ctx_table) encode_block_t<SpkBF16, SpkBF16, true>(J, b, o);
    else encode_block_t<SpkBF16, SpkBF16, false>(J, b, o);
}

// Stage B: a chunk's four strings (states, word counts, words, raw sections: the container's
// order) written in place. Their sizes first (chunk_layout), then each block's states, count and
// words at its offsets (place_block) and each chunk's raw sections (place_bits), all independent
// tasks over the caller's threads. NOTE: no intermediate copy of a chunk: py_encode allocates
// the strings and the tasks write straight into them.
struct ChunkLayout {
    int64_t b0 = 0, nb = 0;        // the chunk's blocks
    size_t words = 0;              // its u16 words
    size_t bits_bytes = 0;         // its four sections, each padded to a byte
    std::vector<size_t> word_off;  // each block's first word within the chunk
};

inline ChunkLayout chunk_layout(const Geometry& g, int64_t c, const std::vector<EncodedBlock>& blocks) {
    ChunkLayout L;
    L.b0 = g.chunk_b0[c], L.nb = g.chunk_blocks[c];
    L.word_off.resize((size_t)L.nb);
    for (int64_t k = 0; k < L.nb; ++k) L.word_off[k] = L.words, L.words += blocks[L.b0 + k].words.size();
    for (int s = 0; s < 4; ++s) {
        uint64_t n = 0;
        for (int64_t k = 0; k < L.nb; ++k) n += blocks[L.b0 + k].sec[s].nbits;
        L.bits_bytes += (size_t)((n + 7) / 8);
    }
    return L;
}

struct ChunkDst {
    uint8_t *states, *counts, *words, *bits;
};

// block k of its chunk: its lane states, its word count (u32) and its words at their offsets
inline void place_block(const EncodedBlock& e, int64_t k, const ChunkLayout& L, const ChunkDst& d) {
    std::memcpy(d.states + 4 * SPK_LANES * k, e.states, 4 * SPK_LANES);
    const uint32_t n = (uint32_t)e.words.size();
    std::memcpy(d.counts + 4 * k, &n, 4);
    if (n) std::memcpy(d.words + 2 * L.word_off[k], e.words.data(), 2 * (size_t)n);
}

// the chunk's raw sections LOW | ZMAN | ESC | UNARY, each its blocks' bits in order, byte-padded
inline void place_bits(const std::vector<EncodedBlock>& blocks, const ChunkLayout& L, uint8_t* dst) {
    for (int s = 0; s < 4; ++s) {
        BitWriter w;
        for (int64_t k = 0; k < L.nb; ++k) w.append(blocks[L.b0 + k].sec[s]);
        w.finish();
        if (!w.bytes.empty()) std::memcpy(dst, w.bytes.data(), w.bytes.size());
        dst += w.bytes.size();
    }
}

}  // namespace spk
