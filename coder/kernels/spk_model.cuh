// Per-element logic of speckv's probability model (coder/model.py, coder/residual.py,
// coder/tables.py), as __host__ __device__ functions shared by the CPU extension
// (spk_native.cpp) and the CUDA kernels (spk_fused.cu): both run this very code.
//
// Every scalar x is coded relative to its prediction mu on a power-of-two grid
// w = 2^k (FORMAT.md "Probability model 1"): one rANS op for the bin distance
// d = c_x - c_mu under Gaussian table t, and raw bits (LOW, ZMAN, ESC, UNARY) for
// the rest. Integer arithmetic on bit patterns, except a handful of IEEE float32
// operations that are exact or correctly rounded on every backend.
// Forward-adaptive sigma (format version 4): every L this code receives is already the
// coded level L' = L + shift, the checkpoint's per-channel log2 sigma plus its (layer, kv,
// head) group's signed shift from the chunk's aux (|shift| <= SPK_SHIFT_MAX, 1/8 octaves),
// one integer addition done once per channel on the host (coder/plan.py Plan.shifted) for
// every backend alike; nothing below depends on whether L was shifted (shift 0: L' = L).
// NOTE: those float operations must be neither fused (FMA) nor flushed to zero:
// the host build uses -ffp-contract=off without -ffast-math, the device code the float64
// emulation of spk_float.cuh (CuPy builds it with -ftz=true: float32 instructions flush subnormals).
#pragma once
#include "rans_lane.cuh"

#include "spk_float.cuh"

SPK_HD int32_t spk_min(int32_t a, int32_t b) { return a < b ? a : b; }
SPK_HD int32_t spk_max(int32_t a, int32_t b) { return a > b ? a : b; }

// A sign-magnitude float format coded by the model (model.FloatFormat).
template <int BITS, int MANT, int BIAS, int MAX_FIELD, bool E4M3FN>
struct SpkFormat {
    static constexpr int bits = BITS, mant = MANT, bias = BIAS, max_field = MAX_FIELD;
    static constexpr bool fp8 = E4M3FN;
    static constexpr uint32_t exp_mask = (1u << (BITS - 1 - MANT)) - 1u;
    static constexpr uint32_t mant_mask = (1u << MANT) - 1u;
    static constexpr int k_min = 1 - BIAS;                  // zero bin = zeros + subnormals
    static constexpr int k_max = MAX_FIELD - BIAS - MANT;   // coarser bins skip top values
};
typedef SpkFormat<16, 7, 127, 254, false> SpkBF16;
typedef SpkFormat<8, 3, 7, 15, true> SpkE4M3;
typedef SpkFormat<32, 23, 127, 254, false> SpkFP32;  // mu of the FP8 path: predictor / scale

template <class F>
SPK_HD bool spk_finite(uint32_t x) {
    if (F::fp8) return (x & 0x7Fu) != 0x7Fu;  // e4m3fn: only NaN is non-finite
    return ((x >> F::mant) & F::exp_mask) != F::exp_mask;
}

// Exact float32 value of a bit pattern (model.as_float32).
template <class F>
SPK_HD float spk_as_float(uint32_t x) {
    if (F::bits == 32) return spk_f32(x);
    if (F::bits == 16) return spk_f32(x << 16);
    // e4m3fn: normal (8 + m) 2^(e - 10) = exponent e - 7; subnormal m 2^-9 (exact)
    const uint32_t e = (x >> 3) & 0xFu, m = x & 7u, s = (x & 0x80u) << 24;
    if ((x & 0x7Fu) == 0x7Fu) return spk_f32(0x7FC00000u | s);
    if (e) return spk_f32(s | ((e + 120u) << 23) | (m << 20));
    return spk_f32(s | spk_u32(SPK_FMUL((float)m, 0.001953125f)));  // m * 2^-9
}

// floor(log2 n) (0 for n = 0): model.FLOG2
SPK_HD int32_t spk_flog2(uint32_t n) { return 31 - spk_clz32(n | 1u); }

