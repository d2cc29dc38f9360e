// The CPU extension's decoder (spk_native.cpp): A. per block, the rANS steps and each
// element's bin and kind; B. per chunk, the raw sections' sizes checked (the numpy
// decoder's checks, in its order) and the unary codes read; C. per block, bit patterns.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "spk_block.h"

namespace spk {

// -- decode ----------------------------------------------------------------------------
struct ChunkStream {  // one chunk record's coded data (container-checked lengths)
    const uint32_t* states;
    const uint32_t* counts;
    const uint16_t* words;
    int64_t n_words;
    const uint8_t* bits;
    int64_t n_bits_bytes;
};

struct DecodeJob {
    const Geometry& g;
    const Tables& t;
    const void* mu;
    const int32_t* L;  // as in EncodeJob
    void* out;
    bool fp8;
    const std::vector<ChunkStream>& streams;
    const uint32_t* ctx_table = nullptr;  // as in EncodeJob
    const SimdTables* simd = nullptr;     // as in EncodeJob
};

struct BlockTally {  // what a decoded block puts in each section
    uint64_t low_bits = 0, n_zero = 0, n_esc = 0, unary_bound = 0;
    uint32_t mu_bad = 0;
};

// Stage 0: the packed contexts (spk_pack_context) of a block's n elements.
template <class FX, class FM, bool TAB>
void block_contexts(const DecodeJob& J, int64_t e0, int64_t n, uint32_t* __restrict ctx) {
    thread_local std::vector<int32_t> lev_buf;
    lev_buf.resize((size_t)n);
    int32_t* __restrict lev = lev_buf.data();
    Cursor(J.g, e0).fill_levels(J.L, n, lev);
    if (J.simd) {
        contexts_vec<FX>(*J.simd, static_cast<const typename Io<FX>::Mu*>(J.mu) + e0, lev, n, ctx);
        return;
    }
    for (int64_t e = 0; e < n; ++e)
        ctx[e] = spk_pack_context(context_of<FX, FM, TAB>(J.ctx_table, load<FM>(J.mu, e0 + e), lev[e]));
}

// Stage 2: each element's packed info from its symbol and context, and the block's tallies.
template <class FX>
void block_classify(const DecodeJob& J, const uint32_t* __restrict js, const uint32_t* __restrict ctx, int64_t n,
                    uint32_t* __restrict info, BlockTally& tally) {
    const int32_t* __restrict trad = J.t.radius;
    if (J.simd) {
        Tallies32 t;
        classify_vec<FX>(*J.simd, js, ctx, n, trad, info, t);
        tally.low_bits = t.low_bits, tally.n_zero = t.n_zero, tally.n_esc = t.n_esc;
        tally.unary_bound = t.unary_bound, tally.mu_bad = t.mu_bad != 0;
        return;
    }
    uint64_t low_bits = 0, n_zero = 0, n_esc = 0, unary_bound = 0;
    uint32_t mu_bad = 0;
    for (int64_t e = 0; e < n; ++e) {
        const SpkContext c = spk_unpack_context(ctx[e]);
        const SpkClass k = spk_classify<FX>(js[e], c, trad[c.t]);
        info[e] = pack_info(k.c, c.k, k.kind, !c.mu_ok);
        // NOTE: branch-free tallies: an element's kind is data, not a predictable branch
        const uint32_t normal = k.kind == SPK_KIND_NORMAL, zero = k.kind == SPK_KIND_ZERO;
        mu_bad |= !c.mu_ok & (k.kind != SPK_KIND_ESC);
        low_bits += normal * k.width;
        n_zero += zero, n_esc += k.kind == SPK_KIND_ESC;
        unary_bound += zero * (uint64_t)(c.k + FX::bias);
    }
    tally.low_bits = low_bits, tally.n_zero = n_zero, tally.n_esc = n_esc;
    tally.unary_bound = unary_bound, tally.mu_bad = mu_bad;
}

// What a rANS decode step reads of the model's tables.
struct RansDecodeTables {
    const int32_t* toff;
    const uint16_t *cum, *freq, *cum_pad, *bucket;
    const uint32_t* op;  // cum | freq << 16 per symbol, or null
};

// One step's rANS ops of lanes [0, live) and its renormalisation (the scalar stage 1's step);
// false when the step's words run under lo.
inline bool rans_decode_step(const RansDecodeTables& T, const uint32_t* __restrict ctx, uint32_t live,
                             const uint16_t* words, int64_t lo, int64_t& end, uint32_t* x, uint32_t* __restrict js) {
    for (uint32_t l = 0; l < live; ++l) {  // NOTE: the lanes are independent: their loads overlap
        const int32_t t = (int32_t)(ctx[l] & 0x3FFu), off = T.toff[t];
        const uint32_t j = dec_find_bucketed(T.cum_pad + off + t, T.bucket + (size_t)t * SPK_BUCKETS, dec_get(x[l]));
        if (T.op) dec_advance(&x[l], T.op[off + j] & 0xFFFFu, T.op[off + j] >> 16);  // one load for both
        else dec_advance(&x[l], T.cum[off + j], T.freq[off + j]);
        js[l] = j;
    }  // padding lanes (l >= live): the no-op leaves the state as it is
    uint32_t ballot = 0;
    for (uint32_t l = 0; l < SPK_LANES; ++l) ballot |= dec_needs(x[l]) << l;
    if (!ballot) return true;
    end -= popcount32(ballot);  // NOTE: read backward: this step's words sit at the end
    if (end < lo) return false;
    // the lane of rank r (among the ballot's lanes, ascending) reads word end + r
    const uint16_t* w = words + end;
    for (uint32_t bits = ballot; bits; bits &= bits - 1u, ++w) {
        const uint32_t l = (uint32_t)__builtin_ctz(bits);
        x[l] = dec_put_word(x[l], *w);
    }
    return true;
}

#if SPK_HAVE_AVX2_BUILD
// rans_decode_step on AVX-512 for a whole step (every lane live): 16 lanes at a time, the tables
// gathered (the u16 ones 32 bits at a time, the low half kept: DecodeTables leaves a spare element),
// the symbol search stepping only the lanes still below their slot, and the words of the lanes that
// renormalise expanded into them in lane order (a masked load: nothing read past the step's words).
SPK_AVX512 inline bool rans_decode_step_avx512(const RansDecodeTables& T, const uint32_t* __restrict ctx,
                                               const uint16_t* words, int64_t lo, int64_t& end, uint32_t* x,
                                               uint32_t* __restrict js) {
    const __m512i low16 = _mm512_set1_epi32(0xFFFF), one = _mm512_set1_epi32(1);
    __m512i xv[2];
    __mmask16 need[2];
    for (int h = 0; h < 2; ++h) {
        const __m512i t = _mm512_and_si512(_mm512_loadu_si512((const void*)(ctx + 16 * h)), _mm512_set1_epi32(0x3FF));
        const __m512i off = _mm512_i32gather_epi32(t, (const void*)T.toff, 4);
        __m512i v = _mm512_loadu_si512((const void*)(x + 16 * h));
        const __m512i slot = _mm512_and_si512(v, _mm512_set1_epi32((int)SPK_PROB_MASK));
        const __m512i row = _mm512_add_epi32(off, t);  // the row's first entry in cum_pad
        const __m512i q = _mm512_add_epi32(_mm512_mullo_epi32(t, _mm512_set1_epi32((int)SPK_BUCKETS)),
                                           _mm512_srli_epi32(slot, SPK_BUCKET_SHIFT));
        __m512i j = _mm512_and_si512(_mm512_i32gather_epi32(q, (const void*)T.bucket, 2), low16);
        // dec_find_bucketed: step up while cum[j + 1] <= slot, two entries a gather (cum[j + 1] in the
        // low half, cum[j + 2] in the high): a lane goes on only after two steps
        for (__mmask16 m = 0xFFFF; m;) {
            const __m512i at = _mm512_add_epi32(_mm512_add_epi32(row, j), one);
            const __m512i c = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, at, (const void*)T.cum_pad, 2);
            const __mmask16 s1 = _mm512_mask_cmple_epu32_mask(m, _mm512_and_si512(c, low16), slot);
            m = _mm512_mask_cmple_epu32_mask(s1, _mm512_srli_epi32(c, 16), slot);
            j = _mm512_mask_add_epi32(_mm512_mask_add_epi32(j, s1, j, one), m, j, _mm512_set1_epi32(2));
        }
        const __m512i opv = _mm512_i32gather_epi32(_mm512_add_epi32(off, j), (const void*)T.op, 4);
        // dec_advance: freq * (x >> PROB_BITS) + slot - start
        v = _mm512_sub_epi32(_mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(opv, 16),
                                                                  _mm512_srli_epi32(v, SPK_PROB_BITS)), slot),
                             _mm512_and_si512(opv, low16));
        _mm512_storeu_si512((void*)(js + 16 * h), j);
        xv[h] = v;
        need[h] = _mm512_cmplt_epu32_mask(v, _mm512_set1_epi32((int)SPK_RANS_L));
    }
    const uint32_t n0 = (uint32_t)__builtin_popcount(need[0]), n1 = (uint32_t)__builtin_popcount(need[1]);
    if (n0 + n1) {
        end -= n0 + n1;  // NOTE: read backward: this step's words sit at the end
        if (end < lo) return false;
        const uint16_t* w = words + end;
        for (int h = 0; h < 2; ++h) {
            const __mmask16 m = need[h];
            const __m512i wv = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)((1u << __builtin_popcount(m)) - 1u),
                                                                           (const void*)(h ? w + n0 : w)));
            xv[h] = _mm512_mask_or_epi32(xv[h], m, _mm512_slli_epi32(xv[h], SPK_WORD_BITS), _mm512_maskz_expand_epi32(m, wv));
        }
    }
    _mm512_storeu_si512((void*)x, xv[0]);
    _mm512_storeu_si512((void*)(x + 16), xv[1]);
    return true;
}
#endif

