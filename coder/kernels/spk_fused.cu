// speckv's fused, device-resident coder (CuPy RawModule / NVRTC; coder/cuda.py drives it).
//
// The per-element model (spk_model.cuh) and the rANS lane steps (rans_lane.cuh) are the
// very code the CPU extension runs (spk_encode.h, spk_decode.h); the bytes are identical. A rANS
// block's lane l codes elements l, l + 32, ... of the block (step s = 32 s + l).
//
// Two kinds of kernel: the per-element model, one thread per element (a CTA of SPK_MODEL_CTA
// threads per block: enough warps to fill a GPU), and the lane passes, one warp per block, whose
// serial chains are only what must be serial (the rANS states, the bit sections' running ends).
// Encode:  spk_encode_model_*  per element: context, symbol -> op (start, freq) and raw field;
//                              per block: bits of LOW/ZMAN/ESC/UNARY
//          host: per-chunk section offsets (exclusive sums of the block counts)
//          spk_encode_bits     per block (a CTA, a warp per segment): each raw field OR-ed in
//                              at its bit position
//          spk_encode_rans     per block (a warp), steps last first: the rANS steps (LIFO) with
//                              ballot-compacted words into a per-block scratch
//          spk_gather          scratch -> contiguous words (offsets: exclusive sum of counts)
// Decode:  spk_decode_context_* per element: its context (mu and sigma only)
//          spk_decode_rans_*   per block: rANS forward (bucketed symbol search), each
//                              element's packed info, the block's tallies and status
//          spk_decode_sections per chunk (a CTA): the checks of spk_decode.h chunk_sections,
//                              section offsets, unary codes (spk_sections.cuh)
//          spk_decode_values_* per block (a CTA, a warp per segment): bit patterns from bins and
//                              raw fields
// NOTE: compile with --fmad=false: spk_model.cuh's float ops must never contract.
#include "spk_sections.cuh"

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
// One CTA per block, one thread per element: the model (context, symbol) of every element, its
// op and raw field for the lane pass, and counts[4 b + s]: bits block b puts in section s
// (LOW, ZMAN, ESC, UNARY). Tables are read through the cache (no staging: one pass over them).
template <class FX, class FM>
__device__ void encode_model(SPK_GEO_ARGS, SPK_TAB_ARGS, uint32_t* __restrict__ ops, uint32_t* __restrict__ raw,
                             unsigned long long* __restrict__ counts) {
    static_assert(FX::bits <= 16 && FX::k_max + FX::bias - 1 < 256, "spk_pack_raw: 16-bit fields, 8-bit deltas");
    static_assert(SPK_LANES * (FX::k_max + FX::bias) < 65536u, "a step's UNARY bits: one 16-bit half of a scan");
    static_assert(SPK_PROB_BITS <= 15, "spk_pack_op: freq <= PROB_SCALE in 16 bits");
    const long long b = blockIdx.x;
    if (b >= n_blocks) return;  // the whole CTA: before the barrier
    const long long e0 = block_e0[b];
    const SpkReq r = SPK_REQ(b);
    uint32_t c[4] = {0, 0, 0, 0};  // LOW bits, zero-bin elements, escapes, UNARY bits
    spk_block_contexts<FX, FM>(r, block_n[b], dim, [&](int e, const SpkContext& ctx) {
        const SpkSymbol s = spk_symbolize<FX>(spk_load<FX>(r.x, r.e0 + e), ctx, trad[ctx.t]);
        const int32_t o = toff[ctx.t];
        ops[e0 + e] = spk_pack_op(cum_pad[o + ctx.t + (int32_t)s.j], freq[o + (int32_t)s.j]);
        raw[e0 + e] = spk_pack_raw(s);
        if (s.kind == SPK_KIND_NORMAL) c[0] += s.width;
        else if (s.kind == SPK_KIND_ZERO) ++c[1], c[3] += s.delta + 1u;
        else ++c[2];
    });
    c[1] *= (uint32_t)FX::mant, c[2] *= (uint32_t)FX::bits;  // NOTE: < 2^32 per block (<= 2^21 x <= 247 bits)
    spk_cta_sum4(c, counts + 4 * b);
}

