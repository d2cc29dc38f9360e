// The CPU extension's decoder (spk_native.cpp): A. per block, the rANS steps and each
// element's bin and kind; B. per chunk, the raw sections' sizes checked (the numpy
// decoder's checks, in its order) and the unary codes read; C. per block, bit patterns.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "spk_block.h"
#include "spk_fields.h"
#include "spk_rans_step.h"

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

// One block's rANS decode in progress (stage 1 between the two above).
struct RansRun {
    const ChunkStream* cs;
    int64_t b, n, lo, end;
    uint32_t* ctx;  // the block's packed contexts (stage 0)
    uint32_t* js;   // each element's bin
    uint32_t x[SPK_LANES];
    bool failed = false;  // its words ran out (SPK_ERR_WORDS_UNDERRUN)
};

// Scratch of a run: one per block a thread decodes at once. NOTE: kept across calls (fresh pages
// would fault every call)
struct RansScratch {
    std::vector<uint32_t> ctx, js;
};

template <class FX, class FM, bool TAB>
void rans_begin(const DecodeJob& J, int64_t b, RansScratch& scratch, RansRun& r) {
    const Geometry& g = J.g;
    const int64_t c = g.block_chunk[b], lb = b - g.chunk_b0[c];
    r.cs = &J.streams[(size_t)c], r.b = b, r.n = g.block_n[b], r.lo = 0;
    for (int64_t i = 0; i < lb; ++i) r.lo += r.cs->counts[i];
    r.end = r.lo + r.cs->counts[lb];
    scratch.ctx.resize((size_t)r.n), scratch.js.resize((size_t)r.n);
    r.ctx = scratch.ctx.data(), r.js = scratch.js.data();
    block_contexts<FX, FM, TAB>(J, g.block_e0[b], r.n, r.ctx);
    std::memcpy(r.x, r.cs->states + lb * SPK_LANES, sizeof r.x);
}

// Step s of a run (every lane's op, then the renormalisation); marks the run failed when its words run out.
inline void rans_step(const DecodeJob& J, const RansDecodeTables& T, int64_t s, RansRun& r) {
    const int64_t e0s = s * SPK_LANES;
    const uint32_t live = (uint32_t)std::min<int64_t>(SPK_LANES, std::max<int64_t>(r.n - e0s, 0));
    bool ok;
#if SPK_HAVE_AVX2_BUILD
    if (live == SPK_LANES && J.simd && J.simd->wide)
        ok = rans_decode_step_avx512(T, r.ctx + e0s, r.cs->words, r.lo, r.end, r.x, r.js + e0s);
    else
#endif
        ok = rans_decode_step(T, r.ctx + e0s, live, r.cs->words, r.lo, r.end, r.x, r.js + e0s);
    r.failed = !ok;
}

// A finished run: each element's packed info and the block's tallies; status SPK_ERR_WORDS_* or FINAL_STATE.
template <class FX>
int rans_finish(const DecodeJob& J, const RansRun& r, uint32_t* __restrict info, BlockTally& tally) {
    if (r.failed) return SPK_ERR_WORDS_UNDERRUN;  // NOTE: the tallies of a block that failed are never read
    block_classify<FX>(J, r.js, r.ctx, r.n, info, tally);
    if (r.end != r.lo) return SPK_ERR_WORDS_LEFT;
    for (uint32_t l = 0; l < SPK_LANES; ++l)
        if (r.x[l] != SPK_RANS_L) return SPK_ERR_FINAL_STATE;
    return SPK_OK;
}

inline RansDecodeTables rans_tables(const DecodeJob& J) {
    return RansDecodeTables{J.t.off, J.t.cum, J.t.freq, J.t.cum_pad, J.t.bucket, J.simd ? J.simd->op : nullptr};
}

constexpr int RANS_INTERLEAVE = 2;  // blocks a thread decodes at once (decode_blocks_rans)

// The rANS steps of blocks b .. b + count - 1 (count <= RANS_INTERLEAVE), their steps interleaved: each block's
// step is a chain of dependent gathers, and two independent chains keep the core busier than one.
// Each block's info at info + its block_e0, its tally and status as decoding it alone gives.
template <class FX, class FM, bool TAB>
void decode_blocks_rans(const DecodeJob& J, int64_t b, int count, uint32_t* info, BlockTally* tally, int* status) {
    thread_local RansScratch scratch[RANS_INTERLEAVE];
    RansRun run[RANS_INTERLEAVE];
    for (int i = 0; i < count; ++i) rans_begin<FX, FM, TAB>(J, b + i, scratch[i], run[i]);
    const RansDecodeTables T = rans_tables(J);
    for (int64_t s = 0; s < J.g.epl; ++s)
        for (int i = 0; i < count; ++i)
            if (!run[i].failed) rans_step(J, T, s, run[i]);
    for (int i = 0; i < count; ++i)
        status[b + i] = rans_finish<FX>(J, run[i], info + J.g.block_e0[b + i], tally[b + i]);
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
    // C2: each field's start, a running sum per section (spk_fields.h); kind and width come from
    // info (classify_body packed the width)
    const std::array<uint32_t, 4> start{(uint32_t)cs.low[lb], (uint32_t)cs.zman[lb], (uint32_t)cs.esc[lb],
                                        (uint32_t)cs.zero0[lb]};
    field_positions(info, n, start, J.simd->wide, pos, zi);
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
        // NOTE: blocks one at a time where pairs would leave threads idle (fewer blocks than tasks)
        const int per = g.n_blocks >= (int64_t)RANS_INTERLEAVE * threads ? RANS_INTERLEAVE : 1;
        pfor((g.n_blocks + per - 1) / per, threads, [&](int64_t i) {  // per blocks a task (decode_blocks_rans)
            const int64_t b = i * per;
            const int count = (int)std::min<int64_t>(per, g.n_blocks - b);
            decode_blocks_rans<FX, FM, TAB>(J, b, count, info, tally.data(), status.data());
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
