// The CPU coder's vector stages: the per-element model of spk_model.cuh (context,
// symbol, table op; the decoder's classification) over a whole block at once, written
// branch-free so that the compiler vectorises each loop (AVX2: 8 lanes, gathers for the
// table reads). Each loop is compiled twice, for AVX2 and for AVX-512 (F, BW, VL, DQ: mask
// registers and three-input logic, at the compiler's preferred vector width), and a block
// runs one of them (SimdTables::wide), chosen at run time; both write the same integers. They compute the very integers of spk_context_bf16, spk_symbolize and
// spk_classify: tests/coder/test_native_contexts.py checks every BF16 mu pattern at every
// level, and tests/coder/test_native_identity.py whole streams against the scalar path
// (which stays the fallback on CPUs without AVX2, chosen at run time).
// NOTE: no floating point here: a vectorised float loop could round differently only
// through contraction, but integers need no such care.
#pragma once
#include <vector>

#include "spk_model.cuh"

#if defined(__x86_64__) && defined(__GNUC__)
#define SPK_HAVE_AVX2_BUILD 1
#define SPK_AVX2 __attribute__((target("avx2")))
#define SPK_AVX512 __attribute__((target("avx2,avx512f,avx512bw,avx512vl,avx512dq")))
#else
#define SPK_HAVE_AVX2_BUILD 0
#define SPK_AVX2
#define SPK_AVX512
#endif
#define SPK_INLINE static inline __attribute__((always_inline))

namespace spk {

// c ? a : b on all-ones / all-zeros masks (a select, not a branch)
SPK_INLINE int32_t sel(int32_t c, int32_t a, int32_t b) { return b ^ ((a ^ b) & -c); }
SPK_INLINE int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }
SPK_INLINE int32_t imax(int32_t a, int32_t b) { return a > b ? a : b; }

struct SimdTables {
    const uint32_t* op;     // per symbol: cum | freq << 16 (the encoder's rANS op)
    const int32_t* off;     // per table row: its first symbol
    const int32_t* radius;  // per table row: R (ESC = 2R + 1)
    const int32_t* log2q8;  // spk_log2q8 of 0..255 (int32: the vectoriser gathers 32-bit words)
    bool wide = false;      // run the AVX-512 builds of the loops (cpu_has_avx512)
};

// Owns SimdTables' arrays for one model's Tables.
struct SimdTableData {
    std::vector<uint32_t> op;
    std::vector<int32_t> log2q8;
    SimdTables view{};
    SimdTableData(const uint16_t* cum, const uint16_t* freq, int64_t n_symbols, const int32_t* off,
                  const int32_t* radius)
        : op((size_t)n_symbols), log2q8(256) {
        for (int64_t i = 0; i < n_symbols; ++i) op[(size_t)i] = cum[i] | (uint32_t)freq[i] << 16;
        for (uint32_t n = 0; n < 256; ++n) log2q8[n] = n ? spk_log2q8(n) : 0;
        view = SimdTables{op.data(), off, radius, log2q8.data(), false};
    }
};

// What the encoder's bit pass needs of an element: raw field (16 bits), its width (5),
// kind (2) and k + 128 (8, for a zero-bin element's unary exponent distance).
SPK_INLINE uint32_t pack_desc(uint32_t field, uint32_t width, uint32_t kind, int32_t k) {
    return field | width << 16 | kind << 21 | (uint32_t)(k + 128) << 23;
}

// spk_table_row, branch-free: the row of log2 sigma_b = lam / 8 and mu's offset in its bin
SPK_INLINE int32_t table_row(int32_t lam, int32_t off) {
    lam = imax(SPK_LAMBDA_MIN, imin(lam, SPK_LAMBDA_MAX));
    return sel(lam < SPK_LAMBDA_OFFSET, (lam - SPK_LAMBDA_MIN) * SPK_OFFSETS + off,
               (SPK_LAMBDA_OFFSET - SPK_LAMBDA_MIN) * SPK_OFFSETS + lam - SPK_LAMBDA_OFFSET);
}