// One CTA per block, each warp a segment of its steps: every raw field OR-ed in at its bit
// position, start[4 b + s] + its offset in the block's section s, in the chunk's buffer at
// bits + chunk_byte[b]. Sections hold fields in element order; a warp's first position is its
// block's start plus the lower warps' totals (a first sweep).
__device__ void encode_bits(const long long* __restrict__ block_e0, const int32_t* __restrict__ block_n,
                            int n_blocks, int mant, int bits_esc, const uint32_t* __restrict__ raw,
                            const unsigned long long* __restrict__ start, const unsigned long long* __restrict__ chunk_byte,
                            uint8_t* __restrict__ bits) {
    const long long b = blockIdx.x;
    if (b >= n_blocks) return;  // the whole CTA: before the barrier
    const uint32_t lane = threadIdx.x & 31u;
    const long long e0 = block_e0[b];
    const int n = block_n[b];
    SpkSegment seg;
    seg.init(n);
    uint32_t low = 0, nz = 0, ne = 0, un = 0;
    for (int e = seg.s0 * (int)SPK_LANES + (int)lane; e < seg.s1 * (int)SPK_LANES && e < n; e += (int)SPK_LANES) {
        const uint32_t r = raw[e0 + e], kind = r >> 21 & 3u;
        if (kind == SPK_KIND_NORMAL) low += r >> 16 & 31u;
        else if (kind == SPK_KIND_ZERO) ++nz, un += (r >> 23) + 1u;
        else ++ne;
    }
    unsigned long long pos[4] = {spk_warp_sum(low), (unsigned long long)spk_warp_sum(nz) * mant,
                                 (unsigned long long)spk_warp_sum(ne) * bits_esc, spk_warp_sum(un)}, pre[4];
    spk_cta_exclusive4(pos, pre);
    for (int s = 0; s < 4; ++s) pos[s] = start[4 * b + s] + pre[s];
    uint32_t* buf = (uint32_t*)(bits + chunk_byte[b]);  // NOTE: chunk buffers are 4-byte aligned
    for (int st = seg.s0; st < seg.s1; ++st) {
        const int e = st * (int)SPK_LANES + (int)lane;
        const uint32_t r = e < n ? raw[e0 + e] : 3u << 21, kind = r >> 21 & 3u, field = r & 0xFFFFu;  // kind 3: none
        const uint32_t lw = kind == SPK_KIND_NORMAL ? r >> 16 & 31u : 0u, uw = kind == SPK_KIND_ZERO ? (r >> 23) + 1u : 0u;
        // NOTE: LOW (<= 32 x 8) and UNARY (<= 32 x 247) widths share one scan, 16 bits each
        const uint32_t inc = spk_warp_scan(lw | uw << 16, lane), tot = __shfl_sync(SPK_FULL, inc, 31);
        const uint32_t zb = __ballot_sync(SPK_FULL, kind == SPK_KIND_ZERO);
        const uint32_t xb = __ballot_sync(SPK_FULL, kind == SPK_KIND_ESC);
        if (kind == SPK_KIND_NORMAL) {
            spk_put_bits(buf, pos[0] + (inc & 0xFFFFu) - lw, field, lw);
        } else if (kind == SPK_KIND_ZERO) {
            spk_put_bits(buf, pos[1] + (unsigned long long)lane_rank(zb, lane) * mant, field, mant);
            spk_put_bits(buf, pos[3] + (inc >> 16) - 1u, 1u, 1u);  // delta zeros, then a one
        } else if (kind == SPK_KIND_ESC) {
            spk_put_bits(buf, pos[2] + (unsigned long long)lane_rank(xb, lane) * bits_esc, field, bits_esc);
        }
        pos[0] += tot & 0xFFFFu, pos[3] += tot >> 16;
        pos[1] += (unsigned long long)popcount32(zb) * mant, pos[2] += (unsigned long long)popcount32(xb) * bits_esc;
    }
}

