// speckv's fused, device-resident coder (CuPy RawModule / NVRTC; coder/cuda.py drives it).
//
// The per-element model (spk_model.cuh) and the rANS lane steps (rans_lane.cuh) are the
// very code the CPU extension runs (spk_encode.h, spk_decode.h); the bytes are identical. One warp codes
// one rANS block: lane l codes elements l, l + 32, ... of its block (step s = 32 s + l).
//
// Encode:  spk_encode_count_*  per block: contexts + symbols, bits of LOW/ZMAN/ESC/UNARY
//          host: per-chunk section offsets (exclusive sums of the block counts)
//          spk_encode_write_*  per block, steps last first: the symbols again, each raw field
//                              OR-ed in at its bit position, the rANS steps (LIFO) with
//                              ballot-compacted words into a per-block scratch
//          spk_gather          scratch -> contiguous words (offsets: exclusive sum of counts)
// Decode:  spk_decode_rans_*   per block: rANS forward (bucketed symbol search), each
//                              element's packed info, the block's tallies and status
//          host: section offsets, the checks of spk_decode.h chunk_sections, unary codes
//          spk_decode_values_* per block: bit patterns from bins and raw fields
// NOTE: compile with --fmad=false: spk_model.cuh's float ops must never contract.
#include "spk_model.cuh"

#define SPK_FULL 0xFFFFFFFFu
#define SPK_MAX_CTA 256  // threads per CTA the host may launch (8 warps)

// -- block geometry --------------------------------------------------------------------
// Element index -> per-channel index of L (row = (layer, kv, head), d), stepped by 32.
struct SpkCursor {
    long long row;
    int tok, d;
    __device__ __forceinline__ void init(long long e, long long tokens, int dim) {
        const long long q = e / dim;
        d = (int)(e - q * dim), tok = (int)(q % tokens), row = q / tokens;
    }
    __device__ __forceinline__ long long channel(int dim) const { return row * dim + d; }
    // NOTE: loops, not divisions: a step of 32 crosses at most 32 / dim + 1 rows
    __device__ __forceinline__ void forward(long long tokens, int dim) {
        for (d += (int)SPK_LANES; d >= dim; d -= dim)
            if (++tok == tokens) tok = 0, ++row;
    }
    __device__ __forceinline__ void backward(long long tokens, int dim) {
        for (d -= (int)SPK_LANES; d < 0; d += dim)
            if (--tok < 0) tok = (int)tokens - 1, --row;
    }
};

struct SpkTab {  // the Gaussian rows, staged in shared memory
    const int32_t *off, *radius;
    const uint16_t *cum, *freq;  // NOTE: cum is padded: row r at off[r] + r, a PROB_SCALE sentinel after it
    __device__ __forceinline__ uint32_t start(int32_t t, uint32_t j) const { return cum[off[t] + t + (int32_t)j]; }
    __device__ __forceinline__ uint32_t f(int32_t t, uint32_t j) const { return freq[off[t] + (int32_t)j]; }
};

// Copies the tables into dynamic shared memory: off | radius (i32) | cum_pad | freq (u16),
// 8 n_tab + 2 (n_sym + n_tab) + 2 n_sym bytes (coder/cuda.py sizes it).
__device__ __forceinline__ SpkTab spk_stage(const uint16_t* __restrict__ cum_pad, const uint16_t* __restrict__ freq,
                                            const int32_t* __restrict__ off, const int32_t* __restrict__ radius,
                                            int n_tab, int n_sym) {
    extern __shared__ int32_t spk_smem[];
    int32_t* so = spk_smem;
    uint16_t* sc = (uint16_t*)(spk_smem + 2 * n_tab);
    const int n_pad = n_sym + n_tab;
    for (int i = threadIdx.x; i < n_tab; i += blockDim.x) so[i] = off[i], so[n_tab + i] = radius[i];
    for (int i = threadIdx.x; i < n_pad; i += blockDim.x) sc[i] = cum_pad[i];
    for (int i = threadIdx.x; i < n_sym; i += blockDim.x) sc[n_pad + i] = freq[i];
    __syncthreads();
    SpkTab t = {so, so + n_tab, sc, sc + n_pad};
    return t;
}

