// Python binding of the FP8 cache's AMX replay (spk_fp8_amx.h), included by spk_native.cpp:
// the one-call attention, and its two products alone (the reference with torch's softmax between
// them, speckv/predictor/amx_fp8.py).
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

// fn(h, r0, rows) for every head h and pass of up to FP8_AMX_ROWS query rows from r0, on up to
// `threads` threads; the passes with the most keys (the last rows) first.
template <class F>
void fp8_amx_passes(int64_t H, int64_t T, int threads, const F& fn) {
    const int64_t passes = (T + spk::FP8_AMX_ROWS - 1) / spk::FP8_AMX_ROWS;
    parallel_for(H * passes, threads, [&](int64_t task) {
        const int64_t r0 = (passes - 1 - task / H) * spk::FP8_AMX_ROWS;
        fn(task % H, r0, (int)std::min<int64_t>(spk::FP8_AMX_ROWS, T - r0));
    });
}

// One product's call (a, codes (Hk, U, 64), out, H, Hk, T, U, threads), parsed and checked; the
// codes packed as the tiles take them (pack: fp8_amx_pack_k or _v, `width` keys rounded up).
struct Fp8AmxProduct {
    long long H = 0, Hk = 0, T = 0, U = 0;
    int threads = 1;
    int64_t width = 0;
    Buf a, codes, out;
    std::vector<uint16_t> packed;

    bool parse(PyObject* args, int64_t align, int64_t a_row, int64_t out_row) {
        PyObject *a_o, *c_o, *out_o;
        if (!PyArg_ParseTuple(args, "OOOLLLLi", &a_o, &c_o, &out_o, &H, &Hk, &T, &U, &threads) ||
            !fp8_amx_args(H, Hk, T, U))
            return false;
        width = (U + align - 1) / align * align;
        constexpr int64_t D = spk::FP8_AMX_D;
        return get_buf(a_o, a, H * T * (a_row ? a_row : width) * 2, "a") && get_buf(c_o, codes, Hk * U * D, "codes") &&
               get_buf(out_o, out, H * T * (out_row ? out_row : width) * 4, "out", true);
    }
    template <class Pack>
    void pack(const Pack& fn) {  // NOTE: without the GIL
        constexpr int64_t D = spk::FP8_AMX_D;
        packed.resize((size_t)(Hk * width * D));
        parallel_for(Hk, threads, [&](int64_t h) {
            fn(codes.as<uint8_t>() + h * U * D, U, width, packed.data() + h * width * D);
        });
    }
    const uint16_t* head(int64_t h) const { return packed.data() + h / (H / Hk) * width * spk::FP8_AMX_D; }
};

// fp8_amx_ready(): whether this process can run the products (AMX BF16 tiles granted)
PyObject* py_fp8_amx_ready(PyObject*, PyObject*) { return PyBool_FromLong(spk::amx_bf16_ready()); }

// fp8_amx_scores(q BF16 (H, T, 64), k e4m3 codes (Hk, U, 64), out fp32 (H, T, U16), H, Hk, T, U, threads):
// unscaled scores, U16 = U rounded up to 16
PyObject* py_fp8_amx_scores(PyObject*, PyObject* args) {
    Fp8AmxProduct c;
    if (!c.parse(args, 16, spk::FP8_AMX_D, 0)) return nullptr;
    Py_BEGIN_ALLOW_THREADS
    c.pack(spk::fp8_amx_pack_k);
    fp8_amx_passes(c.H, c.T, c.threads, [&](int64_t h, int64_t r0, int rows) {
        spk::fp8_amx_scores(c.a.as<uint16_t>() + h * c.T * spk::FP8_AMX_D, c.head(h), c.width, r0, rows,
                            c.out.as<float>() + h * c.T * c.width);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// fp8_amx_pv(p BF16 (H, T, U32), v e4m3 codes (Hk, U, 64), out fp32 (H, T, 64), H, Hk, T, U, threads):
// unscaled P @ V, U32 = U rounded up to 32 (p zero past each row's keys)
PyObject* py_fp8_amx_pv(PyObject*, PyObject* args) {
    Fp8AmxProduct c;
    if (!c.parse(args, 32, 0, spk::FP8_AMX_D)) return nullptr;
    Py_BEGIN_ALLOW_THREADS
    c.pack(spk::fp8_amx_pack_v);
    fp8_amx_passes(c.H, c.T, c.threads, [&](int64_t h, int64_t r0, int rows) {
        spk::fp8_amx_pv(c.a.as<uint16_t>() + h * c.T * c.width, c.head(h), c.width, r0, rows,
                        c.out.as<float>() + h * c.T * spk::FP8_AMX_D);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

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
    fp8_amx_passes(H, T, threads, [&](int64_t h, int64_t r0, int rows) {
        const int64_t kv = h / (H / Hk);
        spk::fp8_amx_rows(q.as<uint16_t>() + h * T * D, kp.data() + kv * U16 * D, vp.data() + kv * U32 * D, T, U, s,
                          bias, r0, rows, out.as<uint16_t>() + h * D, H * D);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

}  // namespace
