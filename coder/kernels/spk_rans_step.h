// The decoder's rANS step (spk_decode.h, stage 1): every lane's symbol search, state update
// and renormalisation for one step of a block, scalar and on AVX-512 (the same states and bins).
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "spk_block.h"

namespace spk {

// What a rANS decode step reads of the model's tables.
struct RansDecodeTables {
    const int32_t* toff;
    const uint16_t *cum, *freq, *cum_pad, *bucket;
    const uint32_t* op;  // cum | freq << 16 per symbol, or null
};

// One step's rANS ops of lanes [0, live) and its renormalisation (the scalar stage 1's step);
// false when the step's words run under lo.
inline bool rans_decode_step(const RansDecodeTables& T, const uint32_t* __restrict ctx, uint32_t live,
                             const uint16_t* words, int64_t lo, int64_t& end, uint32_t* x, uint32_t* __restrict js) {
    for (uint32_t l = 0; l < live; ++l) {  // NOTE: the lanes are independent: their loads overlap
        const int32_t t = (int32_t)(ctx[l] & 0x3FFu), off = T.toff[t];
        const uint32_t j = dec_find_bucketed(T.cum_pad + off + t, T.bucket + (size_t)t * SPK_BUCKETS, dec_get(x[l]));
        if (T.op) dec_advance(&x[l], T.op[off + j] & 0xFFFFu, T.op[off + j] >> 16);  // one load for both
        else dec_advance(&x[l], T.cum[off + j], T.freq[off + j]);
        js[l] = j;
    }  // padding lanes (l >= live): the no-op leaves the state as it is
    uint32_t ballot = 0;
    for (uint32_t l = 0; l < SPK_LANES; ++l) ballot |= dec_needs(x[l]) << l;
    if (!ballot) return true;
    end -= popcount32(ballot);  // NOTE: read backward: this step's words sit at the end
    if (end < lo) return false;
    // the lane of rank r (among the ballot's lanes, ascending) reads word end + r
    const uint16_t* w = words + end;
    for (uint32_t bits = ballot; bits; bits &= bits - 1u, ++w) {
        const uint32_t l = (uint32_t)__builtin_ctz(bits);
        x[l] = dec_put_word(x[l], *w);
    }
    return true;
}

#if SPK_HAVE_AVX2_BUILD
// rans_decode_step on AVX-512 for a whole step (every lane live): 16 lanes at a time, the tables
// gathered (the u16 ones 32 bits at a time, the low half kept: DecodeTables leaves a spare element),
// the symbol search stepping only the lanes still below their slot, and the words of the lanes that
// renormalise expanded into them in lane order (a masked load: nothing read past the step's words).
SPK_AVX512 inline bool rans_decode_step_avx512(const RansDecodeTables& T, const uint32_t* __restrict ctx,
                                               const uint16_t* words, int64_t lo, int64_t& end, uint32_t* x,
                                               uint32_t* __restrict js) {
    const __m512i low16 = _mm512_set1_epi32(0xFFFF), one = _mm512_set1_epi32(1);
    __m512i xv[2];
    __mmask16 need[2];
    for (int h = 0; h < 2; ++h) {
        const __m512i t = _mm512_and_si512(_mm512_loadu_si512((const void*)(ctx + 16 * h)), _mm512_set1_epi32(0x3FF));
        const __m512i off = _mm512_i32gather_epi32(t, (const void*)T.toff, 4);
        __m512i v = _mm512_loadu_si512((const void*)(x + 16 * h));
        const __m512i slot = _mm512_and_si512(v, _mm512_set1_epi32((int)SPK_PROB_MASK));
        const __m512i row = _mm512_add_epi32(off, t);  // the row's first entry in cum_pad
        const __m512i q = _mm512_add_epi32(_mm512_mullo_epi32(t, _mm512_set1_epi32((int)SPK_BUCKETS)),
                                           _mm512_srli_epi32(slot, SPK_BUCKET_SHIFT));
        __m512i j = _mm512_and_si512(_mm512_i32gather_epi32(q, (const void*)T.bucket, 2), low16);
        // dec_find_bucketed: step up while cum[j + 1] <= slot, two entries a gather (cum[j + 1] in the
        // low half, cum[j + 2] in the high): a lane goes on only after two steps
        for (__mmask16 m = 0xFFFF; m;) {
            const __m512i at = _mm512_add_epi32(_mm512_add_epi32(row, j), one);
            const __m512i c = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, at, (const void*)T.cum_pad, 2);
            const __mmask16 s1 = _mm512_mask_cmple_epu32_mask(m, _mm512_and_si512(c, low16), slot);
            m = _mm512_mask_cmple_epu32_mask(s1, _mm512_srli_epi32(c, 16), slot);
            j = _mm512_mask_add_epi32(_mm512_mask_add_epi32(j, s1, j, one), m, j, _mm512_set1_epi32(2));
        }
        const __m512i opv = _mm512_i32gather_epi32(_mm512_add_epi32(off, j), (const void*)T.op, 4);
        // dec_advance: freq * (x >> PROB_BITS) + slot - start
        v = _mm512_sub_epi32(_mm512_add_epi32(_mm512_mullo_epi32(_mm512_srli_epi32(opv, 16),
                                                                  _mm512_srli_epi32(v, SPK_PROB_BITS)), slot),
                             _mm512_and_si512(opv, low16));
        _mm512_storeu_si512((void*)(js + 16 * h), j);
        xv[h] = v;
        need[h] = _mm512_cmplt_epu32_mask(v, _mm512_set1_epi32((int)SPK_RANS_L));
    }
    const uint32_t n0 = (uint32_t)__builtin_popcount(need[0]), n1 = (uint32_t)__builtin_popcount(need[1]);
    if (n0 + n1) {
        end -= n0 + n1;  // NOTE: read backward: this step's words sit at the end
        if (end < lo) return false;
        const uint16_t* w = words + end;
        for (int h = 0; h < 2; ++h) {
            const __mmask16 m = need[h];
            const __m512i wv = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)((1u << __builtin_popcount(m)) - 1u),
                                                                           (const void*)(h ? w + n0 : w)));
            xv[h] = _mm512_mask_or_epi32(xv[h], m, _mm512_slli_epi32(xv[h], SPK_WORD_BITS), _mm512_maskz_expand_epi32(m, wv));
        }
    }
    _mm512_storeu_si512((void*)x, xv[0]);
    _mm512_storeu_si512((void*)(x + 16), xv[1]);
    return true;
}
#endif

}  // namespace spk
