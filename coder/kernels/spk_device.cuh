// Device helpers of speckv's fused CUDA coder (spk_fused.cu): block geometry, the tables staged in
// shared memory, warp scans and sums, bit-field I/O. Device code only (the CPU build never includes it).
#pragma once
#include "spk_model.cuh"

#define SPK_FULL 0xFFFFFFFFu
// NOTE: the knobs below change speed, never bytes; coder/cuda.py Tuning sets them (-D) and launches to match
#define SPK_MAX_CTA 256  // threads per CTA of the lane passes the host may launch (Tuning.rans_warps <= 8)
#ifndef SPK_MODEL_CTA
#define SPK_MODEL_CTA 256  // threads per CTA of the one-CTA-per-block kernels (Tuning.model_cta)
#endif
static_assert(SPK_MODEL_CTA % 32 == 0 && SPK_MODEL_CTA <= 1024, "whole warps");
#ifndef SPK_AHEAD
#define SPK_AHEAD 8  // the lane passes load the model's output this many steps ahead (Tuning.ahead)
#endif
static_assert(SPK_AHEAD >= 1 && SPK_AHEAD <= 32, "a group of steps in registers");
#ifndef SPK_WORD_WINDOW
#define SPK_WORD_WINDOW 0  // the rANS decoder reads its words through SpkWordWindow (Tuning.word_window)
#endif