// One warp per block, steps last first: the rANS steps (LIFO), final states, word counts, and
// the words, ballot-compacted, in scratch (epl * 32 per block, encoder order).
// NOTE: all a lane's serial chain holds is the state: the model ran ahead (encode_model), the
// bits apart (encode_bits), and the ops come in groups of SPK_AHEAD steps, each group's loads
// issued before the previous group is coded (their latency overlaps SPK_AHEAD rANS steps).
__device__ void encode_rans(const long long* __restrict__ block_e0, const int32_t* __restrict__ block_n,
                            int n_blocks, int epl, const uint32_t* __restrict__ ops, uint32_t* __restrict__ states,
                            uint32_t* __restrict__ n_words, uint16_t* __restrict__ scratch) {
    const long long b = SPK_WARP_ID;
    if (b >= n_blocks) return;
    const uint32_t lane = threadIdx.x & 31u;
    const long long e0 = block_e0[b];
    const int n = block_n[b];
    uint16_t* out = scratch + b * (long long)epl * SPK_LANES;
    uint32_t xs = SPK_RANS_L, count = 0, cur[SPK_AHEAD], nxt[SPK_AHEAD];
    // NOTE: steps past the block's last element are no-ops (never emit): skipped
    const int last = n > 0 ? (n - 1) / (int)SPK_LANES : -1;
#pragma unroll
    for (int i = 0; i < SPK_AHEAD; ++i) cur[i] = spk_op_at(ops, e0, n, last - i, lane);
    for (int st = last; st >= 0; st -= SPK_AHEAD) {  // NOTE: LIFO: the last op first
#pragma unroll
        for (int i = 0; i < SPK_AHEAD; ++i) nxt[i] = spk_op_at(ops, e0, n, st - SPK_AHEAD - i, lane);
#pragma unroll
        for (int i = 0; i < SPK_AHEAD && st - i >= 0; ++i) {  // NOTE: the same count in every lane
            uint16_t w;
            const uint32_t emit = enc_put(&xs, cur[i] & 0xFFFFu, cur[i] >> 16, &w);
            const uint32_t eb = __ballot_sync(SPK_FULL, emit);
            if (emit) out[count + lane_rank(eb, lane)] = w;
            count += popcount32(eb);
        }
#pragma unroll
        for (int i = 0; i < SPK_AHEAD; ++i) cur[i] = nxt[i];
    }
    states[b * SPK_LANES + lane] = xs;
    if (lane == 0) n_words[b] = count;
}

extern "C" __global__ void __launch_bounds__(SPK_MODEL_CTA) spk_encode_bits(
    const long long* block_e0, const int32_t* block_n, int n_blocks, int mant, int bits_esc, const uint32_t* raw,
    const unsigned long long* start, const unsigned long long* chunk_byte, uint8_t* bits) {
    encode_bits(block_e0, block_n, n_blocks, mant, bits_esc, raw, start, chunk_byte, bits);
}

