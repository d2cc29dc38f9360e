// int8 x int8 -> int32 matrix product with exact sums, for CPUs whose oneDNN has no fast int8 GEMM.
//
//   C[i][j] = sum_p A[i][p] * B[j][p]        A (m, k), B (n, k), both row-major int8; C (m, n) int32
//
// Integer sums are associative, so every correct order gives the same bits: this equals torch._int_mm
// (and the int64 reference in integer.py) wherever the true sum fits int32, which the callers ensure
// (|A|, |B| <= 127 with k <= 131072). torch 2.13's _int_mm runs ~2 GMAC/s on an AVX2 CPU without VNNI
// (a reference loop), 27x slower than its FP32 GEMM there; this kernel is the W8A8 rung's product on
// such CPUs (integer.py ``int_mm``).
//
// AVX2 micro-kernel: MR rows of A times NR rows of B, 16 k at a time. Each operand's 16 bytes widen to
// int16 (vpmovsxbw, exact), and vpmaddwd sums adjacent int16 products into int32 lanes (exact: two
// products of magnitude <= 2^14). NOTE: not vpmaddubsw: its u8 x s8 pair sums saturate at int16.
// The 8 lanes of each accumulator are summed at the end, then the k % 16 tail in scalar.
// Blocking: B in panels of NC rows (NC * k bytes stay in L2) against every row block of A.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace spk {

constexpr int64_t IGEMM_MR = 4;    // rows of A per micro-kernel
constexpr int64_t IGEMM_NR = 2;    // rows of B per micro-kernel (MR * NR accumulators + MR + NR operands <= 16)
constexpr int64_t IGEMM_NC = 96;   // rows of B per panel: 96 * 1536 bytes = 144 KiB

// The scalar dot product of one row pair over [p0, k): the reference, and the AVX2 kernel's tail.
inline int32_t idot(const int8_t* a, const int8_t* b, int64_t p0, int64_t k) {
    int32_t s = 0;
    for (int64_t p = p0; p < k; ++p) s += (int32_t)a[p] * (int32_t)b[p];
    return s;
}

// C rows [i0, i1) with the scalar loops.
inline void igemm_rows(const int8_t* A, const int8_t* B, int32_t* C, int64_t i0, int64_t i1, int64_t n, int64_t k) {
    for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = 0; j < n; ++j) C[i * n + j] = idot(A + i * k, B + j * k, 0, k);
}

__attribute__((target("avx2"))) inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

__attribute__((target("avx2"))) inline __m256i widen16(const int8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// C[i0 + r][j0 + c] for r < R, c < N (R <= MR, N <= NR).
template <int R, int N>
__attribute__((target("avx2"))) inline void igemm_tile(const int8_t* A, const int8_t* B, int32_t* C, int64_t i0,
                                                       int64_t j0, int64_t n, int64_t k) {
    __m256i acc[R][N];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < N; ++c) acc[r][c] = _mm256_setzero_si256();
    const int64_t k16 = k - k % 16;
    for (int64_t p = 0; p < k16; p += 16) {
        __m256i b[N];
        for (int c = 0; c < N; ++c) b[c] = widen16(B + (j0 + c) * k + p);
        for (int r = 0; r < R; ++r) {
            const __m256i a = widen16(A + (i0 + r) * k + p);
            for (int c = 0; c < N; ++c) acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(a, b[c]));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < N; ++c)
            C[(i0 + r) * n + j0 + c] = hsum8(acc[r][c]) + idot(A + (i0 + r) * k, B + (j0 + c) * k, k16, k);
}

template <int R>
__attribute__((target("avx2"))) inline void igemm_row_block(const int8_t* A, const int8_t* B, int32_t* C, int64_t i0,
                                                            int64_t j0, int64_t j1, int64_t n, int64_t k) {
    int64_t j = j0;
    for (; j + IGEMM_NR <= j1; j += IGEMM_NR) igemm_tile<R, IGEMM_NR>(A, B, C, i0, j, n, k);
    for (; j < j1; ++j) igemm_tile<R, 1>(A, B, C, i0, j, n, k);
}

// C rows [i0, i1) with the AVX2 kernel.
__attribute__((target("avx2"))) inline void igemm_rows_avx2(const int8_t* A, const int8_t* B, int32_t* C, int64_t i0,
                                                            int64_t i1, int64_t n, int64_t k) {
    for (int64_t j0 = 0; j0 < n; j0 += IGEMM_NC) {
        const int64_t j1 = std::min(n, j0 + IGEMM_NC);
        int64_t i = i0;
        for (; i + IGEMM_MR <= i1; i += IGEMM_MR) igemm_row_block<IGEMM_MR>(A, B, C, i, j0, j1, n, k);
        for (; i < i1; ++i) igemm_row_block<1>(A, B, C, i, j0, j1, n, k);
    }
}

}  // namespace spk
