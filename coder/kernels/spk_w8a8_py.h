// Python bindings of the W8A8 predictor's native stages (spk_w8a8.h), included by spk_native.cpp;
// speckv/predictor/w8a8.py calls them and holds the torch reference each must equal bit for bit.
#pragma once
#include "spk_py.h"
#include "spk_igemm.h"
#include "spk_silu.h"
#include "spk_w8a8.h"

namespace {

bool w8a8_avx2(int scalar) {
    static const bool yes = __builtin_cpu_supports("avx2");
    return yes && !scalar;
}

bool w8a8_avx512(int scalar, int no_avx512) {
    static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl");
    return yes && !scalar && !no_avx512;
}

enum { W8A8_PATH_SCALAR = 0, W8A8_PATH_AVX2 = 1, W8A8_PATH_AVX512 = 2 };

// The row quantisation's path on this CPU: the widest vector loop allowed (every path, the same bits).
int w8a8_quantise_path(int scalar, int no_avx512) {
    return w8a8_avx512(scalar, no_avx512) ? W8A8_PATH_AVX512 : w8a8_avx2(scalar) ? W8A8_PATH_AVX2 : W8A8_PATH_SCALAR;
}

// One row of the quantisation on ``path`` (w8a8_quantise_path); returns amax.
template <class X>
float w8a8_quantise_row_on(int path, const X* x, const float* f, int64_t k, int8_t* q, int8_t* lo = nullptr) {
    return path == W8A8_PATH_AVX512 ? spk::w8a8_quantise_row_avx512(x, f, k, q, lo)
         : path == W8A8_PATH_AVX2   ? spk::w8a8_quantise_row_avx2(x, f, k, q, lo)
                                    : spk::w8a8_quantise_row(x, f, k, q, lo);
}

// w8a8_quantise(x float32 or BF16 bits (rows, k), bf16, f float32 (k), q int8 (rows, k), xs float32 (rows),
//               threads[, scalar[, no_avx512[, lo int8 (rows, k) or None]]]): the AVX-512 rows, else AVX2,
//               else (scalar) the scalar loops; with ``lo``, each row's low parts too (spk_w8a8.h); returns
//               the path that ran (W8A8_PATH_*)
PyObject* py_w8a8_quantise(PyObject*, PyObject* args) {
    PyObject *x_o, *f_o, *q_o, *xs_o, *lo_o = Py_None;
    int bf16, threads, scalar = 0, no_avx512 = 0;
    if (!PyArg_ParseTuple(args, "OpOOOi|ppO", &x_o, &bf16, &f_o, &q_o, &xs_o, &threads, &scalar, &no_avx512,
                          &lo_o))
        return nullptr;
    Buf x, f, q, xs, lo;
    if (!get_buf(xs_o, xs, -1, "xs", true) || !get_buf(f_o, f, -1, "f")) return nullptr;
    const int64_t rows = xs.count(4), k = f.count(4);
    if (!get_buf(x_o, x, rows * k * (bf16 ? 2 : 4), "x") || !get_buf(q_o, q, rows * k, "q", true)) return nullptr;
    const bool low = lo_o != Py_None;
    if (low && !get_buf(lo_o, lo, rows * k, "lo", true)) return nullptr;
    const int path = w8a8_quantise_path(scalar, no_avx512);
    Py_BEGIN_ALLOW_THREADS
    parallel_for(rows, threads, [&](int64_t r) {
        int8_t *qr = q.as<int8_t>() + r * k, *lr = low ? lo.as<int8_t>() + r * k : nullptr;
        const float amax = bf16 ? w8a8_quantise_row_on(path, x.as<uint16_t>() + r * k, f.as<float>(), k, qr, lr)
                                : w8a8_quantise_row_on(path, x.as<float>() + r * k, f.as<float>(), k, qr, lr);
        xs.as<float>()[r] = amax / spk::W8A8_QMAX;
    });
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(path);
}

// w8a8_dequant(acc int32 (rows, n), xs float32 (rows), ws float32 (n), add BF16 bits (rows, n) or None,
//              out float32 or BF16 bits (rows, n), threads[, scalar])
PyObject* py_w8a8_dequant(PyObject*, PyObject* args) {
    PyObject *acc_o, *xs_o, *ws_o, *add_o, *out_o;
    int threads, scalar = 0;
    if (!PyArg_ParseTuple(args, "OOOOOi|p", &acc_o, &xs_o, &ws_o, &add_o, &out_o, &threads, &scalar)) return nullptr;
    Buf acc, xs, ws, add, out;
    if (!get_buf(xs_o, xs, -1, "xs") || !get_buf(ws_o, ws, -1, "ws")) return nullptr;
    const int64_t rows = xs.count(4), n = ws.count(4);
    const bool bf16 = add_o != Py_None;
    if (!get_buf(acc_o, acc, rows * n * 4, "acc") || (bf16 && !get_buf(add_o, add, rows * n * 2, "add")) ||
        !get_buf(out_o, out, rows * n * (bf16 ? 2 : 4), "out", true))
        return nullptr;
    const bool v = w8a8_avx2(scalar);
    Py_BEGIN_ALLOW_THREADS
    parallel_for(rows, threads, [&](int64_t r) {
        const int32_t* a = acc.as<int32_t>() + r * n;
        const uint16_t* ad = bf16 ? add.as<uint16_t>() + r * n : nullptr;
        void* o = bf16 ? (void*)(out.as<uint16_t>() + r * n) : (void*)(out.as<float>() + r * n);
        if (v) spk::w8a8_dequant_row_avx2(a, xs.as<float>()[r], ws.as<float>(), n, ad, o);
        else spk::w8a8_dequant_row(a, xs.as<float>()[r], ws.as<float>(), n, ad, o);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// w8a8_rope(y float32 (rows, width), col0, heads, D, cos BF16 bits (rows, D), sin BF16 bits (rows, D),
//           out BF16 bits (rows, heads * D), threads[, scalar]): columns [col0, col0 + heads * D) of each
//           row of y rotated (spk_w8a8.h, w8a8_rope_token). Returns the number of rows with an input or
//           output that is not finite (then the caller computes the whole call again with torch).
PyObject* py_w8a8_rope(PyObject*, PyObject* args) {
    PyObject *y_o, *cos_o, *sin_o, *out_o;
    long long col0, heads, D;
    int threads, scalar = 0;
    if (!PyArg_ParseTuple(args, "OLLLOOOi|p", &y_o, &col0, &heads, &D, &cos_o, &sin_o, &out_o, &threads, &scalar))
        return nullptr;
    Buf y, cs, sn, out;
    if (!get_buf(out_o, out, -1, "out", true) || !get_buf(y_o, y, -1, "y")) return nullptr;
    // NOTE: every product below is bounded by a buffer's length first (no overflow on absurd arguments)
    const int64_t n = out.count(2);
    const bool fit = D > 0 && D % 2 == 0 && D <= n && heads > 0 && heads <= n / D && n % (heads * D) == 0 &&
                     n > 0 && col0 >= 0;
    const int64_t width = fit ? heads * D : 1, rows = fit ? n / width : 1, ld = y.count(4) / rows;
    if (!fit || y.count(4) % rows || ld < width || col0 > ld - width) {
        PyErr_SetString(PyExc_ValueError, "w8a8_rope: shapes do not fit");
        return nullptr;
    }
    if (!get_buf(cos_o, cs, rows * D * 2, "cos") || !get_buf(sin_o, sn, rows * D * 2, "sin")) return nullptr;
    const bool v = w8a8_avx2(scalar);
    std::atomic<int64_t> bad{0};
    Py_BEGIN_ALLOW_THREADS
    parallel_for(rows, threads, [&](int64_t r) {
        const float* x = y.as<float>() + r * ld + col0;
        const uint16_t *c = cs.as<uint16_t>() + r * D, *s = sn.as<uint16_t>() + r * D;
        uint16_t* o = out.as<uint16_t>() + r * width;
        if (v ? spk::w8a8_rope_token_avx2(x, c, s, heads, D, o) : spk::w8a8_rope_token(x, c, s, heads, D, o))
            bad.fetch_add(1, std::memory_order_relaxed);
    });
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong((long long)bad.load());
}

// igemm(a int8 (m, k), b int8 (n, k), out int32 (m, n), m, n, k, threads[, scalar]): out = a @ b^T, exact
// int32 sums (spk_igemm.h); integer.py ``int_mm`` checks dtypes and the sums' range.
PyObject* py_igemm(PyObject*, PyObject* args) {
    PyObject *a_o, *b_o, *out_o;
    long long m, n, k;
    int threads, scalar = 0;
    if (!PyArg_ParseTuple(args, "OOOLLLi|p", &a_o, &b_o, &out_o, &m, &n, &k, &threads, &scalar)) return nullptr;
    if (m < 0 || n < 0 || k < 0) {
        PyErr_SetString(PyExc_ValueError, "igemm: negative shape");
        return nullptr;
    }
    Buf a, b, out;
    if (!get_buf(a_o, a, m * k, "a") || !get_buf(b_o, b, n * k, "b") || !get_buf(out_o, out, m * n * 4, "out", true))
        return nullptr;
    constexpr int64_t ROWS = 64;  // rows of a per task (a multiple of IGEMM_MR)
    const bool v = w8a8_avx2(scalar);
    const int8_t *A = a.as<int8_t>(), *B = b.as<int8_t>();
    int32_t* C = out.as<int32_t>();
    Py_BEGIN_ALLOW_THREADS
    parallel_for((m + ROWS - 1) / ROWS, threads, [&](int64_t t) {
        const int64_t i0 = t * ROWS, i1 = std::min<int64_t>(m, i0 + ROWS);
        if (v) spk::igemm_rows_avx2(A, B, C, i0, i1, n, k);
        else spk::igemm_rows(A, B, C, i0, i1, n, k);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// w8a8_silu_mul(y float32 (rows, 2n), m float32 (rows, n), n, threads[, scalar[, no_avx512]]):
// m = silu_det(y[:, :n]) * y[:, n:] (spk_silu.h); returns the path that ran (W8A8_PATH_*).
// NOTE: the AVX-512 lanes take exp2_det_v, built for AVX-512 VNNI, so that path asks for VNNI too
PyObject* py_w8a8_silu_mul(PyObject*, PyObject* args) {
    PyObject *y_o, *m_o;
    long long n;
    int threads, scalar = 0, no_avx512 = 0;
    if (!PyArg_ParseTuple(args, "OOLi|pp", &y_o, &m_o, &n, &threads, &scalar, &no_avx512)) return nullptr;
    Buf y, m;
    if (n <= 0 || !get_buf(m_o, m, -1, "m", true) || m.count(4) % n || !get_buf(y_o, y, 2 * m.v.len, "y")) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "w8a8_silu_mul: n %lld does not divide m", n);
        return nullptr;
    }
    static const bool vnni = __builtin_cpu_supports("avx512vnni");
    const int path = w8a8_quantise_path(scalar, no_avx512 || !vnni);
    const float* Y = y.as<float>();
    float* M = m.as<float>();
    Py_BEGIN_ALLOW_THREADS
    parallel_for(m.count(4) / n, threads, [&](int64_t r) {
        if (path == W8A8_PATH_AVX512) spk::silu_mul_row_avx512(Y + 2 * n * r, n, M + n * r);
        else if (path == W8A8_PATH_AVX2) spk::silu_mul_row_avx2(Y + 2 * n * r, n, M + n * r);
        else spk::silu_mul_row(Y + 2 * n * r, n, M + n * r);
    });
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(path);
}

}  // namespace