template <class F>
__device__ __forceinline__ uint32_t spk_load(const void* a, long long i) {
    if (F::bits == 8) return ((const uint8_t*)a)[i];
    if (F::bits == 16) return ((const uint16_t*)a)[i];
    return ((const uint32_t*)a)[i];
}

__device__ __forceinline__ uint32_t spk_warp_sum(uint32_t v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(SPK_FULL, v, o);
    return v;
}

__device__ __forceinline__ uint32_t spk_warp_scan(uint32_t v, uint32_t lane) {  // inclusive
    for (uint32_t o = 1; o < 32u; o <<= 1) {
        const uint32_t u = __shfl_up_sync(SPK_FULL, v, o);
        if (lane >= o) v += u;
    }
    return v;
}

// ORs the w-bit value v in at bit pos (MSB first) of a zeroed byte buffer, as u32 words.
// NOTE: the stream is a byte string: a big-endian window is built, then byte-swapped
// into the little-endian words the atomics see. Fields are <= 16 bits: at most 2 words.
__device__ __forceinline__ void spk_put_bits(uint32_t* buf, unsigned long long pos, uint32_t v, uint32_t w) {
    if (!v) return;  // zeroed buffer (also: w == 0)
    const unsigned long long win = (unsigned long long)v << (64u - (uint32_t)(pos & 31u) - w);
    const uint32_t hi = (uint32_t)(win >> 32), lo = (uint32_t)win;
    uint32_t* p = buf + (pos >> 5);
    if (hi) atomicOr(p, __byte_perm(hi, 0, 0x0123));
    if (lo) atomicOr(p + 1, __byte_perm(lo, 0, 0x0123));
}

// w <= 16 bits at bit pos of a byte buffer with >= 4 readable bytes past it (spk_block.h read_bits)
__device__ __forceinline__ uint32_t spk_read_bits(const uint8_t* buf, unsigned long long pos, uint32_t w) {
    if (!w) return 0;
    const uint8_t* p = buf + (pos >> 3);
    const uint32_t v = (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
    return (v << (pos & 7u)) >> (32u - w);
}

#define SPK_WARP_ID ((long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5))
#define SPK_GEO_ARGS const long long *__restrict__ block_e0, const int32_t *__restrict__ block_n, \
    int n_blocks, int epl, long long tokens, int dim
#define SPK_TAB_ARGS const uint16_t *__restrict__ cum_pad, const uint16_t *__restrict__ freq, \
    const int32_t *__restrict__ toff, const int32_t *__restrict__ trad, int n_tab, int n_sym

// -- mu ----------------------------------------------------------------------------------
// mu' = bf16(a mu + b) per channel (affine == 0: as predicted), fp8: mu' / scale as fp32 bits
extern "C" __global__ void spk_prepare_mu(const uint16_t* __restrict__ mu, const float* __restrict__ a,
                                          const float* __restrict__ b, const float* __restrict__ scales,
                                          int affine, int fp8, long long n, long long tokens, int dim, int heads,
                                          void* out) {
    const long long per_row = tokens * dim;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const long long row = e / per_row, c = row * dim + e % dim;
        uint32_t m = mu[e];
        if (affine) m = spk_affine_bf16(m, a[c], b[c]);
        if (fp8) ((uint32_t*)out)[e] = spk_fp8_mu(m, scales[row / heads]);
        else ((uint16_t*)out)[e] = (uint16_t)m;
    }
}