// floor(8 log2 n) for 1 <= n <= 255, exactly: the largest j with 2^j <= n^8 (model.LOG2Q8)
SPK_HD int32_t spk_log2q8_exact(uint32_t n) {
    uint64_t p = (uint64_t)n * n;
    p *= p;
    p *= p;
    return 63 - spk_clz64(p);
}

#ifndef __CUDA_ARCH__
struct SpkLog2Q8Table {  // the host reads the same integers from a table built at compile time
    uint8_t v[256];
    constexpr SpkLog2Q8Table() : v() {
        for (uint32_t n = 1; n < 256; ++n) {
            uint64_t p = (uint64_t)n * n;
            p *= p;
            p *= p;
            uint8_t b = 63;
            while (!(p >> b)) --b;
            v[n] = b;
        }
    }
};
static constexpr SpkLog2Q8Table spk_log2q8_table{};
#endif

SPK_HD int32_t spk_log2q8(uint32_t n) {
#ifdef __CUDA_ARCH__
    return spk_log2q8_exact(n);
#else
    return spk_log2q8_table.v[n & 0xFFu];
#endif
}

// Table row for log2 sigma_b = lam / 8 and mu's offset in its bin (tables.table_row).
SPK_HD int32_t spk_table_row(int32_t lam, int32_t off) {
    lam = spk_max(SPK_LAMBDA_MIN, spk_min(lam, SPK_LAMBDA_MAX));
    if (lam < SPK_LAMBDA_OFFSET) return (lam - SPK_LAMBDA_MIN) * SPK_OFFSETS + off;
    return (SPK_LAMBDA_OFFSET - SPK_LAMBDA_MIN) * SPK_OFFSETS + lam - SPK_LAMBDA_OFFSET;
}

// |value| in grid units, clamped to [0, MAX_BIN] (NaN -> 0): model.bin_index before floor.
// NOTE: scaling by 2^-k is exact (or a correctly rounded underflow): 2^-k is built from
// its bits, k in [-126, 120].
template <class F>
SPK_HD float spk_grid_value(uint32_t x, int32_t k) {
    const float scale = spk_f32((uint32_t)(127 - k) << 23);
    float v = SPK_FMUL(spk_f32(spk_u32(spk_as_float<F>(x)) & 0x7FFFFFFFu), scale);
    if (SPK_ISNAN(v)) return 0.0f;
    return v < (float)SPK_MAX_BIN ? v : (float)SPK_MAX_BIN;
}

// Signed bin of x on the grid 2^k: c = floor(|x| / w) for +x, -1 - c for -x.
// NOTE: grid values lie in [0, MAX_BIN], where truncation is floor (and exact).
template <class F>
SPK_HD int32_t spk_bin(uint32_t x, int32_t k) {
    const int32_t mag = (int32_t)spk_grid_value<F>(x, k);
    return (x >> (F::bits - 1)) ? ~mag : mag;
}

// Everything both sides derive from mu and sigma (model.context).
struct SpkContext {
    int32_t k;       // grid exponent
    int32_t t;       // Gaussian table row
    int32_t c_mu;    // mu's bin
    uint32_t mu_ok;  // mu is finite
};

