// The CPU extension's encoder (spk_native.cpp): per block, contexts, symbols and the
// block's own raw bit sections in element order, then its 32 lanes' rANS steps (last
// first); per chunk, words and sections concatenated (FORMAT.md's layout).
#pragma once
#include "spk_block.h"

namespace spk {

// -- encode ----------------------------------------------------------------------------
struct EncodeJob {
    const Geometry& g;
    const Tables& t;
    const void* x;     // u16 BF16 / u8 e4m3 bit patterns
    const void* mu;    // u16 BF16 mu' / u32 fp32 mu' / scale
    const int32_t* L;  // log2 sigma per channel (1/8 octave, in x's units), or its row of ctx_table
    bool fp8;
    const uint32_t* ctx_table = nullptr;  // BF16: packed contexts, 65536 per sigma level (or null)
};

struct EncodedBlock {
    uint32_t states[SPK_LANES];
    std::vector<uint16_t> words;  // encoder order
    BitWriter sec[4];             // LOW, ZMAN, ESC, UNARY
};

template <class FX, class FM, bool TAB>
void encode_block_t(const EncodeJob& J, int64_t b, EncodedBlock& o) {
    const int64_t e0 = J.g.block_e0[b], n = J.g.block_n[b], steps = J.g.epl;
    // NOTE: per-thread scratch, kept across calls (fresh pages would fault every call), and
    // __restrict locals: the u32 op stores could otherwise alias every i32 table
    thread_local std::vector<uint32_t> ops_buf;    // (start | freq << 16) per element, block order
    thread_local std::vector<uint16_t> words_buf;  // at most one word per op
    ops_buf.assign((size_t)(steps * SPK_LANES), SPK_PROB_SCALE << 16);  // padding: the no-op
    words_buf.resize((size_t)(steps * SPK_LANES) + 1);
    uint32_t* __restrict ops = ops_buf.data();
    uint16_t* __restrict words = words_buf.data();
    const int32_t* __restrict toff = J.t.off;
    const int32_t* __restrict trad = J.t.radius;
    const int32_t* __restrict lev = J.L;
    const uint16_t* __restrict cum = J.t.cum;
    const uint16_t* __restrict freq = J.t.freq;
    Cursor cur(J.g, e0);
    for (int64_t e = 0; e < n; ++e, cur.next()) {
        const SpkContext ctx = context_of<FX, FM, TAB>(J.ctx_table, load<FM>(J.mu, e0 + e), lev[cur.channel()]);
        const SpkSymbol s = spk_symbolize<FX>(load<FX>(J.x, e0 + e), ctx, trad[ctx.t]);
        const int64_t idx = toff[ctx.t] + s.j;
        ops[e] = cum[idx] | (uint32_t)freq[idx] << 16;
        o.sec[s.kind].put(s.field, (int)s.width);
        if (s.kind == SPK_KIND_ZERO) o.sec[3].put_unary(s.delta);
    }
    for (auto& s : o.sec) s.finish();
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

inline void encode_block(const EncodeJob& J, int64_t b, EncodedBlock& o) {
    if (J.fp8) encode_block_t<SpkE4M3, SpkFP32, false>(J, b, o);
    else if (J.ctx_table) encode_block_t<SpkBF16, SpkBF16, true>(J, b, o);
    else encode_block_t<SpkBF16, SpkBF16, false>(J, b, o);
}

struct EncodedChunk {
    std::vector<uint32_t> states, counts;
    std::vector<uint16_t> words;
    std::vector<uint8_t> bits;  // LOW | ZMAN | ESC | UNARY, each byte-padded
};

inline void assemble_chunk(const Geometry& g, int64_t c, const std::vector<EncodedBlock>& blocks, EncodedChunk& o) {
    const int64_t b0 = g.chunk_b0[c], b1 = b0 + g.chunk_blocks[c];
    size_t nw = 0;
    for (int64_t b = b0; b < b1; ++b) nw += blocks[b].words.size();
    o.words.reserve(nw);
    for (int64_t b = b0; b < b1; ++b) {
        o.states.insert(o.states.end(), blocks[b].states, blocks[b].states + SPK_LANES);
        o.counts.push_back((uint32_t)blocks[b].words.size());
        o.words.insert(o.words.end(), blocks[b].words.begin(), blocks[b].words.end());
    }
    for (int s = 0; s < 4; ++s) {
        BitWriter w;
        for (int64_t b = b0; b < b1; ++b) w.append(blocks[b].sec[s]);
        w.finish();
        o.bits.insert(o.bits.end(), w.bytes.begin(), w.bytes.end());
    }
}

}  // namespace spk
