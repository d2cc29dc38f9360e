// The decoder's section pass on the device (spk_fused.cu spk_decode_sections): what
// spk_decode.h chunk_sections does on the CPU, a CTA per chunk, so that a decode never waits
// for the host between its kernels and reads its streams where they lie (device memory).
//
// Per chunk c, from its blocks' tallies (LOW bits, zero-bin elements, escapes, unary bound, mu bad):
//   sections  LOW | ZMAN | ESC | UNARY, each byte-padded; UNARY takes the bytes left
//   early     SHORT (the fixed sections need more bytes than present) or UNARY_LONG (more
//             unary bytes than any encoder writes): nothing is read, every block skipped
//   sec[b]    bit starts of block b's LOW, ZMAN, ESC fields; its first zero-bin element's delta index
//   deltas    the unary codes (delta zeros, then a one, MSB first): one per zero-bin element,
//             0 where the codes ran out, at deltas[chunk_e0 + z]
//   rec[c]    the checks' figures, for chunk_status on the host (coder/cuda_host.py)
// NOTE: a chunk any of whose blocks failed its rANS checks is skipped whole: its tallies and
// infos are not to be trusted (the host raises the rANS error first, as the CPU decoder does).
#pragma once
#include "spk_device.cuh"

#define SPK_REC 8          // u64 figures per chunk in rec (spk_decode_sections)
#define SPK_UNARY_WORDS 4  // u32 words of the unary section a thread takes per sweep

// Exclusive prefix sums over the CTA's threads (thread order) of v[N], and their totals (every
// thread), in u64 throughout. NOTE: every thread calls it; it may be called in a loop (a barrier on
// each side of its shared array). NOTE: u64 in the warp too: 32 blocks' unary bounds (each up to
// 2^21 x 247 bits) overflow 32 bits once lanes are long enough (elems_per_lane > ~17,000).
template <int N>
__device__ __forceinline__ void spk_cta_scan(const uint32_t (&v)[N], unsigned long long (&excl)[N],
                                             unsigned long long (&total)[N]) {
    __shared__ unsigned long long part[SPK_MODEL_CTA / 32][N];
    const uint32_t lane = threadIdx.x & 31u, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    unsigned long long inc[N];
    for (int s = 0; s < N; ++s) inc[s] = spk_warp_scan<unsigned long long>(v[s], lane);
    __syncthreads();  // NOTE: the previous call's readers are done with part
    if (lane == 31u)
        for (int s = 0; s < N; ++s) part[w][s] = inc[s];
    __syncthreads();
    for (int s = 0; s < N; ++s) {
        unsigned long long pre = 0, t = 0;
        for (uint32_t i = 0; i < nw; ++i) pre += i < w ? part[i][s] : 0ull, t += part[i][s];
        excl[s] = pre + inc[s] - v[s], total[s] = t;
    }
}

// The last one before this thread's (the exclusive max over lower threads of `last`, -1 for none)
// and the CTA's last (every thread). NOTE: as spk_cta_scan: every thread, loop-safe.
__device__ __forceinline__ long long spk_cta_last_before(long long last, long long* cta_last) {
    __shared__ long long part[SPK_MODEL_CTA / 32];
    const uint32_t lane = threadIdx.x & 31u, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    long long inc = last;
    for (uint32_t o = 1; o < 32u; o <<= 1) {
        const long long u = __shfl_up_sync(SPK_FULL, inc, o);
        if (lane >= o && u > inc) inc = u;
    }
    long long before = __shfl_up_sync(SPK_FULL, inc, 1);
    if (lane == 0) before = -1;
    __syncthreads();
    if (lane == 31u) part[w] = inc;
    __syncthreads();
    long long all = -1;
    for (uint32_t i = 0; i < nw; ++i) {
        if (i < w && part[i] > before) before = part[i];
        if (part[i] > all) all = part[i];
    }
    *cta_last = all;
    return before;
}

// A chunk's geometry and buffers, as spk_decode_sections takes them.
struct SpkChunkArgs {
    long long b0, blocks, e0;       // first block, blocks, first element
    const uint8_t* buf;             // its bytes (4-byte aligned), len of them
    unsigned long long len;
};

// Pass 1: each block's exclusive sums of LOW bits, zero-bin elements and escapes (into sec[b][0..3),
// relative to the chunk), and the chunk's totals t: LOW, zero, escapes, unary bound, mu bad, rANS failed.
__device__ __forceinline__ void spk_sections_sums(const SpkChunkArgs& C, const unsigned long long* __restrict__ tally,
                                                  const int32_t* __restrict__ status, unsigned long long* __restrict__ sec,
                                                  unsigned long long t[6]) {
    for (int s = 0; s < 6; ++s) t[s] = 0;
    for (long long base = 0; base < C.blocks; base += blockDim.x) {  // NOTE: the same trips in every thread
        const long long b = C.b0 + base + threadIdx.x;
        const bool in = base + threadIdx.x < C.blocks;
        const unsigned long long* tb = tally + 5 * b;
        const uint32_t v[6] = {in ? (uint32_t)tb[0] : 0u, in ? (uint32_t)tb[1] : 0u, in ? (uint32_t)tb[2] : 0u,
                               in ? (uint32_t)tb[3] : 0u, in && tb[4] ? 1u : 0u, in && status[b] ? 1u : 0u};
        unsigned long long excl[6], tot[6];
        spk_cta_scan<6>(v, excl, tot);
        if (in)
            for (int s = 0; s < 3; ++s) sec[4 * b + s] = t[s] + excl[s];
        for (int s = 0; s < 6; ++s) t[s] += tot[s];
    }
}