// The rANS steps of one block (stage 1 between the two above): each element's packed
// info and the block's tallies; status SPK_ERR_WORDS_* or FINAL_STATE.
template <class FX, class FM, bool TAB>
int decode_block_rans(const DecodeJob& J, int64_t b, uint32_t* __restrict info, BlockTally& tally) {
    const Geometry& g = J.g;
    const int64_t c = g.block_chunk[b], e0 = g.block_e0[b], n = g.block_n[b], steps = g.epl;
    const ChunkStream& cs = J.streams[(size_t)c];
    const int64_t lb = b - g.chunk_b0[c];
    int64_t lo = 0;
    for (int64_t i = 0; i < lb; ++i) lo += cs.counts[i];
    int64_t end = lo + cs.counts[lb];
    thread_local std::vector<uint32_t> ctx_buf, j_buf;
    ctx_buf.resize((size_t)n), j_buf.resize((size_t)n);
    uint32_t* __restrict ctx = ctx_buf.data();
    uint32_t* __restrict js = j_buf.data();
    block_contexts<FX, FM, TAB>(J, e0, n, ctx);
    const RansDecodeTables T{J.t.off, J.t.cum, J.t.freq, J.t.cum_pad, J.t.bucket, J.simd ? J.simd->op : nullptr};
    uint32_t x[SPK_LANES];
    std::memcpy(x, cs.states + lb * SPK_LANES, sizeof x);
    for (int64_t s = 0, e0s = 0; s < steps; ++s, e0s += SPK_LANES) {
        const uint32_t live = (uint32_t)std::min<int64_t>(SPK_LANES, std::max<int64_t>(n - e0s, 0));
        bool ok;
#if SPK_HAVE_AVX2_BUILD
        if (live == SPK_LANES && J.simd && J.simd->wide)
            ok = rans_decode_step_avx512(T, ctx + e0s, cs.words, lo, end, x, js + e0s);
        else
#endif
            ok = rans_decode_step(T, ctx + e0s, live, cs.words, lo, end, x, js + e0s);
        if (!ok) return SPK_ERR_WORDS_UNDERRUN;  // NOTE: the tallies of a block that failed here are never read
    }
    block_classify<FX>(J, js, ctx, n, info, tally);
    if (end != lo) return SPK_ERR_WORDS_LEFT;
    for (uint32_t l = 0; l < SPK_LANES; ++l)
        if (x[l] != SPK_RANS_L) return SPK_ERR_FINAL_STATE;
    return SPK_OK;
}

