// The portable predictor's softmax numerators (speckv/predictor/int_attention.py), in integers
// and single float32 products, so every machine computes the same bits:
//
//   d   = S_max - S_j                     int32, j <= pos (causal); S_max over those keys
//   idx = floor(float(d) * Mf)            one correctly rounded float32 product; d < 2^24 is exact
//   e   = idx < EXP_LEN ? EXP[idx] : 0    e < 2^(2 split)
//   hi  = e >> split, lo = e & (2^split - 1)   int8 halves for the two int8 P @ V products
//   sum = sum_j e                         int64
//
// NOTE: no FMA can form here (a product then a compare); the build passes -ffp-contract=off anyway.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace spk {

// One row: scores s[0..n), keys <= pos valid (pos may be >= n: all keys).
inline int64_t int_softmax_row(const int32_t* s, int64_t n, int64_t pos, float mf, const int32_t* table,
                               int32_t exp_len, int split, int8_t* hi, int8_t* lo) {
    const int64_t m = std::min<int64_t>(pos + 1, n);
    int32_t smax = INT32_MIN;
    for (int64_t j = 0; j < m; ++j) smax = std::max(smax, s[j]);
    const float lim = (float)exp_len;
    int64_t sum = 0;
    for (int64_t j = 0; j < m; ++j) {
        const float x = (float)(smax - s[j]) * mf;
        const int32_t idx = (int32_t)std::min(x, lim);  // x >= 0: truncation is floor
        const int32_t e = idx < exp_len ? table[idx] : 0;
        hi[j] = (int8_t)(e >> split);
        lo[j] = (int8_t)(e & ((1 << split) - 1));
        sum += e;
    }
    if (m < n) {
        std::memset(hi + m, 0, (size_t)(n - m));
        std::memset(lo + m, 0, (size_t)(n - m));
    }
    return sum;
}

}  // namespace spk