// -- block geometry --------------------------------------------------------------------
// Element index -> per-channel index of L (row = (layer, kv, head), d), stepped forward.
struct SpkCursor {
    long long row;
    int tok, d;
    __device__ __forceinline__ void init(long long e, long long tokens, int dim) {
        const long long q = e / dim;
        d = (int)(e - q * dim), tok = (int)(q % tokens), row = q / tokens;
    }
    __device__ __forceinline__ long long channel(int dim) const { return row * dim + d; }
    // NOTE: loops, not divisions: a step of s crosses at most s / dim + 1 rows
    __device__ __forceinline__ void forward(long long tokens, int dim, int step = (int)SPK_LANES) {
        for (d += step; d >= dim; d -= dim)
            if (++tok == tokens) tok = 0, ++row;
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

// NOTE: through the read-only cache (__ldg): a request's arrays come from req_ptr, so the compiler
// cannot see that no store of the kernel reaches them
template <class F>
__device__ __forceinline__ uint32_t spk_load(const void* a, long long i) {
    if (F::bits == 8) return __ldg((const uint8_t*)a + i);
    if (F::bits == 16) return __ldg((const uint16_t*)a + i);
    return __ldg((const uint32_t*)a + i);
}

__device__ __forceinline__ uint32_t spk_warp_sum(uint32_t v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(SPK_FULL, v, o);
    return v;
}

template <class T>
__device__ __forceinline__ T spk_warp_scan(T v, uint32_t lane) {  // inclusive
    for (uint32_t o = 1; o < 32u; o <<= 1) {
        const T u = __shfl_up_sync(SPK_FULL, v, o);
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
// A launch codes the blocks of a batch of requests (prompts: tokens differ, heads and dim do not):
// block b codes elements block_e0[b] .. + block_n[b] of the batch (the scratch arrays' index), which
// are elements block_e0[b] - req_e0[q] .. of request q = block_req[b], whose arrays are at
// req_ptr[SPK_REQ_PTRS q ..] (x or out, mu, L) and whose rows are req_tok[q] tokens long.
#define SPK_GEO_ARGS const long long *__restrict__ block_e0, const int32_t *__restrict__ block_n, \
    int n_blocks, int epl, const int32_t *__restrict__ block_req, const long long *__restrict__ req_e0, \
    const long long *__restrict__ req_tok, int dim, const unsigned long long *__restrict__ req_ptr
#define SPK_REQ_PTRS 3  // per request: x (encode) or out (decode), mu, L

struct SpkReq {  // block b's request: its arrays, its first element's index there, its tokens
    const void *x, *mu;
    void* out;
    const int32_t* L;
    long long e0;
    long long tokens;
};
__device__ __forceinline__ SpkReq spk_req(const long long* __restrict__ block_e0, const int32_t* __restrict__ block_req,
                                          const long long* __restrict__ req_e0, const long long* __restrict__ req_tok,
                                          const unsigned long long* __restrict__ req_ptr, long long b) {
    const int q = block_req[b];
    const unsigned long long* p = req_ptr + SPK_REQ_PTRS * q;
    return {(const void*)p[0], (const void*)p[1], (void*)p[0], (const int32_t*)p[2], block_e0[b] - req_e0[q],
            req_tok[q]};
}
#define SPK_REQ(b) spk_req(block_e0, block_req, req_e0, req_tok, req_ptr, (b))
#define SPK_TAB_ARGS const uint16_t *__restrict__ cum_pad, const uint16_t *__restrict__ freq, \
    const int32_t *__restrict__ toff, const int32_t *__restrict__ trad, int n_tab, int n_sym

// The elements a thread takes of its CTA's block (threadIdx.x, + blockDim.x, ...: the one-CTA-per-block
// model kernels), each handed with its context: f(e, ctx), e relative to the block's first e0.
template <class FX, class FM, class F>
__device__ __forceinline__ void spk_block_contexts(const SpkReq& r, int n, int dim, F f) {
    const int step = (int)blockDim.x;
    SpkCursor cur;
    cur.init(r.e0 + threadIdx.x, r.tokens, dim);
    for (int e = (int)threadIdx.x; e < n; e += step) {
        f(e, spk_context<FX, FM>(spk_load<FM>(r.mu, r.e0 + e), __ldg(r.L + cur.channel(dim))));
        if (e + step < n) cur.forward(r.tokens, dim, step);
    }
}

// -- what the model kernels hand the lane passes, 32 bits an element ------------------------
// An encoder op: start | freq << 16 (freq <= PROB_SCALE = 2^15, start < 2^15).
__device__ __forceinline__ uint32_t spk_pack_op(uint32_t start, uint32_t freq) { return start | freq << 16; }

// ops[e0 + e] of step st's element e = 32 st + lane; past the block: the no-op (start 0, freq PROB_SCALE)
__device__ __forceinline__ uint32_t spk_op_at(const uint32_t* __restrict__ ops, long long e0, int n, int st,
                                              uint32_t lane) {
    const int e = st * (int)SPK_LANES + (int)lane;
    return st >= 0 && e < n ? ops[e0 + e] : spk_pack_op(0, SPK_PROB_SCALE);
}

// ctxs[e0 + e] likewise; past the block: 0 (unused: padding lanes run no model)
__device__ __forceinline__ uint32_t spk_ctx_at(const uint32_t* __restrict__ ctxs, long long e0, int n, int st,
                                               uint32_t lane) {
    const int e = st * (int)SPK_LANES + (int)lane;
    return e < n ? ctxs[e0 + e] : 0u;
}

// A symbol's raw field: field (16 bits) | width (5) << 16 | kind (2) << 21 | delta (8) << 23.
// NOTE: delta (ZERO only) = k + bias - 1 - exponent <= k_max + bias - 1 = 246 (BF16): 8 bits;
// width <= 16; ESC fields are the whole pattern (<= 16 bits).
__device__ __forceinline__ uint32_t spk_pack_raw(const SpkSymbol& s) {
    return s.field | s.width << 16 | s.kind << 21 | s.delta << 23;
}

// Sums v (4 counters a thread) over the CTA into out[0..4) (thread 0), as u64.
// NOTE: every thread of the CTA calls it (a barrier inside); blockDim.x <= SPK_MODEL_CTA. Once a
// kernel: a second call would need a barrier before it rewrites part.
__device__ __forceinline__ void spk_cta_sum4(const uint32_t v[4], unsigned long long* out) {
    __shared__ unsigned long long part[SPK_MODEL_CTA / 32][4];
    const uint32_t lane = threadIdx.x & 31u, w = threadIdx.x >> 5;
    for (int s = 0; s < 4; ++s) {
        const uint32_t t = spk_warp_sum(v[s]);
        if (lane == 0) part[w][s] = t;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int s = 0; s < 4; ++s) {
            unsigned long long t = 0;
            for (uint32_t i = 0; i < (blockDim.x >> 5); ++i) t += part[i][s];
            out[s] = t;
        }
}

// -- a block's elements in warp segments (the CTA-per-block passes over bit sections) ---------
// Warp w of the CTA takes the steps [s0, s1) of its block (step s: elements 32 s .. 32 s + 31),
// contiguous, so the sections' order (element order) is the warps' order.
struct SpkSegment {
    int s0, s1;
    __device__ __forceinline__ void init(int n) {
        const int steps = (n + (int)SPK_LANES - 1) / (int)SPK_LANES, warps = (int)(blockDim.x >> 5);
        const int per = (steps + warps - 1) / warps, w = (int)(threadIdx.x >> 5);
        s0 = w * per < steps ? w * per : steps;
        s1 = s0 + per < steps ? s0 + per : steps;
    }
};

// Each warp's totals v[4] (the same in every lane) -> out[4]: the sums of the lower warps' totals.
// NOTE: every thread of the CTA calls it (a barrier inside); once a kernel, as spk_cta_sum4.
__device__ __forceinline__ void spk_cta_exclusive4(const unsigned long long v[4], unsigned long long out[4]) {
    __shared__ unsigned long long part[SPK_MODEL_CTA / 32][4];
    const uint32_t w = threadIdx.x >> 5;
    if ((threadIdx.x & 31u) == 0)
        for (int s = 0; s < 4; ++s) part[w][s] = v[s];
    __syncthreads();
    for (int s = 0; s < 4; ++s) {
        unsigned long long t = 0;
        for (uint32_t i = 0; i < w; ++i) t += part[i][s];
        out[s] = t;
    }
}

// -- the words a rANS decoder warp reads, backward, from registers ------------------------------
// Three windows of 32 words (lane i holds word top - 32 k - 32 + i of window k, 0 below lo): a
// step's words come by shuffle from windows 0 and 1; when the reads pass below window 0, the
// windows move down and the load of a new window 2 is issued, two windows (~6 steps) before use.
// NOTE: invariant top - 32 < end <= top, so a step's words (<= 32 below end) lie in windows 0-1.
struct SpkWordWindow {
    const uint16_t* words;
    long long lo, top;
    uint32_t w0, w1, w2;
    __device__ __forceinline__ uint32_t at(long long p) const { return p >= lo ? words[p] : 0u; }  // p < top
    __device__ __forceinline__ void init(const uint16_t* __restrict__ ws, long long lo_, long long end, uint32_t lane) {
        words = ws, lo = lo_, top = end;
        w0 = at(top - 32 + lane), w1 = at(top - 64 + lane), w2 = at(top - 96 + lane);
    }
    // Word p (a lane that reads: end <= p < end + its step's count; others any p), then the window
    // past `end` (the step's new end, the same in every lane). A collective: every lane calls it.
    __device__ __forceinline__ uint32_t take(long long p, long long end, uint32_t lane) {
        const int i = (int)(p - (top - 64));  // 0..63 for a lane that reads
        const uint32_t lower = __shfl_sync(SPK_FULL, w1, i & 31), upper = __shfl_sync(SPK_FULL, w0, i & 31);
        if (end <= top - 32) top -= 32, w0 = w1, w1 = w2, w2 = at(top - 96 + lane);
        return i < 32 ? lower : upper;
    }
};