struct ChunkSections {  // where each block's raw fields start (bits), the unary codes, the checks
    std::vector<uint64_t> low, zman, esc, zero0;
    std::vector<uint32_t> deltas;  // one per zero-bin element (0 where the codes ran out)
    std::vector<uint8_t> padded;   // the chunk's bits + 8 zero bytes (read_bits reads ahead)
    int early = SPK_OK;            // SHORT or UNARY_LONG: nothing could be read
    bool pad_low = false, pad_zman = false, pad_esc = false, mu_bad = false;
    uint64_t n_zero = 0, ones = 0, unary_bytes = 0, unary_bits = 0;  // the unary checks' figures
    uint64_t detail = 0;           // SHORT: the bytes present
};

void chunk_sections(const DecodeJob& J, int64_t c, const std::vector<BlockTally>& tally, int mant, int bits,
                    ChunkSections& o);

struct BlockFlags {  // value checks of one block (decode pass C)
    uint32_t normal_bad = 0, zero_bad = 0;
};

template <class FX>
void decode_block_values(const DecodeJob& J, int64_t b, const uint32_t* info, const ChunkSections& cs,
                         BlockFlags& f) {
    const Geometry& g = J.g;
    const int64_t lb = b - g.chunk_b0[g.block_chunk[b]], e0 = g.block_e0[b], n = g.block_n[b];
    uint64_t low = cs.low[lb], zman = cs.zman[lb], esc = cs.esc[lb], z = cs.zero0[lb];
    const uint8_t* buf = cs.padded.data();
    uint8_t* __restrict out8 = static_cast<uint8_t*>(J.out) + e0;
    uint16_t* __restrict out16 = static_cast<uint16_t*>(J.out) + e0;
    uint32_t normal_bad = 0, zero_bad = 0;
    for (int64_t e = 0; e < n; ++e) {
        const uint32_t in = info[e], kind = in >> 22 & 3u;
        const int32_t c = (int32_t)(in & 0x3FFFu) - 8192, k = (int32_t)(in >> 14 & 0xFFu) - 128;
        uint32_t v;
        // NOTE: most elements are NORMAL (a well-predicted branch); zero bins and escapes are rare
        if (__builtin_expect(kind == SPK_KIND_NORMAL, 1)) {
            const uint32_t w = (uint32_t)spk_max(spk_low_bits<FX>(spk_magnitude(c)), 0);
            v = spk_normal_value<FX>(k, c, read_bits(buf, low, w), &normal_bad);
            low += w;
        } else if (kind == SPK_KIND_ZERO) {
            v = spk_zero_value<FX>(k, c, read_bits(buf, zman, FX::mant), cs.deltas[z++], &zero_bad);
            zman += FX::mant;
        } else {
            v = read_bits(buf, esc, FX::bits);
            esc += FX::bits;
        }
        if (FX::bits == 8) out8[e] = (uint8_t)v;
        else out16[e] = (uint16_t)v;
    }
    f.normal_bad = normal_bad, f.zero_bad = zero_bad;
}