// spk_context_bf16, branch-free: (k, table row, c_mu, mu finite)
SPK_INLINE void context_bf16(int32_t mu, int32_t L, const int32_t* __restrict lg8, int32_t& k, int32_t& t,
                             int32_t& c_mu, int32_t& mu_ok) {
    const int32_t e_mu = (mu >> 7) & 0xFF, man = mu & 0x7F, neg = mu >> 15;
    const int32_t e_unb = imax(e_mu, 1) - 127;
    const int32_t near = lg8[128 - man] + (e_unb - 7) * SPK_SIGMA_ONE < L + SPK_NEAR_TOP_Q8;
    const int32_t k_s = (L >> SPK_SIGMA_FRAC_BITS) - SPK_GRID_BELOW_SIGMA;  // NOTE: >> floors negatives
    k = imax(SpkBF16::k_min, imin(imax(k_s, e_unb - 7 + near), SpkBF16::k_max));
    const int32_t nb = k - (e_unb - 7);
    const int32_t sig = man | sel(e_mu != 0, 128, 0), v = 2 * sig + 1, sh = imin(imax(nb + 1, 0), 31);
    const int32_t inside = (nb >= 0) & (nb < 25);
    int32_t mag = sel(nb < 0, sig << imin(imax(-nb, 0), 31), sel(inside, v >> sh, 0));
    int32_t frac = sel(inside, (int32_t)((((uint32_t)v & ((1u << sh) - 1u)) << SPK_OFFSET_BITS) >> sh), 0);
    mag = sel(e_mu == 0xFF, sel(man != 0, 0, SPK_MAX_BIN), mag);  // NaN: bin 0; inf: the last bin
    frac = sel(e_mu == 0xFF, 0, frac);
    c_mu = mag ^ -neg;
    t = table_row(L - k * SPK_SIGMA_ONE, frac ^ ((SPK_OFFSETS - 1) & -neg));
    mu_ok = e_mu != 0xFF;
}

// spk_context_float<SpkE4M3, SpkFP32> (FP8 KV: mu' / scale in fp32), branch-free; its
// float operations are the scalar path's, one by one (no contraction: -ffp-contract=off)
SPK_INLINE float f32_of(uint32_t u) { return __builtin_bit_cast(float, u); }
SPK_INLINE uint32_t u32_of(float f) { return __builtin_bit_cast(uint32_t, f); }

SPK_INLINE void context_fp8(uint32_t mu, int32_t L, const int32_t* __restrict lg8, int32_t& k, int32_t& t,
                            int32_t& c_mu, int32_t& mu_ok) {
    typedef SpkE4M3 FX;
    const int32_t e_mu = (int32_t)((mu >> 23) & 0xFFu), neg = (int32_t)(mu >> 31);
    const int32_t e_unb = imax(imax(e_mu, 1) - 127, 1 - FX::bias);
    const int32_t top = (1 << FX::mant) - (int32_t)((mu & 0x7FFFFFu) >> (23 - FX::mant));
    const int32_t near = lg8[top] + (e_unb - FX::mant) * SPK_SIGMA_ONE < L + SPK_NEAR_TOP_Q8;
    const int32_t k_s = (L >> SPK_SIGMA_FRAC_BITS) - SPK_GRID_BELOW_SIGMA;  // NOTE: >> floors negatives
    k = imax(FX::k_min, imin(imax(k_s, e_unb - FX::mant + near), FX::k_max));
    const int32_t nb_mu = imin(k - (e_unb - FX::mant), 24);
    const float half = f32_of((uint32_t)sel(nb_mu >= 0, (126 - nb_mu) << 23, 0));
    // NOTE: g and v are >= 0 (or NaN), whose order is their bit patterns' order: integer
    // compares and selects, which vectorise where float ones (which may trap) do not
    const int32_t top_bin = (int32_t)u32_of((float)SPK_MAX_BIN);
    const int32_t gb = (int32_t)u32_of(f32_of(mu & 0x7FFFFFFFu) * f32_of((uint32_t)(127 - k) << 23));  // exact
    const float g = f32_of((uint32_t)sel(gb > 0x7F800000, 0, imin(gb, top_bin)));  // NaN -> 0; clamp
    const int32_t vb = (int32_t)u32_of(g + half);
    const float v = f32_of((uint32_t)imin(vb, top_bin));
    const int32_t mag = (int32_t)v;  // floor: v in [0, MAX_BIN]
    const int32_t frac = (int32_t)((v - (float)mag) * (float)SPK_OFFSETS);
    c_mu = mag ^ -neg;
    t = table_row(L - k * SPK_SIGMA_ONE, frac ^ ((SPK_OFFSETS - 1) & -neg));
    mu_ok = e_mu != 0xFF;
}

