// speckv interleaved rANS on the GPU (CuPy RawModule). One warp codes one block
// of 32 lanes, exactly the layout of coder/rans.py; the per-lane steps live in
// rans_lane.cuh, shared with the host build that the CPU-only tests drive.
//
// Encode:  spk_rans_encode  (ops -> final states, per-block word counts, words in a
//                            per-block scratch area, ballot-compacted in lane order)
//          exclusive prefix sum of the counts (host side: cupy.cumsum)
//          spk_rans_gather  (scratch -> contiguous container layout)
// Decode:  spk_rans_decode  (states + words + table ids -> symbol index per op),
//          probability tables (cum, freq as u16) staged in shared memory.
#include "rans_lane.cuh"

#define SPK_FULL_MASK 0xFFFFFFFFu

// ops: start/freq (blocks, steps, LANES) u32; scratch: (blocks, steps * LANES) u16
extern "C" __global__ void spk_rans_encode(const uint32_t* __restrict__ start,
                                           const uint32_t* __restrict__ freq,
                                           int n_blocks, int steps,
                                           uint32_t* __restrict__ states,
                                           uint32_t* __restrict__ counts,
                                           uint16_t* __restrict__ scratch) {
    const uint32_t lane = threadIdx.x & 31u;
    const long long b = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= n_blocks) return;  // whole warps exit together
    const long long base = b * (long long)steps * SPK_LANES;
    uint16_t* out = scratch + base;
    uint32_t x = SPK_RANS_L, count = 0;
    // NOTE: rANS is LIFO: the last op is encoded first so the decoder runs forward
    for (int s = steps - 1; s >= 0; --s) {
        const long long i = base + (long long)s * SPK_LANES + lane;
        uint16_t w;
        const uint32_t emit = enc_put(&x, start[i], freq[i], &w);
        const uint32_t ballot = __ballot_sync(SPK_FULL_MASK, emit);
        if (emit) out[count + lane_rank(ballot, lane)] = w;
        count += popcount32(ballot);
    }
    states[b * SPK_LANES + lane] = x;
    if (lane == 0) counts[b] = count;
}

// words[offsets[b] .. + counts[b]) = scratch of block b (offsets: exclusive prefix sum)
extern "C" __global__ void spk_rans_gather(const uint16_t* __restrict__ scratch,
                                           const uint32_t* __restrict__ counts,
                                           const unsigned long long* __restrict__ offsets,
                                           int n_blocks, int steps, uint16_t* __restrict__ words) {
    const uint32_t lane = threadIdx.x & 31u;
    const long long b = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= n_blocks) return;
    const uint16_t* src = scratch + b * (long long)steps * SPK_LANES;
    uint16_t* dst = words + offsets[b];
    for (uint32_t k = lane; k < counts[b]; k += SPK_LANES) dst[k] = src[k];
}

// status per block: 0 ok, 1 read past the start of its words, 2 words left unread,
// 3 a final state is not RANS_L, 4 a table id out of range
extern "C" __global__ void spk_rans_decode(const uint32_t* __restrict__ states,
                                           const uint32_t* __restrict__ counts,
                                           const unsigned long long* __restrict__ offsets,
                                           const uint16_t* __restrict__ words,
                                           const int32_t* __restrict__ tables,
                                           const uint16_t* __restrict__ cum_g,
                                           const uint16_t* __restrict__ freq_g,
                                           const int32_t* __restrict__ toff,
                                           const int32_t* __restrict__ tsize,
                                           int n_tables, int n_entries, int n_blocks, int steps,
                                           uint16_t* __restrict__ out_j,
                                           int32_t* __restrict__ status) {
    extern __shared__ uint16_t smem[];  // cum then freq of every table, u16
    uint16_t* cum = smem;
    uint16_t* fr = smem + n_entries;
    for (int k = threadIdx.x; k < n_entries; k += blockDim.x) {
        cum[k] = cum_g[k];
        fr[k] = freq_g[k];
    }
    __syncthreads();
    const uint32_t lane = threadIdx.x & 31u;
    const long long b = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= n_blocks) return;
    const long long lo = (long long)offsets[b];
    long long end = lo + counts[b];
    uint32_t x = states[b * SPK_LANES + lane];
    int err = 0;
    for (int s = 0; s < steps && !err; ++s) {
        const long long i = (b * (long long)steps + s) * SPK_LANES + lane;
        const int32_t t = tables[i];
        uint32_t j = 0;
        const int bad_t = (t < 0) | (t >= n_tables);
        if (!bad_t) {
            const uint32_t slot = dec_get(x);
            j = dec_find(cum + toff[t], (uint32_t)tsize[t], slot);
            dec_advance(&x, cum[toff[t] + j], fr[toff[t] + j]);
        }
        out_j[i] = (uint16_t)j;
        const uint32_t need = dec_needs(x);
        const uint32_t ballot = __ballot_sync(SPK_FULL_MASK, need);
        if (__any_sync(SPK_FULL_MASK, bad_t)) { err = 4; break; }
        end -= popcount32(ballot);  // NOTE: read backward: this step's words sit at the end
        if (end < lo) { err = 1; break; }
        if (need) x = dec_put_word(x, words[end + lane_rank(ballot, lane)]);
    }
    if (!err && end != lo) err = 2;
    if (!err && !__all_sync(SPK_FULL_MASK, x == SPK_RANS_L)) err = 3;
    if (lane == 0) status[b] = err;
}