// decode_block_values on the vector path (spk_simd.h, stage C); the same values and flags.
template <class FX>
void decode_block_values_vector(const DecodeJob& J, int64_t b, const uint32_t* info, const ChunkSections& cs,
                                BlockFlags& f) {
    const Geometry& g = J.g;
    const int64_t lb = b - g.chunk_b0[g.block_chunk[b]], e0 = g.block_e0[b], n = g.block_n[b];
    thread_local std::vector<uint32_t> pos_buf, zi_buf;
    pos_buf.resize((size_t)n), zi_buf.resize((size_t)n);
    uint32_t* __restrict pos = pos_buf.data();
    uint32_t* __restrict zi = zi_buf.data();
    // C2: each field's start, a running sum per section (selects, not branches); kind and width
    // come from info (classify_body packed the width)
    uint32_t sums[4] = {(uint32_t)cs.low[lb], (uint32_t)cs.zman[lb], (uint32_t)cs.esc[lb], (uint32_t)cs.zero0[lb]};
    int64_t e = 0;
#if SPK_HAVE_AVX2_BUILD
    if (J.simd->wide) e = positions_avx512(info, n, sums, pos, zi);  // whole groups of 16; the rest below
#endif
    uint32_t low = sums[0], zman = sums[1], esc = sums[2], z = sums[3];
    for (; e < n; ++e) {
        const uint32_t kind = info[e] >> 22 & 3u, w = info[e] >> INFO_WIDTH_SHIFT & 31u;
        const uint32_t normal = kind == SPK_KIND_NORMAL, zero = kind == SPK_KIND_ZERO;
        pos[e] = normal ? low : zero ? zman : esc;
        zi[e] = z;
        low += normal ? w : 0, zman += zero ? w : 0, esc += kind == SPK_KIND_ESC ? w : 0, z += zero;
    }
    compose_vec<FX>(*J.simd, info, pos, zi, n, cs.padded.data(), cs.deltas.data(),
                    static_cast<uint8_t*>(J.out) + e0 * (FX::bits / 8), f.normal_bad, f.zero_bad);
}

