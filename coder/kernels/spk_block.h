// Host orchestration of the per-element pipeline (spk_model.cuh) over rANS blocks:
// the CPU extension's encoder and decoder (spk_native.cpp). A block is 32 lanes
// emulating one warp, exactly as the CUDA kernels (spk_fused.cu) run it: lane l of a
// block codes its elements l, l + 32, ... (step s = element 32 s + l).
#pragma once
#include <cstring>
#include <functional>
#include <vector>

#include "spk_model.cuh"

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
};

inline void prepare_mu_row(const MuJob& j, int64_t row) {  // row = (layer, kv, head)
    const int64_t e0 = row * j.tokens * j.dim;
    const float scale = j.scales ? j.scales[row / j.heads] : 1.0f;
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

// The context of mu at level lv: looked up in the table (BF16) or computed.
template <class FX, class FM, bool TAB>
inline SpkContext context_of(const uint32_t* __restrict tab, uint32_t mu, int32_t lv) {
    if (TAB) return spk_unpack_context(tab[(uint32_t)lv << 16 | mu]);
    return spk_context<FX, FM>(mu, lv);
}

template <class F> inline uint32_t load(const void* a, int64_t i) {
    if (F::bits == 8) return static_cast<const uint8_t*>(a)[i];
    if (F::bits == 16) return static_cast<const uint16_t*>(a)[i];
    return static_cast<const uint32_t*>(a)[i];
}

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
};

struct BlockTally {  // what a decoded block puts in each section
    uint64_t low_bits = 0, n_zero = 0, n_esc = 0, unary_bound = 0;
    uint32_t mu_bad = 0;
};

// rANS steps of one block: each element's packed info; status SPK_ERR_WORDS_* or FINAL_STATE
template <class FX, class FM, bool TAB>
int decode_block_rans(const DecodeJob& J, int64_t b, uint32_t* __restrict info, BlockTally& tally) {
    const Geometry& g = J.g;
    const int64_t c = g.block_chunk[b], e0 = g.block_e0[b], n = g.block_n[b], steps = g.epl;
    const ChunkStream& cs = J.streams[(size_t)c];
    const int64_t lb = b - g.chunk_b0[c];
    int64_t lo = 0;
    for (int64_t i = 0; i < lb; ++i) lo += cs.counts[i];
    int64_t end = lo + cs.counts[lb];
    // NOTE: locals and __restrict: info's u32 stores could otherwise alias every i32 table
    const int32_t* __restrict toff = J.t.off;
    const int32_t* __restrict trad = J.t.radius;
    const int32_t* __restrict lev = J.L;
    const uint16_t* __restrict cum = J.t.cum;
    const uint16_t* __restrict freq = J.t.freq;
    const uint16_t* __restrict cum_pad = J.t.cum_pad;
    const uint16_t* __restrict bucket = J.t.bucket;
    const uint16_t* __restrict words = cs.words;
    const void* mu = J.mu;
    uint64_t low_bits = 0, n_zero = 0, n_esc = 0, unary_bound = 0;
    uint32_t mu_bad = 0;
    uint32_t x[SPK_LANES];
    std::memcpy(x, cs.states + lb * SPK_LANES, sizeof x);
    Cursor cur(g, e0);
    SpkContext ctx[SPK_LANES];
    uint32_t j[SPK_LANES];
    int status = SPK_OK;
    for (int64_t s = 0, e0s = 0; s < steps; ++s, e0s += SPK_LANES) {
        // NOTE: in stages over the 32 lanes (contexts, then table walks, then kinds): each
        // stage's lanes are independent, so their loads overlap instead of chaining
        const uint32_t live = (uint32_t)std::min<int64_t>(SPK_LANES, std::max<int64_t>(n - e0s, 0));
        for (uint32_t l = 0; l < live; ++l, cur.next())
            ctx[l] = context_of<FX, FM, TAB>(J.ctx_table, load<FM>(mu, e0 + e0s + l), lev[cur.channel()]);
        for (uint32_t l = 0; l < live; ++l) {
            const int32_t t = ctx[l].t, off = toff[t];
            j[l] = dec_find_bucketed(cum_pad + off + t, bucket + (size_t)t * SPK_BUCKETS, dec_get(x[l]));
            dec_advance(&x[l], cum[off + j[l]], freq[off + j[l]]);
        }  // padding lanes (l >= live): the no-op leaves the state as it is
        for (uint32_t l = 0; l < live; ++l) {
            const SpkClass k = spk_classify<FX>(j[l], ctx[l], trad[ctx[l].t]);
            info[e0s + l] = pack_info(k.c, ctx[l].k, k.kind, !ctx[l].mu_ok);
            // NOTE: branch-free tallies: an element's kind is data, not a predictable branch
            const uint32_t normal = k.kind == SPK_KIND_NORMAL, zero = k.kind == SPK_KIND_ZERO;
            mu_bad |= !ctx[l].mu_ok & (k.kind != SPK_KIND_ESC);
            low_bits += normal * k.width;
            n_zero += zero, n_esc += k.kind == SPK_KIND_ESC;
            unary_bound += zero * (uint64_t)(ctx[l].k + FX::bias);
        }
        uint32_t ballot = 0;
        for (uint32_t l = 0; l < SPK_LANES; ++l) ballot |= dec_needs(x[l]) << l;
        if (!ballot) continue;
        end -= popcount32(ballot);  // NOTE: read backward: this step's words sit at the end
        if (end < lo) { status = SPK_ERR_WORDS_UNDERRUN; break; }
        // the lane of rank r (among the ballot's lanes, ascending) reads word end + r
        const uint16_t* w = words + end;
        for (uint32_t bits = ballot; bits; bits &= bits - 1u, ++w) {
            const uint32_t l = (uint32_t)__builtin_ctz(bits);
            x[l] = dec_put_word(x[l], *w);
        }
    }
    tally.low_bits = low_bits, tally.n_zero = n_zero, tally.n_esc = n_esc;
    tally.unary_bound = unary_bound, tally.mu_bad = mu_bad;
    if (status) return status;
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
            if (!cs.early) decode_block_values<FX>(J, b, info + g.block_e0[b], cs, flags[b]);
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
    o.deltas.resize(std::max<uint64_t>(nz, 1), 0);  // NOTE: >= 1 entry: the value pass reads one always
    o.n_zero = nz, o.unary_bytes = s_un;
    o.padded.assign(cs.bits, cs.bits + len);
    o.padded.resize(len + 8, 0);
}

}  // namespace spk