// Context of BF16 mu for BF16 x in integers only: mu's grid value is sig 2^-nb with
// nb = k - (e_unb - 7), so mu + half a bin is (2 sig + 1) 2^-(nb + 1), exactly as the
// float path computes it (at most 9 significant bits); beyond nb = 24 the float path's
// sum rounds, but its bin and offset are 0 either way. Identical to spk_context for
// every (mu, L): tests/coder/test_native.py checks all 65536 patterns at every level.
SPK_HD SpkContext spk_context_bf16(uint32_t mu, int32_t L) {
    const int32_t e_mu = (int32_t)((mu >> 7) & 0xFFu), man = (int32_t)(mu & 0x7Fu);
    const int32_t e_unb = spk_max(e_mu, 1) - 127;
    const int32_t near = spk_log2q8(128u - (uint32_t)man) + (e_unb - 7) * SPK_SIGMA_ONE < L + SPK_NEAR_TOP_Q8;
    const int32_t k_s = (L >> SPK_SIGMA_FRAC_BITS) - SPK_GRID_BELOW_SIGMA;  // NOTE: >> floors negatives
    const int32_t k = spk_max(SpkBF16::k_min, spk_min(spk_max(k_s, e_unb - 7 + near), SpkBF16::k_max));
    const int32_t nb = k - (e_unb - 7);
    int32_t mag = 0, frac = 0;
    if (e_mu == 0xFF) {
        mag = man ? 0 : SPK_MAX_BIN;  // NaN: bin 0; inf: the last bin
    } else if (nb < 0) {
        mag = (man | (e_mu ? 128 : 0)) << -nb;  // top binade on a clamped grid: half = 0
    } else if (nb < 25) {
        const uint32_t v = 2u * (uint32_t)(man | (e_mu ? 128 : 0)) + 1u;  // (mu + half) 2^(nb + 1)
        mag = (int32_t)(v >> (nb + 1));
        frac = (int32_t)(((v & ((1u << (nb + 1)) - 1u)) << SPK_OFFSET_BITS) >> (nb + 1));
    }
    const bool neg = (mu >> 15) != 0;
    SpkContext c;
    c.k = k;
    c.c_mu = neg ? ~mag : mag;
    c.t = spk_table_row(L - k * SPK_SIGMA_ONE, neg ? SPK_OFFSETS - 1 - frac : frac);
    c.mu_ok = e_mu != 0xFF;
    return c;
}

// Context of one element: mu's bit pattern in format FM, fixed-point log2 sigma L
// (1/8 octave, in x's units), x in format FX. (The reference arithmetic; BF16 runs
// spk_context_bf16, its integer equivalent.)
template <class FX, class FM>
SPK_HD SpkContext spk_context_float(uint32_t mu, int32_t L) {
    const int32_t e_mu = (int32_t)((mu >> FM::mant) & FM::exp_mask);
    const uint32_t man = mu & FM::mant_mask;
    const int32_t e_unb = spk_max(spk_max(e_mu, 1) - FM::bias, 1 - FX::bias);  // mu's binade
    // near the binade top (in x's ULPs): take the next binade's grid
    const uint32_t top = (1u << FX::mant) - (man >> (FM::mant - FX::mant));
    const int32_t near = spk_log2q8(top) + (e_unb - FX::mant) * SPK_SIGMA_ONE < L + SPK_NEAR_TOP_Q8;
    const int32_t k_mu = e_unb - FX::mant + near;
    const int32_t k_s = (L >> SPK_SIGMA_FRAC_BITS) - SPK_GRID_BELOW_SIGMA;  // NOTE: >> floors negatives
    const int32_t k = spk_max(FX::k_min, spk_min(spk_max(k_s, k_mu), FX::k_max));
    // NOTE: a value's rounding bucket is centred on it, so a bin holding 2^nb values spans
    // [c - 2^-(nb+1), c + 1 - 2^-(nb+1)): place mu on that shifted grid (one fp32 add)
    const int32_t nb_mu = spk_min(k - (e_unb - FX::mant), 24);
    const float half = nb_mu >= 0 ? spk_f32((uint32_t)(126 - nb_mu) << 23) : 0.0f;
    float v = SPK_FADD(spk_grid_value<FM>(mu, k), half);
    v = v < (float)SPK_MAX_BIN ? v : (float)SPK_MAX_BIN;
    const float mag = (float)(int32_t)v;  // floor: v in [0, MAX_BIN]
    const int32_t frac = (int32_t)SPK_FMUL(SPK_FSUB(v, mag), (float)SPK_OFFSETS);
    const bool neg = (mu >> (FM::bits - 1)) != 0;
    SpkContext c;
    c.k = k;
    c.c_mu = neg ? ~(int32_t)mag : (int32_t)mag;
    c.t = spk_table_row(L - k * SPK_SIGMA_ONE, neg ? SPK_OFFSETS - 1 - frac : frac);
    c.mu_ok = spk_finite<FM>(mu);
    return c;
}