// The element types of a format's x and mu' (BF16: u16, u16; FP8: u8 codes, u32 fp32 bits).
template <class FX> struct Io {
    typedef uint16_t X;
    typedef uint16_t Mu;
};
template <> struct Io<SpkE4M3> {
    typedef uint8_t X;
    typedef uint32_t Mu;
};

template <class FX>
SPK_INLINE void context_of_fx(uint32_t mu, int32_t L, const int32_t* __restrict lg8, int32_t& k, int32_t& t,
                              int32_t& c_mu, int32_t& mu_ok) {
    if (FX::fp8) context_fp8(mu, L, lg8, k, t, c_mu, mu_ok);
    else context_bf16((int32_t)mu, L, lg8, k, t, c_mu, mu_ok);
}

template <class FX> SPK_INLINE int32_t finite_fx(int32_t x) {
    if (FX::fp8) return (x & 0x7F) != 0x7F;
    return ((x >> FX::mant) & (int32_t)FX::exp_mask) != (int32_t)FX::exp_mask;
}

// spk_bin<FX> in integers: |x| 2^-k floored and clamped to MAX_BIN (NaN: 0), signed
// NOTE: the float path's product is exact or underflows below 1, so both floor alike
template <class FX>
SPK_INLINE int32_t bin_fx(int32_t x, int32_t k, int32_t& mag) {
    const int32_t e_x = (x >> FX::mant) & (int32_t)FX::exp_mask, m = x & (int32_t)FX::mant_mask;
    const int32_t sx = m | sel(e_x != 0, 1 << FX::mant, 0);
    const int32_t sh = imax(e_x, 1) - FX::bias - FX::mant - k;  // |x| = sx 2^(max(e, 1) - bias - mant)
    mag = sel(sh >= 0, imin(sx << imin(imax(sh, 0), 12), SPK_MAX_BIN), sx >> imin(imax(-sh, 0), 31));
    if (FX::fp8) mag = sel((x & 0x7F) == 0x7F, 0, mag);  // e4m3fn's NaN
    else mag = sel(e_x == (int32_t)FX::exp_mask, sel(m != 0, 0, SPK_MAX_BIN), mag);  // NaN: 0; inf: the last bin
    return mag ^ -(x >> (FX::bits - 1));
}

// LOW width of a NORMAL bin: max(mant - floor(log2 mag), 0) by comparisons (no clz in AVX2)
template <class FX>
SPK_INLINE int32_t low_width(int32_t mag) {
    int32_t w = 0;
    for (int i = 1; i <= FX::mant; ++i) w += mag < (1 << i);
    return w;
}

// Encoder stage A of n elements: each one's rANS op and bit descriptor.
template <class FX>
SPK_INLINE void symbols_body(const typename Io<FX>::X* __restrict xs, const typename Io<FX>::Mu* __restrict mus,
                             const int32_t* __restrict lev, int64_t n, const SimdTables& T,
                             uint32_t* __restrict ops, uint32_t* __restrict desc) {
    const uint32_t* __restrict op = T.op;
    const int32_t* __restrict toff = T.off;
    const int32_t* __restrict trad = T.radius;
    const int32_t* __restrict lg8 = T.log2q8;
#pragma GCC ivdep  // NOTE: the outputs never alias the tables (restrict is lost through inlining)
    for (int64_t e = 0; e < n; ++e) {
        const int32_t x = xs[e];
        int32_t k, t, c_mu, mu_ok, mag;
        context_of_fx<FX>(mus[e], lev[e], lg8, k, t, c_mu, mu_ok);
        const int32_t d = bin_fx<FX>(x, k, mag) - c_mu, R = trad[t];
        const int32_t esc = !finite_fx<FX>(x) | !mu_ok | (d > R) | (d < -R) | (mag >= SPK_MAX_BIN);
        const int32_t kind = sel(esc, SPK_KIND_ESC, sel(mag == 0, SPK_KIND_ZERO, SPK_KIND_NORMAL));
        const int32_t width = sel(esc, FX::bits, sel(mag == 0, FX::mant, low_width<FX>(mag)));
        ops[e] = op[toff[t] + sel(esc, 2 * R + 1, d + R)];
        desc[e] = pack_desc((uint32_t)(x & ((1 << width) - 1)), (uint32_t)width, (uint32_t)kind, k);
    }
}