using ParallelFor = void (*)(int64_t, int, const std::function<void(int64_t)>&);

struct Decoder {
    const DecodeJob& J;
    explicit Decoder(const DecodeJob& j) : J(j) {}

    // Runs the three passes; on error, the status and the first failing chunk (block:
    // the rANS checks' block, or -1) and up to two figures for the message.
    int run(int threads, int64_t* where, ParallelFor pfor) {
        if (J.fp8) return run_t<SpkE4M3, SpkFP32, false>(threads, where, pfor);
        if (J.ctx_table) return run_t<SpkBF16, SpkBF16, true>(threads, where, pfor);
        return run_t<SpkBF16, SpkBF16, false>(threads, where, pfor);
    }

  private:
    template <class FX, class FM, bool TAB>
    int run_t(int threads, int64_t* where, ParallelFor pfor) {
        const Geometry& g = J.g;
        // NOTE: one scratch per calling thread, kept: fresh pages would cost their faults every call
        // (and a pointer to it for the workers: a thread_local named in a lambda is the worker's own)
        thread_local std::vector<uint32_t> scratch;
        if (scratch.size() < (size_t)g.n_elements) scratch.resize((size_t)g.n_elements);
        uint32_t* const info = scratch.data();
        std::vector<BlockTally> tally((size_t)g.n_blocks);
        std::vector<int> status((size_t)g.n_blocks, SPK_OK);
        pfor(g.n_blocks, threads, [&](int64_t b) {
            status[b] = decode_block_rans<FX, FM, TAB>(J, b, info + g.block_e0[b], tally[b]);
        });
        for (size_t b = 0; b < status.size(); ++b)
            if (status[b]) {
                where[0] = g.block_chunk[b], where[1] = (int64_t)b - g.chunk_b0[where[0]];
                return status[b];
            }
        const int64_t nc = (int64_t)g.chunk_layers.size();
        std::vector<ChunkSections> secs((size_t)nc);
        pfor(nc, threads, [&](int64_t c) { chunk_sections(J, c, tally, FX::mant, FX::bits, secs[c]); });
        std::vector<BlockFlags> flags((size_t)g.n_blocks);
        pfor(g.n_blocks, threads, [&](int64_t b) {
            const ChunkSections& cs = secs[g.block_chunk[b]];
            if (cs.early) return;
            // NOTE: the vector pass keeps bit positions in uint32 (spk_simd.h)
            if (J.simd && cs.padded.size() < (1u << 28)) decode_block_values_vector<FX>(J, b, info + g.block_e0[b], cs, flags[b]);
            else decode_block_values<FX>(J, b, info + g.block_e0[b], cs, flags[b]);
        });
        for (int64_t c = 0; c < nc; ++c) {
            BlockFlags f;
            for (int64_t b = g.chunk_b0[c]; b < g.chunk_b0[c] + g.chunk_blocks[c]; ++b)
                f.normal_bad |= flags[b].normal_bad, f.zero_bad |= flags[b].zero_bad;
            if (int s = chunk_status(secs[c], f, where + 2)) {
                where[0] = c, where[1] = -1;
                return s;
            }
        }
        return SPK_OK;
    }