// -- encode ------------------------------------------------------------------------------
// counts[4 b + s]: bits block b puts in section s (LOW, ZMAN, ESC, UNARY)
template <class FX, class FM>
__device__ void encode_count(SPK_GEO_ARGS, SPK_TAB_ARGS, const void* __restrict__ x, const void* __restrict__ mu,
                             const int32_t* __restrict__ L, unsigned long long* __restrict__ counts) {
    const SpkTab T = spk_stage(cum_pad, freq, toff, trad, n_tab, n_sym);
    const long long b = SPK_WARP_ID;
    if (b >= n_blocks) return;  // whole warps leave together, after the staging barrier
    const uint32_t lane = threadIdx.x & 31u;
    const long long e0 = block_e0[b];
    const int n = block_n[b];
    SpkCursor cur;
    cur.init(e0 + lane, tokens, dim);
    uint32_t low = 0, nz = 0, ne = 0, un = 0;  // NOTE: < 2^32 per block: <= 2^21 elements x <= 247 bits
    for (int e = (int)lane; e < n; e += (int)SPK_LANES, cur.forward(tokens, dim)) {
        const SpkContext ctx = spk_context<FX, FM>(spk_load<FM>(mu, e0 + e), L[cur.channel(dim)]);
        const SpkSymbol s = spk_symbolize<FX>(spk_load<FX>(x, e0 + e), ctx, T.radius[ctx.t]);
        if (s.kind == SPK_KIND_NORMAL) low += s.width;
        else if (s.kind == SPK_KIND_ZERO) ++nz, un += s.delta + 1u;
        else ++ne;
    }
    low = spk_warp_sum(low), nz = spk_warp_sum(nz), ne = spk_warp_sum(ne), un = spk_warp_sum(un);
    if (lane == 0) {
        counts[4 * b] = low, counts[4 * b + 1] = (unsigned long long)nz * FX::mant;
        counts[4 * b + 2] = (unsigned long long)ne * FX::bits, counts[4 * b + 3] = un;
    }
}

// Per block, steps last first: raw fields at start[4 b + s] + their offsets in the block's
// sections (bit positions in its chunk's buffer at bits + chunk_byte[b]), and the rANS
// steps: final states, word counts, words in scratch (epl * 32 per block, encoder order).
template <class FX, class FM>
__device__ void encode_write(SPK_GEO_ARGS, SPK_TAB_ARGS, const void* __restrict__ x, const void* __restrict__ mu,
                             const int32_t* __restrict__ L, const unsigned long long* __restrict__ counts,
                             const unsigned long long* __restrict__ start, const unsigned long long* __restrict__ chunk_byte,
                             uint8_t* __restrict__ bits, uint32_t* __restrict__ states, uint32_t* __restrict__ n_words,
                             uint16_t* __restrict__ scratch) {
    const SpkTab T = spk_stage(cum_pad, freq, toff, trad, n_tab, n_sym);
    const long long b = SPK_WARP_ID;
    if (b >= n_blocks) return;
    const uint32_t lane = threadIdx.x & 31u;
    const long long e0 = block_e0[b];
    const int n = block_n[b];
    uint32_t* buf = (uint32_t*)(bits + chunk_byte[b]);  // NOTE: chunk buffers are 4-byte aligned
    unsigned long long end[4];  // running section ends, walking backward
    for (int s = 0; s < 4; ++s) end[s] = start[4 * b + s] + counts[4 * b + s];
    uint16_t* out = scratch + b * (long long)epl * SPK_LANES;
    uint32_t xs = SPK_RANS_L, count = 0;
    // NOTE: steps past the block's last element are no-ops (never emit): skipped
    const int last = n > 0 ? (n - 1) / (int)SPK_LANES : -1;
    SpkCursor cur;
    cur.init(e0 + (long long)last * SPK_LANES + lane, tokens, dim);
    for (int st = last; st >= 0; --st, cur.backward(tokens, dim)) {  // NOTE: LIFO: the last op first
        const int e = st * (int)SPK_LANES + (int)lane;
        uint32_t o_start = 0, o_freq = SPK_PROB_SCALE, lw = 0, uw = 0, kind = 3u;
        SpkSymbol s;
        s.field = 0, s.delta = 0;
        if (e < n) {
            const SpkContext ctx = spk_context<FX, FM>(spk_load<FM>(mu, e0 + e), L[cur.channel(dim)]);
            s = spk_symbolize<FX>(spk_load<FX>(x, e0 + e), ctx, T.radius[ctx.t]);
            o_start = T.start(ctx.t, s.j), o_freq = T.f(ctx.t, s.j), kind = s.kind;
            lw = kind == SPK_KIND_NORMAL ? s.width : 0u;
            uw = kind == SPK_KIND_ZERO ? s.delta + 1u : 0u;
        }
        uint16_t w;
        const uint32_t emit = enc_put(&xs, o_start, o_freq, &w);
        const uint32_t eb = __ballot_sync(SPK_FULL, emit);
        if (emit) out[count + lane_rank(eb, lane)] = w;
        count += popcount32(eb);
        // NOTE: LOW (<= 32 x 8) and UNARY (<= 32 x 247) widths share one scan, 16 bits each
        const uint32_t inc = spk_warp_scan(lw | uw << 16, lane), tot = __shfl_sync(SPK_FULL, inc, 31);
        const uint32_t zb = __ballot_sync(SPK_FULL, kind == SPK_KIND_ZERO);
        const uint32_t xb = __ballot_sync(SPK_FULL, kind == SPK_KIND_ESC);
        end[0] -= tot & 0xFFFFu, end[3] -= tot >> 16;
        end[1] -= (unsigned long long)popcount32(zb) * FX::mant, end[2] -= (unsigned long long)popcount32(xb) * FX::bits;
        if (kind == SPK_KIND_NORMAL) {
            spk_put_bits(buf, end[0] + (inc & 0xFFFFu) - lw, s.field, lw);
        } else if (kind == SPK_KIND_ZERO) {
            spk_put_bits(buf, end[1] + (unsigned long long)lane_rank(zb, lane) * FX::mant, s.field, FX::mant);
            spk_put_bits(buf, end[3] + (inc >> 16) - 1u, 1u, 1u);  // delta zeros, then a one
        } else if (kind == SPK_KIND_ESC) {
            spk_put_bits(buf, end[2] + (unsigned long long)lane_rank(xb, lane) * FX::bits, s.field, FX::bits);
        }
    }
    states[b * SPK_LANES + lane] = xs;
    if (lane == 0) n_words[b] = count;
}