template <class FX, class FM>
SPK_HD SpkContext spk_context(uint32_t mu, int32_t L) {
    if (FM::bits == 16 && FX::bits == 16) return spk_context_bf16(mu, L);
    return spk_context_float<FX, FM>(mu, L);
}

// A context packed in 32 bits, as model.ContextTable packs it: table row (bits 0-9),
// k + 128 (10-17), c_mu + 4096 (18-30), mu finite (31). The CPU coder tabulates BF16
// contexts per sigma level (one 65536-entry row per level) and looks them up.
SPK_HD uint32_t spk_pack_context(const SpkContext& c) {
    return (uint32_t)c.t | (uint32_t)(c.k + 128) << 10 | (uint32_t)(c.c_mu + 4096) << 18 | c.mu_ok << 31;
}

SPK_HD SpkContext spk_unpack_context(uint32_t p) {
    SpkContext c;
    c.t = (int32_t)(p & 0x3FFu), c.k = (int32_t)((p >> 10) & 0xFFu) - 128;
    c.c_mu = (int32_t)((p >> 18) & 0x1FFFu) - 4096, c.mu_ok = p >> 31;
    return c;
}

// -- BF16 contexts looked up (the CPU coder) ------------------------------------------
// NOTE: a BF16 context is invariant under scaling: mu 2^s at level L + 8s has the context
// of mu at level L with k + s (near, nb, bin, offset and table row depend only on mu's
// mantissa, sign and exponent relative to L >> 3). So one table of the levels 0..7 and
// exponents within SPK_CTX_SPAN binades of sigma serves every level: 256 KB, cache
// resident, where a row per level (256 KB each) was not. Outside it - mu zero,
// subnormal, non-finite or far from sigma, or k clamped - the context is computed.
#define SPK_CTX_EXP_BITS 5                      // mu's binade relative to sigma: [-16, 16)
#define SPK_CTX_SPAN (1 << SPK_CTX_EXP_BITS)
#define SPK_CTX_ENTRIES (SPK_SIGMA_ONE * 2 * SPK_CTX_SPAN * 128)

// the entry of (L mod 8, mu's sign, its binade relative to L >> 3, mantissa); -1: none
SPK_HD int32_t spk_ctx_slot(uint32_t mu, int32_t L) {
    const int32_t e_mu = (int32_t)((mu >> 7) & 0xFFu);
    const int32_t rel = e_mu - 127 - (L >> SPK_SIGMA_FRAC_BITS) + SPK_CTX_SPAN / 2;  // NOTE: >> floors negatives
    if (e_mu == 0 || e_mu == 0xFF || (uint32_t)rel >= (uint32_t)SPK_CTX_SPAN) return -1;
    return (((L & (SPK_SIGMA_ONE - 1)) << 1 | (int32_t)(mu >> 15)) << SPK_CTX_EXP_BITS | rel) << 7 | (int32_t)(mu & 0x7Fu);
}

// the table's entry i: spk_context_bf16 of its mu at its level in 0..7 (packed)
SPK_HD uint32_t spk_ctx_entry(int32_t i) {
    const int32_t man = i & 0x7F, rel = (i >> 7) & (SPK_CTX_SPAN - 1), sign = (i >> (7 + SPK_CTX_EXP_BITS)) & 1;
    const int32_t L = i >> (8 + SPK_CTX_EXP_BITS);
    const uint32_t mu = (uint32_t)sign << 15 | (uint32_t)(127 + rel - SPK_CTX_SPAN / 2) << 7 | (uint32_t)man;
    return spk_pack_context(spk_context_bf16(mu, L));
}

SPK_HD SpkContext spk_context_bf16_lookup(const uint32_t* tab, uint32_t mu, int32_t L) {
    const int32_t i = spk_ctx_slot(mu, L);
    if (i >= 0) {
        SpkContext c = spk_unpack_context(tab[i]);
        c.k += L >> SPK_SIGMA_FRAC_BITS;
        if (c.k >= SpkBF16::k_min && c.k <= SpkBF16::k_max) return c;
    }
    return spk_context_bf16(mu, L);
}