extern "C" __global__ void __launch_bounds__(SPK_MAX_CTA) spk_encode_rans(
    const long long* block_e0, const int32_t* block_n, int n_blocks, int epl, const uint32_t* ops, uint32_t* states,
    uint32_t* n_words, uint16_t* scratch) {
    encode_rans(block_e0, block_n, n_blocks, epl, ops, states, n_words, scratch);
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
// One CTA per block, one thread per element: every element's context, packed (spk_pack_context),
// for the rANS pass: it depends on mu and sigma only, never on a decoded value.
template <class FX, class FM>
__device__ void decode_context(SPK_GEO_ARGS, uint32_t* __restrict__ ctxs) {
    const long long b = blockIdx.x;
    if (b >= n_blocks) return;
    const long long e0 = block_e0[b];
    spk_block_contexts<FX, FM>(SPK_REQ(b), block_n[b], dim,
                               [&](int e, const SpkContext& ctx) { ctxs[e0 + e] = spk_pack_context(ctx); });
}

// One warp per block: the rANS steps forward, each element's packed info, the block's tallies
// and status. NOTE: contexts come from decode_context, a group of steps ahead: a lane's serial
// chain is the symbol search in shared memory and the state update.
template <class FX>
__device__ void decode_rans(SPK_GEO_ARGS, SPK_TAB_ARGS, const uint16_t* __restrict__ bucket,
                            const uint32_t* __restrict__ ctxs, const uint32_t* __restrict__ states, const uint32_t* __restrict__ n_words,
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
    uint32_t cur[SPK_AHEAD], nxt[SPK_AHEAD];  // contexts, a group of steps in flight (as encode_rans)
#if SPK_WORD_WINDOW
    SpkWordWindow win;
    win.init(words, lo, end, lane);
#endif
#pragma unroll
    for (int i = 0; i < SPK_AHEAD; ++i) cur[i] = spk_ctx_at(ctxs, e0, n, i, lane);
    for (int s0 = 0; s0 < epl; s0 += SPK_AHEAD) {
#pragma unroll
        for (int i = 0; i < SPK_AHEAD; ++i) nxt[i] = spk_ctx_at(ctxs, e0, n, s0 + SPK_AHEAD + i, lane);
#pragma unroll
        for (int i = 0; i < SPK_AHEAD; ++i) {
            const int st = s0 + i, e = st * (int)SPK_LANES + (int)lane;
            if (st >= epl) goto done;  // NOTE: every exit of this loop is the same in every lane
            if (e < n) {
                const SpkContext ctx = spk_unpack_context(cur[i]);
                const uint32_t j = dec_find_bucketed(T.cum + T.off[ctx.t] + ctx.t,
                                                     bucket + (long long)ctx.t * SPK_BUCKETS, dec_get(xs));
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
            if (!nb && st * (int)SPK_LANES >= n) goto done;
            end -= popcount32(nb);  // NOTE: read backward: this step's words sit at the end
            if (end < lo) {
                err = SPK_ERR_WORDS_UNDERRUN;
                goto done;
            }
#if SPK_WORD_WINDOW
            if (nb) {  // NOTE: the same in every lane: take is a collective
                const uint32_t w = win.take(end + lane_rank(nb, lane), end, lane);
                if (need) xs = dec_put_word(xs, (uint16_t)w);
            }
#else
            if (need) xs = dec_put_word(xs, words[end + lane_rank(nb, lane)]);
#endif
        }
#pragma unroll
        for (int i = 0; i < SPK_AHEAD; ++i) cur[i] = nxt[i];
    }
done:
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
// One CTA per block, each warp a segment of its steps (as encode_bits): a first sweep sums the
// segments' fields, so that every warp knows where its own begin.
template <class FX>
__device__ __forceinline__ uint32_t spk_info_low(uint32_t in, uint32_t kind) {  // LOW width of an element
    return kind == SPK_KIND_NORMAL ? (uint32_t)spk_max(spk_low_bits<FX>(spk_magnitude((int32_t)(in & 0x3FFFu) - 8192)), 0)
                                   : 0u;
}

template <class FX>
__device__ void decode_values(SPK_GEO_ARGS, const uint32_t* __restrict__ info,
                              const unsigned long long* __restrict__ sec, const unsigned long long* __restrict__ chunk_byte,
                              const uint8_t* __restrict__ skip, const uint8_t* __restrict__ bits,
                              const uint32_t* __restrict__ deltas, uint32_t* __restrict__ flags) {
    const long long b = blockIdx.x;
    if (b >= n_blocks || skip[b]) return;  // the whole CTA: before the barrier
    const uint32_t lane = threadIdx.x & 31u;
    const long long e0 = block_e0[b];
    const SpkReq r = SPK_REQ(b);
    const int n = block_n[b];
    SpkSegment seg;
    seg.init(n);
    uint32_t lw = 0, nz = 0, ne = 0;
    for (int e = seg.s0 * (int)SPK_LANES + (int)lane; e < seg.s1 * (int)SPK_LANES && e < n; e += (int)SPK_LANES) {
        const uint32_t in = info[e0 + e], kind = in >> 22 & 3u;
        lw += spk_info_low<FX>(in, kind), nz += kind == SPK_KIND_ZERO, ne += kind == SPK_KIND_ESC;
    }
    const unsigned long long nzw = spk_warp_sum(nz);
    unsigned long long tot4[4] = {spk_warp_sum(lw), nzw * FX::mant, (unsigned long long)spk_warp_sum(ne) * FX::bits, nzw},
                       pre[4];
    spk_cta_exclusive4(tot4, pre);
    const uint8_t* buf = bits + chunk_byte[b];
    unsigned long long low = sec[4 * b] + pre[0], zman = sec[4 * b + 1] + pre[1], esc = sec[4 * b + 2] + pre[2],
                       z = sec[4 * b + 3] + pre[3];
    uint32_t normal_bad = 0, zero_bad = 0;
    for (int st = seg.s0; st < seg.s1; ++st) {
        const int e = st * (int)SPK_LANES + (int)lane;
        const uint32_t in = e < n ? info[e0 + e] : 0u, kind = e < n ? (in >> 22 & 3u) : 3u;
        const int32_t c = (int32_t)(in & 0x3FFFu) - 8192, k = (int32_t)(in >> 14 & 0xFFu) - 128;
        const uint32_t w = spk_info_low<FX>(in, kind);
        const uint32_t inc = spk_warp_scan(w, lane), tot = __shfl_sync(SPK_FULL, inc, 31);
        const uint32_t zb = __ballot_sync(SPK_FULL, kind == SPK_KIND_ZERO);
        const uint32_t xb = __ballot_sync(SPK_FULL, kind == SPK_KIND_ESC);
        uint32_t v = 0;
        if (kind == SPK_KIND_NORMAL) {
            v = spk_normal_value<FX>(k, c, spk_read_bits(buf, low + inc - w, w), &normal_bad);
        } else if (kind == SPK_KIND_ZERO) {
            const uint32_t rank = lane_rank(zb, lane);
            v = spk_zero_value<FX>(k, c, spk_read_bits(buf, zman + (unsigned long long)rank * FX::mant, FX::mant),
                                   deltas[z + rank], &zero_bad);
        } else if (kind == SPK_KIND_ESC) {
            v = spk_read_bits(buf, esc + (unsigned long long)lane_rank(xb, lane) * FX::bits, FX::bits);
        }
        if (e < n) {
            if (FX::bits == 8) ((uint8_t*)r.out)[r.e0 + e] = (uint8_t)v;
            else ((uint16_t*)r.out)[r.e0 + e] = (uint16_t)v;
        }
        low += tot, zman += (unsigned long long)popcount32(zb) * FX::mant;
        esc += (unsigned long long)popcount32(xb) * FX::bits, z += popcount32(zb);
    }
    // NOTE: flags start zeroed (the host's); any warp may raise them
    if (__any_sync(SPK_FULL, normal_bad) && lane == 0) atomicOr(&flags[2 * b], 1u);
    if (__any_sync(SPK_FULL, zero_bad) && lane == 0) atomicOr(&flags[2 * b + 1], 1u);
}

// One CTA per chunk: its checks, each block's section starts (sec, skip) and the unary codes
// (deltas, at the chunk's first element), from the rANS pass's tallies (spk_sections.cuh).
extern "C" __global__ void __launch_bounds__(SPK_MODEL_CTA) spk_decode_sections(
    const long long* __restrict__ chunk_b0, const long long* __restrict__ chunk_blocks,
    const long long* __restrict__ chunk_e0, const unsigned long long* __restrict__ chunk_byte,
    const unsigned long long* __restrict__ chunk_len, int n_chunks, int mant, int width,
    const unsigned long long* __restrict__ tally, const int32_t* __restrict__ status, const uint8_t* __restrict__ bits,
    unsigned long long* __restrict__ sec, uint8_t* __restrict__ skip, uint32_t* __restrict__ deltas,
    unsigned long long* __restrict__ rec) {
    const long long c = blockIdx.x;
    if (c >= n_chunks) return;  // the whole CTA: before the barriers
    const SpkChunkArgs C = {chunk_b0[c], chunk_blocks[c], chunk_e0[c], bits + chunk_byte[c], chunk_len[c]};
    unsigned long long t[6], *r = rec + SPK_REC * c;
    spk_sections_sums(C, tally, status, sec, t);
    const SpkSizes S(t, mant, width, C.len);  // NOTE: every thread its own (rec is thread 0's, no barrier)
    const int early = spk_sections_check(C, t, S, mant, width, r);  // NOTE: the same in every thread
    for (long long i = threadIdx.x; i < C.blocks; i += blockDim.x) skip[C.b0 + i] = early != SPK_OK;
    if (early) return;
    for (long long i = threadIdx.x; i < C.blocks; i += blockDim.x) {  // NOTE: the blocks pass 1 gave this thread
        unsigned long long* s = sec + 4 * (C.b0 + i);
        const unsigned long long z = s[1], e = s[2];
        s[1] = S.low * 8 + z * mant, s[2] = (S.low + S.zman) * 8 + e * width, s[3] = C.e0 + z;
    }
    spk_sections_unary(C, C.len - S.un, S.un, t[1], deltas, r);
}

// -- entry points per format (BF16 KV: x, mu BF16; FP8 KV: x e4m3, mu fp32) --------------------
#define SPK_GEO block_e0, block_n, n_blocks, epl, block_req, req_e0, req_tok, dim, req_ptr
#define SPK_TAB cum_pad, freq, toff, trad, n_tab, n_sym
#define SPK_ENTRY(name, FX, FM)                                                                               \
    extern "C" __global__ void __launch_bounds__(SPK_MODEL_CTA) spk_encode_model_##name(                    \
        SPK_GEO_ARGS, SPK_TAB_ARGS, uint32_t* ops, uint32_t* raw, unsigned long long* counts) {             \
        encode_model<FX, FM>(SPK_GEO, SPK_TAB, ops, raw, counts);                                            \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(SPK_MODEL_CTA) spk_decode_context_##name(                  \
        SPK_GEO_ARGS, uint32_t* ctxs) {                                                                      \
        decode_context<FX, FM>(SPK_GEO, ctxs);                                                               \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(SPK_MAX_CTA) spk_decode_rans_##name(                       \
        SPK_GEO_ARGS, SPK_TAB_ARGS, const uint16_t* bucket, const uint32_t* ctxs, const uint32_t* states,    \
        const uint32_t* n_words, const long long* word_lo, const uint16_t* words, uint32_t* info,           \
        unsigned long long* tally, int32_t* status) {                                                        \
        decode_rans<FX>(SPK_GEO, SPK_TAB, bucket, ctxs, states, n_words, word_lo, words, info, tally, status); \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(SPK_MODEL_CTA) spk_decode_values_##name(                     \
        SPK_GEO_ARGS, const uint32_t* info, const unsigned long long* sec, const unsigned long long* chunk_byte, \
        const uint8_t* skip, const uint8_t* bits, const uint32_t* deltas, uint32_t* flags) {                 \
        decode_values<FX>(SPK_GEO, info, sec, chunk_byte, skip, bits, deltas, flags);                        \
    }

SPK_ENTRY(bf16, SpkBF16, SpkBF16)
SPK_ENTRY(fp8, SpkE4M3, SpkFP32)