// Decoder stage 0: the packed contexts (spk_pack_context) of n elements.
template <class FX>
SPK_INLINE void contexts_body(const typename Io<FX>::Mu* __restrict mus, const int32_t* __restrict lev, int64_t n,
                              const int32_t* __restrict lg8, uint32_t* __restrict out) {
#pragma GCC ivdep
    for (int64_t e = 0; e < n; ++e) {
        int32_t k, t, c_mu, mu_ok;
        context_of_fx<FX>(mus[e], lev[e], lg8, k, t, c_mu, mu_ok);
        out[e] = (uint32_t)t | (uint32_t)(k + 128) << 10 | (uint32_t)(c_mu + 4096) << 18 | (uint32_t)mu_ok << 31;
    }
}

// Decoder stage 2: each element's packed info (pack_info) from its symbol j and packed
// context, as spk_classify does, and the block's tallies (uint32: a block holds at most
// 2^21 elements, each adding at most 254 to a tally). The vector path also packs the width
// of the element's raw field (LOW, ZMAN or the whole pattern) above pack_info's bits, for
// stage C, which then reads kind and width from info alone.
// NOTE: only this path's info carries the width: stage C's vector path runs only after it (J.simd).
constexpr int INFO_WIDTH_SHIFT = 25;  // bits 25-29: a width of 0-16 bits
struct Tallies32 {
    uint32_t low_bits = 0, n_zero = 0, n_esc = 0, unary_bound = 0, mu_bad = 0;
};

template <class FX>
SPK_INLINE void classify_body(const uint32_t* __restrict js, const uint32_t* __restrict ctx, int64_t n,
                              const int32_t* __restrict trad, uint32_t* __restrict info, Tallies32& tl) {
    uint32_t low_bits = 0, n_zero = 0, n_esc = 0, unary_bound = 0, mu_bad = 0;
#pragma GCC ivdep
    for (int64_t e = 0; e < n; ++e) {
        const uint32_t p = ctx[e];
        const int32_t t = (int32_t)(p & 0x3FFu), k = (int32_t)((p >> 10) & 0xFFu) - 128;
        const int32_t c_mu = (int32_t)((p >> 18) & 0x1FFFu) - 4096, mu_ok = (int32_t)(p >> 31);
        const int32_t j = (int32_t)js[e], R = trad[t];
        const int32_t c = c_mu + j - R, mag = c ^ (c >> 31);
        const int32_t esc = j == 2 * R + 1, zero = !esc & (mag == 0), normal = !esc & (mag != 0);
        const int32_t kind = sel(esc, SPK_KIND_ESC, sel(zero, SPK_KIND_ZERO, SPK_KIND_NORMAL));
        const int32_t lw = low_width<FX>(mag), w = sel(esc, FX::bits, sel(zero, FX::mant, lw));
        info[e] = (uint32_t)(c + 8192) | (uint32_t)(k + 128) << 14 | (uint32_t)kind << 22 | (uint32_t)!mu_ok << 24 |
                  (uint32_t)w << INFO_WIDTH_SHIFT;
        low_bits += (uint32_t)(normal * lw);
        n_zero += (uint32_t)zero, n_esc += (uint32_t)esc;
        unary_bound += (uint32_t)(zero * (k + FX::bias));
        mu_bad += (uint32_t)(!mu_ok & !esc);
    }
    tl.low_bits = low_bits, tl.n_zero = n_zero, tl.n_esc = n_esc, tl.unary_bound = unary_bound, tl.mu_bad = mu_bad;
}

// One ISA's entry points of the encoder's and the decoder's per-block stages.
#define SPK_BLOCK_STAGES(ISA, ATTR)                                                                                  \
    template <class FX>                                                                                               \
    ATTR void classify_##ISA(const uint32_t* js, const uint32_t* ctx, int64_t n, const int32_t* trad, uint32_t* info, \
                             Tallies32& tl) {                                                                         \
        classify_body<FX>(js, ctx, n, trad, info, tl);                                                                \
    }                                                                                                                 \
    template <class FX>                                                                                               \
    ATTR void symbols_##ISA(const void* xs, const void* mus, const int32_t* lev, int64_t n, const SimdTables& T,      \
                            uint32_t* ops, uint32_t* desc) {                                                          \
        symbols_body<FX>(static_cast<const typename Io<FX>::X*>(xs), static_cast<const typename Io<FX>::Mu*>(mus),   \
                         lev, n, T, ops, desc);                                                                       \
    }                                                                                                                 \
    template <class FX>                                                                                               \
    ATTR void contexts_##ISA(const void* mus, const int32_t* lev, int64_t n, const int32_t* lg8, uint32_t* out) {     \
        contexts_body<FX>(static_cast<const typename Io<FX>::Mu*>(mus), lev, n, lg8, out);                            \
    }
