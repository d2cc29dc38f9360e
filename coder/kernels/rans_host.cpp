// Host build of the rANS kernels (rans.cu): the same per-lane code from
// rans_lane.cuh, with the warp emulated in plain C++ (32 lanes in a loop, ballot
// as a bitmask, popcount). The tests compile it with g++ and compare its output
// byte for byte with the numpy coder (coder/rans.py) - without a GPU.
#include <cstddef>
#include "rans_lane.cuh"

extern "C" {

// Mirrors spk_rans_encode + prefix sum + spk_rans_gather for all blocks.
void spk_host_encode(const uint32_t* start, const uint32_t* freq, int n_blocks, int steps,
                     uint32_t* states, uint32_t* counts, uint16_t* scratch,
                     uint16_t* words, unsigned long long* offsets) {
    for (long long b = 0; b < n_blocks; ++b) {
        const long long base = b * (long long)steps * SPK_LANES;
        uint16_t* out = scratch + base;
        uint32_t x[SPK_LANES], count = 0;
        for (uint32_t l = 0; l < SPK_LANES; ++l) x[l] = SPK_RANS_L;
        for (int s = steps - 1; s >= 0; --s) {  // NOTE: LIFO, last op first
            uint32_t emit[SPK_LANES], ballot = 0;
            uint16_t w[SPK_LANES];
            for (uint32_t l = 0; l < SPK_LANES; ++l) {
                const long long i = base + (long long)s * SPK_LANES + l;
                emit[l] = enc_put(&x[l], start[i], freq[i], &w[l]);
                ballot |= emit[l] << l;  // __ballot_sync
            }
            for (uint32_t l = 0; l < SPK_LANES; ++l)
                if (emit[l]) out[count + lane_rank(ballot, l)] = w[l];
            count += popcount32(ballot);
        }
        for (uint32_t l = 0; l < SPK_LANES; ++l) states[b * SPK_LANES + l] = x[l];
        counts[b] = count;
    }
    unsigned long long off = 0;  // exclusive prefix sum (cupy.cumsum on the GPU)
    for (long long b = 0; b < n_blocks; ++b) { offsets[b] = off; off += counts[b]; }
    for (long long b = 0; b < n_blocks; ++b) {  // gather
        const uint16_t* src = scratch + b * (long long)steps * SPK_LANES;
        for (uint32_t k = 0; k < counts[b]; ++k) words[offsets[b] + k] = src[k];
    }
}

// Mirrors spk_rans_decode for all blocks.
void spk_host_decode(const uint32_t* states, const uint32_t* counts, const unsigned long long* offsets,
                     const uint16_t* words, const int32_t* tables, const uint16_t* cum,
                     const uint16_t* fr, const int32_t* toff, const int32_t* tsize, int n_tables,
                     int n_blocks, int steps, uint16_t* out_j, int32_t* status) {
    for (long long b = 0; b < n_blocks; ++b) {
        const long long lo = (long long)offsets[b];
        long long end = lo + counts[b];
        uint32_t x[SPK_LANES];
        for (uint32_t l = 0; l < SPK_LANES; ++l) x[l] = states[b * SPK_LANES + l];
        int err = 0;
        for (int s = 0; s < steps && !err; ++s) {
            uint32_t need[SPK_LANES], ballot = 0, any_bad = 0;
            for (uint32_t l = 0; l < SPK_LANES; ++l) {
                const long long i = (b * (long long)steps + s) * SPK_LANES + l;
                const int32_t t = tables[i];
                uint32_t j = 0;
                const int bad_t = (t < 0) | (t >= n_tables);
                if (!bad_t) {
                    const uint32_t slot = dec_get(x[l]);
                    j = dec_find(cum + toff[t], (uint32_t)tsize[t], slot);
                    dec_advance(&x[l], cum[toff[t] + j], fr[toff[t] + j]);
                }
                out_j[i] = (uint16_t)j;
                any_bad |= (uint32_t)bad_t;
                need[l] = dec_needs(x[l]);
                ballot |= need[l] << l;
            }
            if (any_bad) { err = 4; break; }
            end -= popcount32(ballot);
            if (end < lo) { err = 1; break; }
            for (uint32_t l = 0; l < SPK_LANES; ++l)
                if (need[l]) x[l] = dec_put_word(x[l], words[end + lane_rank(ballot, l)]);
        }
        if (!err && end != lo) err = 2;
        if (!err) {
            for (uint32_t l = 0; l < SPK_LANES; ++l)
                if (x[l] != SPK_RANS_L) { err = 3; break; }
        }
        status[b] = err;
    }
}

}  // extern "C"