// words[offsets[b] ..) = the scratch of block b (offsets: exclusive sum of the counts)
extern "C" __global__ void spk_gather(const uint16_t* __restrict__ scratch, const uint32_t* __restrict__ n_words,
                                      const unsigned long long* __restrict__ offsets, int n_blocks, int epl,
                                      uint16_t* __restrict__ words) {
    const long long b = SPK_WARP_ID;
    if (b >= n_blocks) return;
    const uint16_t* src = scratch + b * (long long)epl * SPK_LANES;
    uint16_t* dst = words + offsets[b];
    for (uint32_t k = threadIdx.x & 31u; k < n_words[b]; k += SPK_LANES) dst[k] = src[k];
}

// -- decode ------------------------------------------------------------------------------
// tally[5 b ..]: LOW bits, zero-bin elements, escapes, unary bound, mu not finite (unescaped)
template <class FX, class FM>
__device__ void decode_rans(SPK_GEO_ARGS, SPK_TAB_ARGS, const uint16_t* __restrict__ bucket,
                            const void* __restrict__ mu, const int32_t* __restrict__ L,
                            const uint32_t* __restrict__ states, const uint32_t* __restrict__ n_words,
                            const long long* __restrict__ word_lo, const uint16_t* __restrict__ words,
                            uint32_t* __restrict__ info, unsigned long long* __restrict__ tally,
                            int32_t* __restrict__ status) {
    const SpkTab T = spk_stage(cum_pad, freq, toff, trad, n_tab, n_sym);
    const long long b = SPK_WARP_ID;
    if (b >= n_blocks) return;
    const uint32_t lane = threadIdx.x & 31u;
    const long long e0 = block_e0[b], lo = word_lo[b];
    const int n = block_n[b];
    long long end = lo + n_words[b];
    uint32_t xs = states[b * SPK_LANES + lane], low = 0, nz = 0, ne = 0, ub = 0, bad = 0;
    int err = SPK_OK;
    SpkCursor cur;
    cur.init(e0 + lane, tokens, dim);
    for (int st = 0; st < epl; ++st, cur.forward(tokens, dim)) {
        const int e = st * (int)SPK_LANES + (int)lane;
        if (e < n) {
            const SpkContext ctx = spk_context<FX, FM>(spk_load<FM>(mu, e0 + e), L[cur.channel(dim)]);
            const uint32_t j = dec_find_bucketed(T.cum + T.off[ctx.t] + ctx.t, bucket + (long long)ctx.t * SPK_BUCKETS,
                                                 dec_get(xs));
            dec_advance(&xs, T.start(ctx.t, j), T.f(ctx.t, j));
            const SpkClass k = spk_classify<FX>(j, ctx, T.radius[ctx.t]);
            info[e0 + e] = pack_info(k.c, ctx.k, k.kind, !ctx.mu_ok);
            bad |= !ctx.mu_ok & (k.kind != SPK_KIND_ESC);
            if (k.kind == SPK_KIND_NORMAL) low += k.width;
            else if (k.kind == SPK_KIND_ZERO) ++nz, ub += (uint32_t)(ctx.k + FX::bias);
            else ++ne;
        }  // padding lanes: the no-op leaves the state as it is
        const uint32_t need = dec_needs(xs), nb = __ballot_sync(SPK_FULL, need);
        // NOTE: past the last element nothing changes once no lane needs a word (the CPU
        // walks every step; a corrupt state below RANS_L may still read words there)
        if (!nb && st * (int)SPK_LANES >= n) break;
        end -= popcount32(nb);  // NOTE: read backward: this step's words sit at the end
        if (end < lo) { err = SPK_ERR_WORDS_UNDERRUN; break; }
        if (need) xs = dec_put_word(xs, words[end + lane_rank(nb, lane)]);
    }
    if (!err && end != lo) err = SPK_ERR_WORDS_LEFT;
    if (!err && !__all_sync(SPK_FULL, xs == SPK_RANS_L)) err = SPK_ERR_FINAL_STATE;
    low = spk_warp_sum(low), nz = spk_warp_sum(nz), ne = spk_warp_sum(ne), ub = spk_warp_sum(ub);
    bad = __any_sync(SPK_FULL, bad);
    if (lane == 0) {
        unsigned long long* t = tally + 5 * b;
        t[0] = low, t[1] = nz, t[2] = ne, t[3] = ub, t[4] = bad;
        status[b] = err;
    }
}

