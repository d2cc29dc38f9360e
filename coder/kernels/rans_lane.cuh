// Per-lane logic of speckv's interleaved rANS coder, shared by the CUDA kernels
// (spk_fused.cu) and the CPU extension (spk_native.cpp, spk_encode.h, spk_decode.h), so both run
// the very same integer code.
//
// Layout and byte format: coder/rans.py (the numpy reference) and coder/FORMAT.md.
// A block is one warp: LANES independent 32-bit states sharing one word stream.
// Integer-only: no floating point anywhere, so no --fmad question arises.
#pragma once

#ifdef __CUDACC__
#define SPK_HD __host__ __device__ __forceinline__
#ifdef __CUDACC_RTC__
// NOTE: NVRTC (CuPy RawModule) ships no C standard headers
typedef unsigned int uint32_t;
typedef unsigned short uint16_t;
typedef unsigned char uint8_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#else
#include <stdint.h>
#endif
#else
#define SPK_HD static inline
#include <cstdint>
#endif

#include "spk_consts.h"

// -- encoder -----------------------------------------------------------------
// enc_put: code one op (start, freq) into *x. Returns 1 when the lane first
// renormalises, writing the low 16 bits of the old state to *word.
// NOTE: rANS is LIFO: callers feed ops from the last step to the first.
SPK_HD uint32_t enc_put(uint32_t* x, uint32_t start, uint32_t freq, uint16_t* word) {
    uint32_t s = *x;
    // NOTE: x >= 2**17 * freq, tested as (x >> 17) >= freq: 2**17 * 2**15 overflows u32
    uint32_t emit = (s >> SPK_X_MAX_SHIFT) >= freq;
    *word = (uint16_t)(s & 0xFFFFu);
    if (emit) s >>= SPK_WORD_BITS;
    *x = ((s / freq) << SPK_PROB_BITS) + (s % freq) + start;
    return emit;
}

// -- decoder -----------------------------------------------------------------
SPK_HD uint32_t dec_get(uint32_t x) { return x & SPK_PROB_MASK; }

// dec_find_bucketed: the symbol j of one table whose [cum[j], cum[j + 1]) holds slot,
// found from the first symbol reaching into the slot's bucket (its top bits), then
// stepping up; cum here ends with a PROB_SCALE sentinel.
// NOTE: near the mode a symbol spans more than a bucket, so one branch-free step
// nearly always ends it; the loop is for the tails.
SPK_HD uint32_t dec_find_bucketed(const uint16_t* cum, const uint16_t* bucket, uint32_t slot) {
    uint32_t j = bucket[slot >> SPK_BUCKET_SHIFT];
    j += cum[j + 1u] <= slot;
    while (cum[j + 1u] <= slot) ++j;
    return j;
}

// dec_advance: consume the op (start, freq) that owns slot = dec_get(*x).
SPK_HD void dec_advance(uint32_t* x, uint32_t start, uint32_t freq) {
    *x = freq * (*x >> SPK_PROB_BITS) + (*x & SPK_PROB_MASK) - start;
}

// dec_needs: the lane reads one word before its next op.
SPK_HD uint32_t dec_needs(uint32_t x) { return x < SPK_RANS_L; }

SPK_HD uint32_t dec_put_word(uint32_t x, uint16_t w) { return (x << SPK_WORD_BITS) | (uint32_t)w; }

// rank of this lane among the set bits of a warp ballot (bits of lower lanes)
SPK_HD uint32_t lane_rank(uint32_t ballot, uint32_t lane) {
#ifdef __CUDA_ARCH__
    return __popc(ballot & ((1u << lane) - 1u));
#else
    return (uint32_t)__builtin_popcount(ballot & ((1u << lane) - 1u));
#endif
}

SPK_HD uint32_t popcount32(uint32_t v) {
#ifdef __CUDA_ARCH__
    return __popc(v);
#else
    return (uint32_t)__builtin_popcount(v);
#endif
}