// |bin| in the symmetric tiling (c for c >= 0, -1 - c for c < 0)
SPK_HD int32_t spk_magnitude(int32_t c) { return c ^ (c >> 31); }

// Raw low significand bits of a value in bin mag >= 1 (negative: the value spans bins)
template <class FX>
SPK_HD int32_t spk_low_bits(int32_t mag) { return FX::mant - spk_flog2((uint32_t)spk_min(mag, SPK_MAX_BIN)); }

// What the encoder emits for one element (model.symbolize).
struct SpkSymbol {
    uint32_t j;      // symbol index in table t (2R + 1 = ESC)
    uint32_t kind;   // SPK_KIND_*
    uint32_t width;  // bits of its raw field: LOW width, ZMAN mant, ESC bits
    uint32_t field;  // the raw field's value
    uint32_t delta;  // ZERO only: unary exponent distance below w
};

template <class FX>
SPK_HD SpkSymbol spk_symbolize(uint32_t x, const SpkContext& ctx, int32_t radius) {
    const int32_t c = spk_bin<FX>(x, ctx.k);
    const int32_t d = c - ctx.c_mu;
    const int32_t mag = spk_magnitude(c);
    SpkSymbol s;
    s.delta = 0;
    if (!spk_finite<FX>(x) || !ctx.mu_ok || d > radius || d < -radius || mag >= SPK_MAX_BIN) {
        s.j = 2u * (uint32_t)radius + 1u;
        s.kind = SPK_KIND_ESC;
        s.width = FX::bits;
        s.field = x;
    } else if (mag == 0) {
        s.j = (uint32_t)(d + radius);
        s.kind = SPK_KIND_ZERO;
        s.width = FX::mant;
        s.field = x & FX::mant_mask;
        s.delta = (uint32_t)(ctx.k + FX::bias - 1 - (int32_t)((x >> FX::mant) & FX::exp_mask));
    } else {
        // NOTE: normal values are normal floats, so their low nb <= mant bits are the
        // pattern's own low bits (the implicit leading 1 is never among them)
        s.j = (uint32_t)(d + radius);
        s.kind = SPK_KIND_NORMAL;
        s.width = (uint32_t)spk_max(spk_low_bits<FX>(mag), 0);
        s.field = x & ((1u << s.width) - 1u);
    }
    return s;
}

// Decoder side, step 1: an element's kind and bin from its decoded symbol index.
struct SpkClass {
    int32_t c;       // the bin
    uint32_t kind;   // SPK_KIND_*
    uint32_t width;  // raw field width
};

template <class FX>
SPK_HD SpkClass spk_classify(uint32_t j, const SpkContext& ctx, int32_t radius) {
    SpkClass r;
    r.c = ctx.c_mu + ((int32_t)j - radius);
    if (j == 2u * (uint32_t)radius + 1u) {
        r.kind = SPK_KIND_ESC;
        r.width = FX::bits;
    } else if (spk_magnitude(r.c) == 0) {
        r.kind = SPK_KIND_ZERO;
        r.width = FX::mant;
    } else {
        r.kind = SPK_KIND_NORMAL;
        r.width = (uint32_t)spk_max(spk_low_bits<FX>(spk_magnitude(r.c)), 0);
    }
    return r;
}