// sec[4 b ..]: bit positions of block b's first LOW, ZMAN, ESC fields in its chunk's buffer
// (bits + chunk_byte[b], >= 8 zero bytes past its end) and its first zero-bin element's
// index in deltas; blocks of chunks that failed early are skipped (skip[b]).
template <class FX>
__device__ void decode_values(SPK_GEO_ARGS, const uint32_t* __restrict__ info,
                              const unsigned long long* __restrict__ sec, const unsigned long long* __restrict__ chunk_byte,
                              const uint8_t* __restrict__ skip, const uint8_t* __restrict__ bits,
                              const uint32_t* __restrict__ deltas, void* __restrict__ out, uint32_t* __restrict__ flags) {
    const long long b = SPK_WARP_ID;
    if (b >= n_blocks || skip[b]) return;
    const uint32_t lane = threadIdx.x & 31u;
    const long long e0 = block_e0[b];
    const int n = block_n[b];
    const uint8_t* buf = bits + chunk_byte[b];
    unsigned long long low = sec[4 * b], zman = sec[4 * b + 1], esc = sec[4 * b + 2], z = sec[4 * b + 3];
    uint32_t normal_bad = 0, zero_bad = 0;
    for (int st = 0; st * (int)SPK_LANES < n; ++st) {
        const int e = st * (int)SPK_LANES + (int)lane;
        const uint32_t in = e < n ? info[e0 + e] : 0u, kind = e < n ? (in >> 22 & 3u) : 3u;
        const int32_t c = (int32_t)(in & 0x3FFFu) - 8192, k = (int32_t)(in >> 14 & 0xFFu) - 128;
        const uint32_t w = kind == SPK_KIND_NORMAL ? (uint32_t)spk_max(spk_low_bits<FX>(spk_magnitude(c)), 0) : 0u;
        const uint32_t inc = spk_warp_scan(w, lane), tot = __shfl_sync(SPK_FULL, inc, 31);
        const uint32_t zb = __ballot_sync(SPK_FULL, kind == SPK_KIND_ZERO);
        const uint32_t xb = __ballot_sync(SPK_FULL, kind == SPK_KIND_ESC);
        uint32_t v = 0;
        if (kind == SPK_KIND_NORMAL) {
            v = spk_normal_value<FX>(k, c, spk_read_bits(buf, low + inc - w, w), &normal_bad);
        } else if (kind == SPK_KIND_ZERO) {
            const uint32_t r = lane_rank(zb, lane);
            v = spk_zero_value<FX>(k, c, spk_read_bits(buf, zman + (unsigned long long)r * FX::mant, FX::mant),
                                   deltas[z + r], &zero_bad);
        } else if (kind == SPK_KIND_ESC) {
            v = spk_read_bits(buf, esc + (unsigned long long)lane_rank(xb, lane) * FX::bits, FX::bits);
        }
        if (e < n) {
            if (FX::bits == 8) ((uint8_t*)out)[e0 + e] = (uint8_t)v;
            else ((uint16_t*)out)[e0 + e] = (uint16_t)v;
        }
        low += tot, zman += (unsigned long long)popcount32(zb) * FX::mant;
        esc += (unsigned long long)popcount32(xb) * FX::bits, z += popcount32(zb);
    }
    normal_bad = __any_sync(SPK_FULL, normal_bad), zero_bad = __any_sync(SPK_FULL, zero_bad);
    if (lane == 0) flags[2 * b] = normal_bad, flags[2 * b + 1] = zero_bad;
}

