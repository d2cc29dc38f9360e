// Python binding of the FP8 cache's AMX products (spk_fp8_amx.h), included by spk_native.cpp; the
// softmax between them is speckv/predictor/amx_fp8.py's.
#pragma once
#include <vector>

#include "spk_fp8_amx.h"
#include "spk_py.h"

namespace {

bool fp8_amx_args(long long H, long long Hk, long long T, long long U) {
    if (H <= 0 || Hk <= 0 || H % Hk != 0 || T <= 0 || U <= 0) {
        PyErr_SetString(PyExc_ValueError, "fp8_amx: heads must be a positive multiple of kv heads, T and U > 0");
        return false;
    }
    if (!spk::amx_bf16_ready()) {
        PyErr_SetString(PyExc_RuntimeError, "fp8_amx: this CPU (or kernel) gives no AMX BF16 tiles");
        return false;
    }
    return true;
}

// fp8_amx_ready(): whether this process can run the products (AMX BF16 tiles granted)
PyObject* py_fp8_amx_ready(PyObject*, PyObject*) { return PyBool_FromLong(spk::amx_bf16_ready()); }

// fp8_amx_scores(q BF16 (H, T, 64), k e4m3 codes (Hk, U, 64), out fp32 (H, T, U16), H, Hk, T, U, threads):
// unscaled scores, U16 = U rounded up to 16 (spk_fp8_amx.h)
PyObject* py_fp8_amx_scores(PyObject*, PyObject* args) {
    PyObject *q_o, *k_o, *out_o;
    long long H, Hk, T, U;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOLLLLi", &q_o, &k_o, &out_o, &H, &Hk, &T, &U, &threads) ||
        !fp8_amx_args(H, Hk, T, U))
        return nullptr;
    constexpr int64_t D = spk::FP8_AMX_D;
    const int64_t U16 = (U + 15) / 16 * 16, passes = (T + spk::FP8_AMX_ROWS - 1) / spk::FP8_AMX_ROWS;
    Buf q, k, out;
    if (!get_buf(q_o, q, H * T * D * 2, "q") || !get_buf(k_o, k, Hk * U * D, "k") ||
        !get_buf(out_o, out, H * T * U16 * 4, "out", true))
        return nullptr;
    std::vector<uint16_t> kp((size_t)(Hk * U16 * 2 * 16 * 2));
    Py_BEGIN_ALLOW_THREADS
    parallel_for(Hk, threads, [&](int64_t h) {
        spk::fp8_amx_pack_k(k.as<uint8_t>() + h * U * D, U, U16, kp.data() + h * U16 * 64);
    });
    parallel_for(H * passes, threads, [&](int64_t task) {
        const int64_t h = task / passes, r0 = task % passes * spk::FP8_AMX_ROWS;
        const int rows = (int)std::min<int64_t>(spk::FP8_AMX_ROWS, T - r0);
        spk::fp8_amx_scores(q.as<uint16_t>() + h * T * D, kp.data() + h / (H / Hk) * U16 * 64, U16, r0, rows,
                            out.as<float>() + h * T * U16);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// fp8_amx_pv(p BF16 (H, T, U32), v e4m3 codes (Hk, U, 64), out fp32 (H, T, 64), H, Hk, T, U, threads):
// unscaled P @ V, U32 = U rounded up to 32 (p zero past each row's keys)
PyObject* py_fp8_amx_pv(PyObject*, PyObject* args) {
    PyObject *p_o, *v_o, *out_o;
    long long H, Hk, T, U;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOLLLLi", &p_o, &v_o, &out_o, &H, &Hk, &T, &U, &threads) ||
        !fp8_amx_args(H, Hk, T, U))
        return nullptr;
    constexpr int64_t D = spk::FP8_AMX_D;
    const int64_t U32 = (U + 31) / 32 * 32, passes = (T + spk::FP8_AMX_ROWS - 1) / spk::FP8_AMX_ROWS;
    Buf p, v, out;
    if (!get_buf(p_o, p, H * T * U32 * 2, "p") || !get_buf(v_o, v, Hk * U * D, "v") ||
        !get_buf(out_o, out, H * T * D * 4, "out", true))
        return nullptr;
    std::vector<uint16_t> vp((size_t)(Hk * U32 * D));
    Py_BEGIN_ALLOW_THREADS
    parallel_for(Hk, threads, [&](int64_t h) {
        spk::fp8_amx_pack_v(v.as<uint8_t>() + h * U * D, U, U32, vp.data() + h * U32 * D);
    });
    parallel_for(H * passes, threads, [&](int64_t task) {
        const int64_t h = task / passes, r0 = task % passes * spk::FP8_AMX_ROWS;
        const int rows = (int)std::min<int64_t>(spk::FP8_AMX_ROWS, T - r0);
        spk::fp8_amx_pv(p.as<uint16_t>() + h * T * U32, vp.data() + h / (H / Hk) * U32 * D, U32, r0, rows,
                        out.as<float>() + h * T * D);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

}  // namespace

namespace {

// fp8_amx_attention(q BF16 (H, T, 64), k codes (Hk, U, 64), v codes (Hk, U, 64), out BF16 (T, H, 64), H, Hk,
// T, U, s, bias, threads): causal attention as vLLM's amx kernel computes it over an FP8 cache
// (spk_fp8_amx.h fp8_amx_rows; s and bias as folded there)
PyObject* py_fp8_amx_attention(PyObject*, PyObject* args) {
    PyObject *q_o, *k_o, *v_o, *out_o;
    long long H, Hk, T, U;
    float s, bias;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOLLLLffi", &q_o, &k_o, &v_o, &out_o, &H, &Hk, &T, &U, &s, &bias, &threads) ||
        !fp8_amx_args(H, Hk, T, U))
        return nullptr;
    if (U < T) {
        PyErr_SetString(PyExc_ValueError, "fp8_amx_attention: the queries are the last T of U >= T positions");
        return nullptr;
    }
    constexpr int64_t D = spk::FP8_AMX_D;
    const int64_t U16 = (U + 15) / 16 * 16, U32 = (U + 31) / 32 * 32;
    const int64_t passes = (T + spk::FP8_AMX_ROWS - 1) / spk::FP8_AMX_ROWS;
    Buf q, k, v, out;
    if (!get_buf(q_o, q, H * T * D * 2, "q") || !get_buf(k_o, k, Hk * U * D, "k") || !get_buf(v_o, v, Hk * U * D, "v") ||
        !get_buf(out_o, out, T * H * D * 2, "out", true))
        return nullptr;
    std::vector<uint16_t> kp((size_t)(Hk * U16 * D)), vp((size_t)(Hk * U32 * D));
    Py_BEGIN_ALLOW_THREADS
    parallel_for(2 * Hk, threads, [&](int64_t t) {
        const int64_t h = t / 2;
        if (t % 2 == 0) spk::fp8_amx_pack_k(k.as<uint8_t>() + h * U * D, U, U16, kp.data() + h * U16 * D);
        else spk::fp8_amx_pack_v(v.as<uint8_t>() + h * U * D, U, U32, vp.data() + h * U32 * D);
    });
    parallel_for(H * passes, threads, [&](int64_t task) {  // NOTE: later passes (more keys) first
        const int64_t h = task % H, r0 = (passes - 1 - task / H) * spk::FP8_AMX_ROWS;
        const int rows = (int)std::min<int64_t>(spk::FP8_AMX_ROWS, T - r0);
        const int64_t kv = h / (H / Hk);
        spk::fp8_amx_rows(q.as<uint16_t>() + h * T * D, kp.data() + kv * U16 * D, vp.data() + kv * U32 * D, T, U, s,
                          bias, r0, rows, out.as<uint16_t>() + h * D, H * D);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

}  // namespace