    // the numpy decoder's order of checks (model.desymbolize, bitpack)
    static int chunk_status(const ChunkSections& s, const BlockFlags& f, int64_t* fig) {
        if (s.early == SPK_ERR_SHORT) return fig[0] = (int64_t)s.detail, SPK_ERR_SHORT;
        if (s.early) return s.early;
        if (s.pad_low) return SPK_ERR_PADDING;
        if (f.normal_bad) return SPK_ERR_NO_FINITE;
        if (s.pad_zman) return SPK_ERR_PADDING;
        if (s.ones != s.n_zero) return fig[0] = (int64_t)s.n_zero, fig[1] = (int64_t)s.ones, SPK_ERR_UNARY_COUNT;
        if (s.n_zero ? (s.unary_bits + 7) / 8 != s.unary_bytes : s.unary_bytes != 0)
            return fig[0] = (int64_t)s.unary_bytes, fig[1] = (int64_t)s.unary_bits, SPK_ERR_UNARY_TAIL;
        if (f.zero_bad) return SPK_ERR_ZERO_EXP;
        if (s.pad_esc) return SPK_ERR_PADDING;
        if (s.mu_bad) return SPK_ERR_NOT_ESCAPED;
        return SPK_OK;
    }
};

// Section sizes of chunk c from its blocks' tallies, checked as bitpack does: the
// fixed-width sections' sizes follow from the symbols, UNARY takes the rest; padding
// bits are zero; the unary codes are exactly n_zero and end in the section's last byte.
inline void chunk_sections(const DecodeJob& J, int64_t c, const std::vector<BlockTally>& tally, int mant, int bits,
                           ChunkSections& o) {
    const Geometry& g = J.g;
    const ChunkStream& cs = J.streams[(size_t)c];
    uint64_t low = 0, nz = 0, ne = 0, ubound = 0;
    std::vector<uint64_t> esc0;
    for (int64_t b = g.chunk_b0[c]; b < g.chunk_b0[c] + g.chunk_blocks[c]; ++b) {
        o.low.push_back(low), o.zero0.push_back(nz), esc0.push_back(ne);
        low += tally[b].low_bits, nz += tally[b].n_zero, ne += tally[b].n_esc;
        ubound += tally[b].unary_bound, o.mu_bad |= tally[b].mu_bad != 0;
    }
    const uint64_t s_low = (low + 7) / 8, s_zman = (nz * mant + 7) / 8, s_esc = (ne * bits + 7) / 8;
    const uint64_t len = (uint64_t)cs.n_bits_bytes;
    if (s_low + s_zman + s_esc > len) { o.early = SPK_ERR_SHORT, o.detail = len; return; }
    const uint64_t s_un = len - s_low - s_zman - s_esc;
    // NOTE: bound the open-ended section before reading it: each code is at most k + bias bits
    if (8 * s_un > ubound + 7) { o.early = SPK_ERR_UNARY_LONG; return; }
    auto padding = [&](uint64_t end) { return end % 8 && (cs.bits[end / 8] & ((1u << (8 - end % 8)) - 1u)); };
    o.pad_low = padding(low), o.pad_zman = padding(s_low * 8 + nz * mant);
    o.pad_esc = padding((s_low + s_zman) * 8 + ne * bits);
    for (size_t b = 0; b < o.low.size(); ++b)
        o.zman.push_back(s_low * 8 + o.zero0[b] * mant), o.esc.push_back((s_low + s_zman) * 8 + esc0[b] * bits);
    // unary codes: delta zeros then a one, MSB first
    const uint8_t* u = cs.bits + (len - s_un);
    o.deltas.reserve(nz);
    uint64_t prev = ~0ull;
    for (uint64_t i = 0; i < s_un; ++i)
        for (uint32_t byte = u[i]; byte; byte &= ~(0x80u >> (spk_clz32(byte) - 24))) {
            const uint64_t pos = i * 8 + (uint64_t)(spk_clz32(byte) - 24);
            if (o.deltas.size() < nz) o.deltas.push_back((uint32_t)std::min<uint64_t>(pos - prev - 1, 1u << 30));
            prev = pos, ++o.ones, o.unary_bits = pos + 1;
        }
    o.deltas.resize(nz + 1, 0);  // NOTE: one past the last: the vector value pass reads it for later elements
    o.n_zero = nz, o.unary_bytes = s_un;
    o.padded.assign(cs.bits, cs.bits + len);
    o.padded.resize(len + 8, 0);
}

}  // namespace spk