// -- entry points per format (BF16 KV: x, mu BF16; FP8 KV: x e4m3, mu fp32) --------------------
#define SPK_GEO block_e0, block_n, n_blocks, epl, tokens, dim
#define SPK_TAB cum_pad, freq, toff, trad, n_tab, n_sym
#define SPK_ENTRY(name, FX, FM)                                                                               \
    extern "C" __global__ void __launch_bounds__(SPK_MAX_CTA) spk_encode_count_##name(                      \
        SPK_GEO_ARGS, SPK_TAB_ARGS, const void* x, const void* mu, const int32_t* L, unsigned long long* counts) { \
        encode_count<FX, FM>(SPK_GEO, SPK_TAB, x, mu, L, counts);                                            \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(SPK_MAX_CTA) spk_encode_write_##name(                      \
        SPK_GEO_ARGS, SPK_TAB_ARGS, const void* x, const void* mu, const int32_t* L,                         \
        const unsigned long long* counts, const unsigned long long* start, const unsigned long long* chunk_byte, \
        uint8_t* bits, uint32_t* states, uint32_t* n_words, uint16_t* scratch) {                             \
        encode_write<FX, FM>(SPK_GEO, SPK_TAB, x, mu, L, counts, start, chunk_byte, bits, states, n_words,     \
                             scratch);                                                                       \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(SPK_MAX_CTA) spk_decode_rans_##name(                       \
        SPK_GEO_ARGS, SPK_TAB_ARGS, const uint16_t* bucket, const void* mu, const int32_t* L,                \
        const uint32_t* states, const uint32_t* n_words, const long long* word_lo, const uint16_t* words,    \
        uint32_t* info, unsigned long long* tally, int32_t* status) {                                        \
        decode_rans<FX, FM>(SPK_GEO, SPK_TAB, bucket, mu, L, states, n_words, word_lo, words, info, tally,     \
                            status);                                                                         \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(SPK_MAX_CTA) spk_decode_values_##name(                     \
        SPK_GEO_ARGS, const uint32_t* info, const unsigned long long* sec, const unsigned long long* chunk_byte, \
        const uint8_t* skip, const uint8_t* bits, const uint32_t* deltas, void* out, uint32_t* flags) {      \
        decode_values<FX>(SPK_GEO, info, sec, chunk_byte, skip, bits, deltas, out, flags);                   \
    }

SPK_ENTRY(bf16, SpkBF16, SpkBF16)
SPK_ENTRY(fp8, SpkE4M3, SpkFP32)
