// Python binding of the int8 attention (spk_attn.h), included by spk_native.cpp; the torch reference
// it must equal bit for bit is speckv/predictor/int8_attention.py.
#pragma once
#include "spk_attn.h"
#include "spk_attn_amx.h"
#include "spk_attn_avx2.h"
#include "spk_py.h"
#include "spk_w8a8_py.h"  // w8a8_avx2, w8a8_quantise_row_on: the W8A8 row quantisation's paths

namespace {

bool attn_vnni(int scalar, int64_t D) {
    static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return yes && !scalar && D % 16 == 0 && D <= spk::ATT_VNNI_MAX_D;
}

// Each row of x (rows, D) BF16 bits -> q8 int8 and its scale (the W8A8 row quantisation, unit factors:
// its AVX-512, AVX2 and scalar rows give the same bits).
void quantise_rows(const uint16_t* x, int64_t rows, int64_t D, int8_t* q, float* s, int scalar) {
    const std::vector<float> one((size_t)D, 1.0f);
    const int path = w8a8_quantise_path(scalar, 0);
    for (int64_t r = 0; r < rows; ++r)
        s[r] = w8a8_quantise_row_on(path, x + r * D, one.data(), D, q + r * D) / spk::W8A8_QMAX;
}

enum { ATT_PATH_LOOPS = 0, ATT_PATH_VNNI = 1, ATT_PATH_AMX = 2 };  // LOOPS: AVX2 or scalar

// int8_attention(q BF16 (H, T, D), k BF16 (Hk, T, D), v BF16 (Hk, T, D), out BF16 (T, H, D), H, Hk, T, D,
//                threads[, scalar[, no_amx]]); returns the path that ran (ATT_PATH_*): AMX where the CPU
// has it and D == ATT_AMX_D, else VNNI, else the AVX2 or scalar loops (scalar: the scalar loops)
PyObject* py_int8_attention(PyObject*, PyObject* args) {
    PyObject *q_o, *k_o, *v_o, *out_o;
    long long H, Hk, T, D;
    int threads, scalar = 0, no_amx = 0;
    if (!PyArg_ParseTuple(args, "OOOOLLLLi|pp", &q_o, &k_o, &v_o, &out_o, &H, &Hk, &T, &D, &threads, &scalar,
                          &no_amx))
        return nullptr;
    if (H <= 0 || Hk <= 0 || H % Hk != 0 || T <= 0 || D <= 0) {
        PyErr_SetString(PyExc_ValueError, "int8_attention: heads must be a positive multiple of kv heads, T and D > 0");
        return nullptr;
    }
    Buf q, k, v, out;
    if (!get_buf(q_o, q, H * T * D * 2, "q") || !get_buf(k_o, k, Hk * T * D * 2, "k") ||
        !get_buf(v_o, v, Hk * T * D * 2, "v") || !get_buf(out_o, out, T * H * D * 2, "out", true))
        return nullptr;
    const bool vnni = attn_vnni(scalar, D);
    const bool amx = vnni && !no_amx && D == spk::ATT_AMX_D && spk::amx_int8_ready();
    static_assert(spk::ATT_ROWS % spk::ATT_AMX_ROWS == 0, "a task's rows fill whole AMX passes");
    const bool avx2 = !vnni && w8a8_avx2(scalar) && D % 16 == 0 && D <= spk::ATT_AVX2_MAX_D;
    const int64_t T16 = spk::pad_to(T, 16), T64 = spk::pad_to(T, spk::ATT_KEY_BLOCK);
    std::vector<int8_t> q8(H * T * D), k8(Hk * T * D), v8(Hk * T * D);
    std::vector<float> qs(H * T), ks(Hk * T16, 0.0f), vs(Hk * T64, 0.0f);
    std::vector<uint8_t> qu(vnni ? H * T * D : 0);
    std::vector<int8_t> k4(vnni ? Hk * T16 * D : 0, 0), v4(vnni ? Hk * T64 * D : 0, 0);
    std::vector<int32_t> ksum(vnni ? Hk * T16 : 0, 0);
    const float rsd = (float)(spk::ATT_LOG2E / std::sqrt((double)D));
    const int64_t G = H / Hk, tiles = (T + spk::ATT_ROWS - 1) / spk::ATT_ROWS;
    Py_BEGIN_ALLOW_THREADS
    parallel_for(H + Hk, threads, [&](int64_t h) {  // quantise: the query heads, then the kv heads
        if (h < H) {
            quantise_rows(q.as<uint16_t>() + h * T * D, T, D, q8.data() + h * T * D, qs.data() + h * T, scalar);
            if (vnni) for (int64_t n = h * T * D; n < (h + 1) * T * D; ++n) qu[n] = (uint8_t)(q8[n] + 128);
            return;
        }
        const int64_t g = h - H;
        int8_t *kq = k8.data() + g * T * D, *vq = v8.data() + g * T * D;
        quantise_rows(k.as<uint16_t>() + g * T * D, T, D, kq, ks.data() + g * T16, scalar);
        quantise_rows(v.as<uint16_t>() + g * T * D, T, D, vq, vs.data() + g * T64, scalar);
        if (vnni) spk::attn_pack_kv(kq, vq, T, D, k4.data() + g * T16 * D, ksum.data() + g * T16, v4.data() + g * T64 * D);
    });
    parallel_for(H * tiles, threads, [&](int64_t task) {
        // NOTE: the last rows first (causal: they cost the most), so the threads finish together
        const int64_t h = task % H, g = h / G, i0 = (tiles - 1 - task / H) * spk::ATT_ROWS;
        const int64_t i1 = std::min<int64_t>(i0 + spk::ATT_ROWS, T);
        uint16_t* o = out.as<uint16_t>() + h * D;
        if (vnni) {
            const spk::AttnPacked p{qu.data() + h * T * D, k4.data() + g * T16 * D, ksum.data() + g * T16,
                                    ks.data() + g * T16, v4.data() + g * T64 * D, vs.data() + g * T64};
            if (amx) spk::attn_rows_amx(p, qs.data() + h * T, rsd, i0, i1, o, H * D);
            else spk::attn_rows_vnni(p, qs.data() + h * T, D, rsd, i0, i1, o, H * D);
        } else {
            const spk::AttnHead a{q8.data() + h * T * D, qs.data() + h * T, k8.data() + g * T * D,
                                  ks.data() + g * T16, v8.data() + g * T * D, vs.data() + g * T64};
            if (avx2) spk::attn_rows_avx2(a, D, rsd, i0, i1, o, H * D);
            else spk::attn_rows(a, D, rsd, i0, i1, o, H * D);
        }
    });
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(amx ? ATT_PATH_AMX : vnni ? ATT_PATH_VNNI : ATT_PATH_LOOPS);
}

}  // namespace