// Decoder side, step 2: the bit pattern of a NORMAL element from its bin and LOW
// bits; *bad when the bin holds no finite value of the format (a corrupt stream).
template <class FX>
SPK_HD uint32_t spk_normal_value(int32_t k, int32_t c, uint32_t low, uint32_t* bad) {
    const int32_t mag = spk_magnitude(c);
    const int32_t nb = spk_low_bits<FX>(mag);
    const int32_t e = k + (FX::mant - nb) + FX::bias;  // exponent field of the bin's binade
    const int32_t down = spk_min(spk_max(-nb, 0), 30);
    const uint32_t sig = nb >= 0 ? ((uint32_t)mag << nb) | low : (uint32_t)mag >> down;
    uint32_t b = (e < 1) | (e > FX::max_field) | (mag >= SPK_MAX_BIN);
    b |= ((uint32_t)mag & ((1u << down) - 1u)) != 0u;  // a bin strictly inside a wider value's bucket
    if (FX::fp8) b |= (e == FX::max_field) & ((sig & 7u) == 7u);  // e4m3fn's NaN
    *bad |= b;
    return ((uint32_t)(c < 0) << (FX::bits - 1)) | ((uint32_t)e << FX::mant) | (sig & FX::mant_mask);
}

// ... of a ZERO element from its mantissa and unary exponent distance.
template <class FX>
SPK_HD uint32_t spk_zero_value(int32_t k, int32_t c, uint32_t man, uint32_t delta, uint32_t* bad) {
    const int32_t dl = delta > (1u << 20) ? (1 << 20) : (int32_t)delta;  // no overflow below
    const int32_t e = k + FX::bias - 1 - dl;
    *bad |= e < 0;
    return ((uint32_t)(c < 0) << (FX::bits - 1)) | ((uint32_t)(e < 0 ? 0 : e) << FX::mant) | man;
}

// Decoder: an element between the rANS pass and the value pass, packed in 32 bits:
// bin + 8192 (14 bits) | k + 128 (8) | kind (2) | mu not finite (1). The CPU's vector classify
// (spk_simd.h, classify_body) also packs the raw field's width in bits 25-29 (INFO_WIDTH_SHIFT),
// which only its vector stage C reads; this scalar packing leaves them 0.
SPK_HD uint32_t pack_info(int32_t c, int32_t k, uint32_t kind, uint32_t mu_bad) {
    return (uint32_t)(c + 8192) | (uint32_t)(k + 128) << 14 | kind << 22 | mu_bad << 24;
}

// -- mu correction (residual.affine_bf16, the FP8 division of Codec._plan) ------------
// float32 -> BF16, round to nearest even; NaN -> the quiet NaN 0x7FC0 (residual.f32_to_bf16)
SPK_HD uint32_t spk_f32_to_bf16(float y) {
    const uint32_t u = spk_u32(y);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) & 0xFFFFu;
}

// mu' = bf16(a * mu + b): one fp32 multiply, then one fp32 add (never fused); an
// identity channel (a == 1 and b == +-0) keeps mu bit for bit.
// NOTE: compared as bits: a float compare flushes a subnormal b to 0 on the device (setp.ftz)
SPK_HD uint32_t spk_affine_bf16(uint32_t mu, float a, float b) {
    if (spk_u32(a) == 0x3F800000u && (spk_u32(b) << 1) == 0u) return mu;
    return spk_f32_to_bf16(SPK_FADD(SPK_FMUL(spk_f32(mu << 16), a), b));
}

// FP8 path: mu / scale in IEEE fp32 (one correctly rounded division), as bits.
// NOTE: IEEE leaves a NaN result's bits open. x86 (numpy, the CPU build's vector loops) returns
// the NaN operand, the dividend's first, quieted, and its default NaN 0xFFC00000 for 0/0 and
// inf/inf; a GPU returns 0x7FFFFFFF for all of them. The x86 rules are spelled out here so that
// every backend prepares the same bits (a lent H200 showed the difference, 2026-12-04).
SPK_HD uint32_t spk_fp8_mu(uint32_t mu_bf16, float scale) {
    const uint32_t m = mu_bf16 << 16, s = spk_u32(scale);
    if ((m & 0x7FFFFFFFu) > 0x7F800000u) return m | 0x00400000u;
    if ((s & 0x7FFFFFFFu) > 0x7F800000u) return s | 0x00400000u;
    const uint32_t q = spk_u32(SPK_FDIV(spk_f32(m), scale));
    return (q & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFC00000u : q;
}