SPK_BLOCK_STAGES(avx2, SPK_AVX2)
SPK_BLOCK_STAGES(avx512, SPK_AVX512)

template <class FX>
void classify_vec(const SimdTables& T, const uint32_t* js, const uint32_t* ctx, int64_t n, const int32_t* trad,
                  uint32_t* info, Tallies32& tl) {
    if (T.wide) classify_avx512<FX>(js, ctx, n, trad, info, tl);
    else classify_avx2<FX>(js, ctx, n, trad, info, tl);
}

template <class FX>
void symbols_vec(const void* xs, const void* mus, const int32_t* lev, int64_t n, const SimdTables& T, uint32_t* ops,
                 uint32_t* desc) {
    if (T.wide) symbols_avx512<FX>(xs, mus, lev, n, T, ops, desc);
    else symbols_avx2<FX>(xs, mus, lev, n, T, ops, desc);
}

template <class FX>
void contexts_vec(const SimdTables& T, const void* mus, const int32_t* lev, int64_t n, uint32_t* out) {
    if (T.wide) contexts_avx512<FX>(mus, lev, n, T.log2q8, out);
    else contexts_avx2<FX>(mus, lev, n, T.log2q8, out);
}

// -- decoder stage C: bit patterns from bins and raw fields (decode_block_values) ---------
// Each element's raw field width and kind come from info (classify_body packed them). C2
// (scalar scan): where its field starts in its section; C3 (vector): the fields read
// (gathers) and the values composed as spk_normal_value / spk_zero_value do, with their checks.
// NOTE: bit positions are uint32 here: the caller takes this path only for chunks whose
// bit sections hold fewer than 2^31 bits.
template <class FX> SPK_INLINE int32_t flog2_bin(int32_t m) {  // floor(log2 m), 1 <= m <= MAX_BIN
    int32_t f = 0;
    for (int i = 1; i < 12; ++i) f += m >= (1 << i);
    return f;
}

template <class FX>
SPK_INLINE void compose_body(const uint32_t* __restrict info, const uint32_t* __restrict pos,
                             const uint32_t* __restrict zi, int64_t n, const uint8_t* __restrict buf,
                             const uint32_t* __restrict deltas, typename Io<FX>::X* __restrict out,
                             uint32_t& normal_bad, uint32_t& zero_bad) {
    uint32_t nbad = 0, zbad = 0;
#pragma GCC ivdep
    for (int64_t e = 0; e < n; ++e) {
        const int32_t kind = (int32_t)(info[e] >> 22 & 3u), w = (int32_t)(info[e] >> INFO_WIDTH_SHIFT & 31u);
        uint32_t raw;
        std::memcpy(&raw, buf + (pos[e] >> 3), 4);  // NOTE: MSB first: a big-endian load (read_bits)
        raw = __builtin_bswap32(raw) << (pos[e] & 7u);
        raw = (uint32_t)sel(w != 0, (int32_t)(raw >> ((32 - w) & 31)), 0);
        const uint32_t in = info[e];
        const int32_t c = (int32_t)(in & 0x3FFFu) - 8192, k = (int32_t)(in >> 14 & 0xFFu) - 128;
        const int32_t mag = c ^ (c >> 31), sign = (int32_t)((uint32_t)(c < 0) << (FX::bits - 1));
        // NORMAL (spk_normal_value)
        const int32_t f = flog2_bin<FX>(imin(mag, SPK_MAX_BIN)), nb = FX::mant - f;
        const int32_t ex = k + f + FX::bias, down = imin(imax(-nb, 0), 30);
        const int32_t sig = sel(nb >= 0, (mag << imax(nb, 0)) | (int32_t)raw, mag >> down);
        int32_t bad_n = (ex < 1) | (ex > FX::max_field) | (mag >= SPK_MAX_BIN) | ((mag & ((1 << down) - 1)) != 0);
        if (FX::fp8) bad_n |= (ex == FX::max_field) & ((sig & 7) == 7);  // e4m3fn's NaN
        const int32_t v_n = sign | (imax(imin(ex, 255), 0) << FX::mant) | (sig & (int32_t)FX::mant_mask);
        // ZERO (spk_zero_value)
        const uint32_t delta = deltas[zi[e]];
        const int32_t dl = (int32_t)(delta > (1u << 20) ? (1u << 20) : delta);
        const int32_t ez = k + FX::bias - 1 - dl;
        const int32_t v_z = sign | (imax(ez, 0) << FX::mant) | (int32_t)raw;
        const int32_t normal = kind == SPK_KIND_NORMAL, zero = kind == SPK_KIND_ZERO;
        nbad |= (uint32_t)(normal & bad_n), zbad |= (uint32_t)(zero & (ez < 0));
        out[e] = (typename Io<FX>::X)sel(normal, v_n, sel(zero, v_z, (int32_t)raw));
    }
    normal_bad = nbad, zero_bad = zbad;
}