// bit position of word wi's first bit, from the unary section's first (byte u0); negative before it
__device__ __forceinline__ long long spk_bit0(unsigned long long wi, unsigned long long u0) {
    return 8 * ((long long)(4 * wi) - (long long)u0);
}

// Pass 3: the unary codes of bytes [u0, u0 + n) of the chunk: deltas[C.e0 + z] for z < nz; the ones
// counted and the bit after the last one (rec[5], rec[7]).
__device__ __forceinline__ void spk_sections_unary(const SpkChunkArgs& C, unsigned long long u0, unsigned long long n,
                                                   unsigned long long nz, uint32_t* __restrict__ deltas,
                                                   unsigned long long* __restrict__ rec) {
    const unsigned long long u1 = u0 + n, w0 = u0 / 4, w1 = (u1 + 3) / 4;  // NOTE: the buffer is 4-aligned
    const uint32_t* words = (const uint32_t*)C.buf;
    unsigned long long ones = 0;
    long long last = -1;  // bit position of the last one so far, from the section's first bit
    for (unsigned long long base = w0; base < w1; base += (unsigned long long)blockDim.x * SPK_UNARY_WORDS) {
        uint32_t be[SPK_UNARY_WORDS], count = 0;
        long long mine = -1;
        for (int k = 0; k < SPK_UNARY_WORDS; ++k) {
            const unsigned long long wi = base + threadIdx.x * SPK_UNARY_WORDS + k;
            uint32_t v = 0;
            if (wi < w1) {  // NOTE: the masks inside: past the section a shift would reach 32 bits
                v = __byte_perm(words[wi], 0, 0x0123);  // MSB first: big-endian
                if (4 * wi < u0) v &= 0xFFFFFFFFu >> (8 * (uint32_t)(u0 - 4 * wi));       // 1-3 bytes before u0
                if (4 * wi + 4 > u1) v &= 0xFFFFFFFFu << (8 * (uint32_t)(4 * wi + 4 - u1));  // 1-3 bytes from u1
            }
            be[k] = v, count += popcount32(v);
            if (v) mine = spk_bit0(wi, u0) + 32 - __ffs(v);  // its lowest set bit: the word's last one
        }
        const uint32_t cv[1] = {count};
        unsigned long long excl[1], tot[1];
        spk_cta_scan<1>(cv, excl, tot);
        long long cta_last;
        long long prev = spk_cta_last_before(mine, &cta_last);
        if (last > prev) prev = last;
        unsigned long long r = ones + excl[0];
        for (int k = 0; k < SPK_UNARY_WORDS; ++k) {
            const unsigned long long wi = base + threadIdx.x * SPK_UNARY_WORDS + k;
            for (uint32_t v = be[k]; v; v &= ~(0x80000000u >> spk_clz32(v))) {
                const long long pos = spk_bit0(wi, u0) + spk_clz32(v);
                if (r < nz) deltas[C.e0 + r] = (uint32_t)(pos - prev - 1 < (1ll << 30) ? pos - prev - 1 : 1ll << 30);
                prev = pos, ++r;
            }
        }
        ones += tot[0];
        if (cta_last > last) last = cta_last;
    }
    for (unsigned long long z = ones + threadIdx.x; z < nz; z += blockDim.x) deltas[C.e0 + z] = 0;  // codes ran out
    if (threadIdx.x == 0) rec[5] = ones, rec[7] = (unsigned long long)(last + 1);
}

// A chunk's byte-padded section sizes, from its totals t (LOW bits, zero-bin elements, escapes, ...);
// UNARY takes the bytes left (valid once low + zman + esc <= len).
struct SpkSizes {
    unsigned long long low, zman, esc, un;
    __device__ __forceinline__ SpkSizes(const unsigned long long t[6], int mant, int width, unsigned long long len)
        : low((t[0] + 7) / 8), zman((t[1] * mant + 7) / 8), esc((t[2] * width + 7) / 8), un(len - low - zman - esc) {}
};

// Pass 2: the checks before any field is read (bitpack's order; the host applies the rest), into rec:
// early, its figure, padding after LOW | ZMAN | ESC (bits 0-2), mu bad, zero-bin elements, unary bytes.
// Returns early: SPK_OK, SPK_ERR_SHORT, SPK_ERR_UNARY_LONG, or -1 where a block failed its rANS checks.
__device__ __forceinline__ int spk_sections_check(const SpkChunkArgs& C, const unsigned long long t[6],
                                                  const SpkSizes& S, int mant, int width,
                                                  unsigned long long* __restrict__ rec) {
    int early = t[5] ? -1 : SPK_OK;
    if (!early && S.low + S.zman + S.esc > C.len) early = SPK_ERR_SHORT;
    if (!early && 8 * S.un > t[3] + 7) early = SPK_ERR_UNARY_LONG;  // NOTE: bound it before reading it
    if (threadIdx.x == 0) {
        auto padded = [&](unsigned long long end) { return end % 8 && (C.buf[end / 8] & ((1u << (8 - end % 8)) - 1u)); };
        const bool ok = early == SPK_OK;
        rec[0] = (unsigned long long)(long long)early, rec[1] = early == SPK_ERR_SHORT ? C.len : 0;
        rec[2] = ok ? (uint32_t)padded(t[0]) | (uint32_t)padded(S.low * 8 + t[1] * mant) << 1 |
                      (uint32_t)padded((S.low + S.zman) * 8 + t[2] * width) << 2 : 0u;
        rec[3] = t[4] != 0, rec[4] = t[1], rec[5] = 0, rec[6] = early ? 0 : S.un, rec[7] = 0;
    }
    return early;
}