#define SPK_VALUE_STAGES(ISA, ATTR)                                                                                    \
    template <class FX>                                                                                                \
    ATTR void compose_##ISA(const uint32_t* info, const uint32_t* pos, const uint32_t* zi, int64_t n,                \
                            const uint8_t* buf, const uint32_t* deltas, void* out, uint32_t& normal_bad,               \
                            uint32_t& zero_bad) {                                                                      \
        compose_body<FX>(info, pos, zi, n, buf, deltas, static_cast<typename Io<FX>::X*>(out), normal_bad,            \
                         zero_bad);                                                                                    \
    }
SPK_VALUE_STAGES(avx2, SPK_AVX2)
SPK_VALUE_STAGES(avx512, SPK_AVX512)

template <class FX>
void compose_vec(const SimdTables& T, const uint32_t* info, const uint32_t* pos, const uint32_t* zi, int64_t n,
                 const uint8_t* buf, const uint32_t* deltas, void* out, uint32_t& normal_bad, uint32_t& zero_bad) {
    if (T.wide) compose_avx512<FX>(info, pos, zi, n, buf, deltas, out, normal_bad, zero_bad);
    else compose_avx2<FX>(info, pos, zi, n, buf, deltas, out, normal_bad, zero_bad);
}

// -- mu correction (spk_affine_bf16, spk_fp8_mu) over a row of tokens -------------------

// mu' = bf16(a mu + b) of dim channels: spk_affine_bf16 branch-free (one fp32 multiply,
// then one add: -ffp-contract=off keeps them apart in vector code as in scalar code)
SPK_INLINE void affine_bf16_body(const uint16_t* __restrict mu, const float* __restrict a, const float* __restrict b,
                                 int64_t dim, uint16_t* __restrict out) {
    for (int64_t d = 0; d < dim; ++d) {
        const uint32_t m = mu[d];
        const uint32_t u = u32_of(f32_of(m << 16) * a[d] + b[d]);
        const uint32_t r = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) & 0xFFFFu;
        out[d] = (uint16_t)(a[d] == 1.0f && b[d] == 0.0f ? m : r);
    }
}

// FP8 KV: mu' / scale in fp32 (one correctly rounded division each), as bits
SPK_INLINE void fp8_mu_body(const uint16_t* __restrict mu, float scale, int64_t n, uint32_t* __restrict out) {
    for (int64_t e = 0; e < n; ++e) out[e] = u32_of(f32_of((uint32_t)mu[e] << 16) / scale);
}

SPK_AVX2 inline void affine_bf16_avx2(const uint16_t* mu, const float* a, const float* b, int64_t dim, uint16_t* out) {
    affine_bf16_body(mu, a, b, dim, out);
}

SPK_AVX2 inline void fp8_mu_avx2(const uint16_t* mu, float scale, int64_t n, uint32_t* out) {
    fp8_mu_body(mu, scale, n, out);
}

SPK_AVX512 inline void affine_bf16_avx512(const uint16_t* mu, const float* a, const float* b, int64_t dim,
                                          uint16_t* out) {
    affine_bf16_body(mu, a, b, dim, out);
}

SPK_AVX512 inline void fp8_mu_avx512(const uint16_t* mu, float scale, int64_t n, uint32_t* out) {
    fp8_mu_body(mu, scale, n, out);
}

// Whether this CPU runs the AVX2 stages (checked once; SPECKV's tests force either path).
inline bool cpu_has_avx2() {
#if SPK_HAVE_AVX2_BUILD
    static const bool yes = __builtin_cpu_supports("avx2");
    return yes;
#else
    return false;
#endif
}

// Whether it also runs their AVX-512 builds (SPK_AVX512's extensions).
inline bool cpu_has_avx512() {
#if SPK_HAVE_AVX2_BUILD
    static const bool yes = cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    return yes;
#else
    return false;
#endif
}

}  // namespace spk
