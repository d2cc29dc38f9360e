// Python bindings of the portable predictor's native stages (spk_portable.h), included by
// spk_native.cpp; speckv/predictor/integer.py and int_attention.py call them and hold the torch
// reference each must equal bit for bit.
#pragma once
#include "spk_portable.h"
#include "spk_py.h"
#include "spk_iattn.h"
#include "spk_wide.h"

namespace {

// int_softmax(S int32 (rows, n), pos int64 (rows), mf float32 (rows), table int32, hi int8 (rows, n),
//             lo int8 (rows, n), sums int64 (rows), split, threads): the portable predictor's exp stage
PyObject* py_int_softmax(PyObject*, PyObject* args) {
    PyObject *s_o, *pos_o, *mf_o, *tab_o, *hi_o, *lo_o, *sum_o;
    int split, threads, scalar = 0;  // scalar: the fallback path, for the tests
    if (!PyArg_ParseTuple(args, "OOOOOOOii|p", &s_o, &pos_o, &mf_o, &tab_o, &hi_o, &lo_o, &sum_o, &split, &threads,
                          &scalar))
        return nullptr;
    Buf S, pos, mf, tab, hi, lo, sums;
    if (!get_buf(pos_o, pos, -1, "pos")) return nullptr;
    const int64_t rows = pos.count(8);
    if (!get_buf(s_o, S, -1, "S") || !get_buf(mf_o, mf, 4 * rows, "mf") || !get_buf(tab_o, tab, -1, "table") ||
        !get_buf(sum_o, sums, 8 * rows, "sums", true))
        return nullptr;
    const int64_t n = rows ? S.count(4) / rows : 0;
    if (S.count(4) != rows * n || !get_buf(hi_o, hi, rows * n, "hi", true) || !get_buf(lo_o, lo, rows * n, "lo", true))
        return PyErr_Occurred() ? nullptr : PyErr_Format(PyExc_ValueError, "S is not (rows, n)");
    const int32_t exp_len = (int32_t)tab.count(4);
    if (exp_len < 1 || tab.as<int32_t>()[exp_len - 1] != 0)
        return PyErr_Format(PyExc_ValueError, "the exp table must end with 0");
    Py_BEGIN_ALLOW_THREADS
    parallel_for(rows, threads, [&](int64_t r) {
        sums.as<int64_t>()[r] = spk::int_softmax_row(S.as<int32_t>() + r * n, n, pos.as<int64_t>()[r],
                                                     mf.as<float>()[r], tab.as<int32_t>(), exp_len, split,
                                                     hi.as<int8_t>() + r * n, lo.as<int8_t>() + r * n, scalar);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// wide_quantise(x int64 (rows, k), w float64 (k) or None, wide_max, split, hi int8, lo int8, amax float64 (rows),
//               threads)
PyObject* py_wide_quantise(PyObject*, PyObject* args) {
    PyObject *x_o, *w_o, *hi_o, *lo_o, *amax_o;
    double wide_max;
    int split, threads;
    if (!PyArg_ParseTuple(args, "OOdiOOOi", &x_o, &w_o, &wide_max, &split, &hi_o, &lo_o, &amax_o, &threads))
        return nullptr;
    Buf x, w, hi, lo, amax;
    if (!get_buf(amax_o, amax, -1, "amax", true)) return nullptr;
    const int64_t rows = amax.count(8);
    if (!get_buf(x_o, x, -1, "x")) return nullptr;
    const int64_t k = rows ? x.count(8) / rows : 0;
    if (x.count(8) != rows * k || !get_buf(hi_o, hi, rows * k, "hi", true) || !get_buf(lo_o, lo, rows * k, "lo", true))
        return PyErr_Occurred() ? nullptr : PyErr_Format(PyExc_ValueError, "x is not (rows, k)");
    if (w_o != Py_None && !get_buf(w_o, w, 8 * k, "w")) return nullptr;
    const double* wp = w_o != Py_None ? w.as<double>() : nullptr;
    Py_BEGIN_ALLOW_THREADS
    parallel_for((rows + 63) / 64, threads, [&](int64_t b) {
        std::vector<double> xf((size_t)k);
        for (int64_t r = b * 64; r < std::min(rows, b * 64 + 64); ++r)
            amax.as<double>()[r] = spk::wide_quantise_row(x.as<int64_t>() + r * k, wp, k, wide_max, split,
                                                          hi.as<int8_t>() + r * k, lo.as<int8_t>() + r * k, xf.data());
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// wide_dequant(prod int32 (n, 2m): w8 @ [hi; lo]^T, split, row float64 (m), ws float64 (n),
//              add int64 (m, n) or None, out int64 (m, n), threads)
PyObject* py_wide_dequant(PyObject*, PyObject* args) {
    PyObject *p_o, *row_o, *ws_o, *add_o, *out_o;
    int split, threads;
    if (!PyArg_ParseTuple(args, "OiOOOOi", &p_o, &split, &row_o, &ws_o, &add_o, &out_o, &threads)) return nullptr;
    Buf prod, row, ws, add, out;
    if (!get_buf(row_o, row, -1, "row") || !get_buf(ws_o, ws, -1, "ws")) return nullptr;
    const int64_t m = row.count(8), n = ws.count(8);
    if (!get_buf(p_o, prod, 8 * m * n, "prod") || !get_buf(out_o, out, 8 * m * n, "out", true)) return nullptr;
    if (add_o != Py_None && !get_buf(add_o, add, 8 * m * n, "add")) return nullptr;
    const int64_t* ap = add_o != Py_None ? add.as<int64_t>() : nullptr;
    constexpr int64_t TILE = 8;  // rows per transposition tile
    Py_BEGIN_ALLOW_THREADS
    parallel_for((m + TILE - 1) / TILE, threads, [&](int64_t b) {
        std::vector<int64_t> acc((size_t)(TILE * n));
        spk::wide_dequant_rows(prod.as<int32_t>(), m, n, split, row.as<double>(), ws.as<double>(), ap,
                               out.as<int64_t>(), b * TILE, std::min(m, b * TILE + TILE), acc.data());
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// silu_mul(gu int64 (rows, 2 inter): gate then up, table int64, frac, step_bits, range, out int64 (rows, inter),
//          threads)
PyObject* py_silu_mul(PyObject*, PyObject* args) {
    PyObject *gu_o, *tab_o, *out_o;
    int frac, step_bits, threads;
    long long range;
    if (!PyArg_ParseTuple(args, "OOiiLOi", &gu_o, &tab_o, &frac, &step_bits, &range, &out_o, &threads)) return nullptr;
    Buf gu, tab, out;
    if (!get_buf(gu_o, gu, -1, "gu") || !get_buf(tab_o, tab, -1, "table") || !get_buf(out_o, out, gu.v.len / 2, "out", true))
        return nullptr;
    if (!PyObject_HasAttrString(out_o, "shape")) return PyErr_Format(PyExc_ValueError, "out must be an array");
    PyObject* shape = PyObject_GetAttrString(out_o, "shape");
    const int64_t inter = shape && PyTuple_Size(shape) == 2 ? PyLong_AsLongLong(PyTuple_GetItem(shape, 1)) : -1;
    Py_XDECREF(shape);
    if (inter <= 0) return PyErr_Occurred() ? nullptr : PyErr_Format(PyExc_ValueError, "out must be (rows, inter)");
    const int64_t rows = out.count(8) / inter;
    Py_BEGIN_ALLOW_THREADS
    parallel_for(rows, threads, [&](int64_t r) {
        const int64_t* g = gu.as<int64_t>() + r * 2 * inter;
        spk::silu_mul_row(g, g + inter, inter, tab.as<int64_t>(), tab.count(8), frac, step_bits, (int64_t)range,
                          out.as<int64_t>() + r * inter);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

bool wide_vnni() {
    static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                            __builtin_cpu_supports("avx512vnni");
    return yes;
}

PyObject* py_wide_vnni(PyObject*, PyObject*) { return PyBool_FromLong(wide_vnni()); }

// wide_pack(w8 int8 (N, K), N, K, out int8 (wide_pad(N, 64) * wide_pad(K, 2))): wide_linear's weight layout
// (integer.wide_unpack is its inverse)
PyObject* py_wide_pack(PyObject*, PyObject* args) {
    PyObject *w_o, *out_o;
    long long N, K;
    if (!PyArg_ParseTuple(args, "OLLO", &w_o, &N, &K, &out_o)) return nullptr;
    Buf w, out;
    if (N <= 0 || K <= 0) return PyErr_Format(PyExc_ValueError, "wide_pack: N and K must be positive");
    if (!get_buf(w_o, w, N * K, "w8") ||
        !get_buf(out_o, out, spk::wide_pad(N, spk::WIDE_COLS) * spk::wide_pad(K, 2), "packed", true))
        return nullptr;
    Py_BEGIN_ALLOW_THREADS
    spk::wide_pack(w.as<int8_t>(), N, K, out.as<int8_t>());
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// wide_linear(x int64 (M, K), w float64 (K) or None, rms float64 (M) or None, eps, frac, wide_max, packed int8
//             (wide_pack of the (N, K) weights), N, ws float64 (N), add int64 (M, N) or None, out int64 (M, N),
//             threads[, scalar, silu int64 table or None, silu_step, silu_range]) -> whether the VNNI path ran
//             (spk_wide.h; integer.wide_linear is the reference):
//   rms None and eps >= 0: each row's rms computed here (integer.rms_inv_factor with x's frac bits);
//   silu: N = 2 inter rows packed by integer.wide_interleave, out (M, inter) = integer.silu_mul of the product
PyObject* py_wide_linear(PyObject*, PyObject* args) {
    PyObject *x_o, *w_o, *rms_o, *p_o, *ws_o, *add_o, *out_o, *silu_o = Py_None;
    double eps, wide_max;
    long long N, silu_range = 0;
    int frac, threads, scalar = 0, silu_step = 0;
    if (!PyArg_ParseTuple(args, "OOOdidOLOOOi|pOiL", &x_o, &w_o, &rms_o, &eps, &frac, &wide_max, &p_o, &N, &ws_o,
                          &add_o, &out_o, &threads, &scalar, &silu_o, &silu_step, &silu_range))
        return nullptr;
    Buf x, w, rms, packed, ws, add, out, silu;
    const bool fuse_silu = silu_o != Py_None;
    if (fuse_silu && (N % spk::WIDE_COLS || add_o != Py_None || frac <= silu_step || silu_step < 0))
        return PyErr_Format(PyExc_ValueError, "wide_linear: SiLU needs N a multiple of %d, no add, 0 <= step < frac",
                            spk::WIDE_COLS);
    if (!get_buf(x_o, x, -1, "x") || !get_buf(out_o, out, -1, "out", true)) return nullptr;
    const int64_t n_out = fuse_silu ? N / 2 : N;
    const int64_t M = n_out > 0 ? out.count(8) / n_out : 0, K = M > 0 ? x.count(8) / M : 0;
    if (N <= 0 || M <= 0 || K <= 0 || K > spk::WIDE_MAX_K || out.count(8) != M * n_out || x.count(8) != M * K)
        return PyErr_Format(PyExc_ValueError, "wide_linear: out must be (M, N or N / 2), x (M, K) with 0 < K <= %lld",
                            (long long)spk::WIDE_MAX_K);
    if (fuse_silu && !get_buf(silu_o, silu, -1, "silu")) return nullptr;
    if (!get_buf(p_o, packed, spk::wide_pad(N, spk::WIDE_COLS) * spk::wide_pad(K, 2), "packed") ||
        !get_buf(ws_o, ws, 8 * N, "ws") || (w_o != Py_None && !get_buf(w_o, w, 8 * K, "w")) ||
        (rms_o != Py_None && !get_buf(rms_o, rms, 8 * M, "rms")) ||
        (add_o != Py_None && !get_buf(add_o, add, 8 * M * N, "add")))
        return nullptr;
    const spk::WideJob J{x.as<int64_t>(), w_o != Py_None ? w.as<double>() : nullptr,
                         rms_o != Py_None ? rms.as<double>() : nullptr, eps, frac, wide_max, packed.as<int8_t>(),
                         ws.as<double>(), add_o != Py_None ? add.as<int64_t>() : nullptr, out.as<int64_t>(), M, K, N,
                         fuse_silu ? silu.as<int64_t>() : nullptr, fuse_silu ? silu.count(8) : 0, silu_step,
                         (int64_t)silu_range};
    const bool vnni = wide_vnni() && !scalar;
    const int64_t row_tasks = (M + spk::WIDE_TASK_ROWS - 1) / spk::WIDE_TASK_ROWS;
    const int64_t tiles = spk::wide_pad(N, spk::WIDE_COLS) / spk::WIDE_COLS;
    // NOTE: few rows (a short prompt) split the channels too, so every thread has work
    const int64_t groups = std::min<int64_t>(tiles, std::max<int64_t>(1, (4 * threads + row_tasks - 1) / row_tasks));
    Py_BEGIN_ALLOW_THREADS
    parallel_for(row_tasks * groups, threads, [&](int64_t task) {
        const int64_t i0 = (task / groups) * spk::WIDE_TASK_ROWS, g = task % groups;
        const int64_t i1 = std::min(M, i0 + spk::WIDE_TASK_ROWS);
        const int64_t t0 = tiles * g / groups, t1 = tiles * (g + 1) / groups;
        if (vnni) spk::wide_rows_vnni(J, i0, i1, t0, t1);
        else spk::wide_rows_scalar(J, i0, i1, t0 * spk::WIDE_COLS, std::min<int64_t>(N, t1 * spk::WIDE_COLS));
    });
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(vnni);
}

// int_attention(q int64 (T, H, D), k int64 (T, Hk, D), v int64 (T, Hk, D), table int32 (ending with 0),
//               out int64 (T, H, D), threads[, scalar]) -> whether the VNNI path ran (spk_iattn.h;
//               int_attention.attention is the reference)
PyObject* py_int_attention(PyObject*, PyObject* args) {
    PyObject *q_o, *k_o, *v_o, *tab_o, *out_o;
    long long T, H, Hk, D;
    int threads, scalar = 0;
    if (!PyArg_ParseTuple(args, "OOOOOLLLLi|p", &q_o, &k_o, &v_o, &tab_o, &out_o, &T, &H, &Hk, &D, &threads, &scalar))
        return nullptr;
    if (T <= 0 || D <= 0 || Hk <= 0 || H % Hk != 0)
        return PyErr_Format(PyExc_ValueError, "int_attention: heads must be a positive multiple of kv heads, T and D > 0");
    Buf q, k, v, tab, out;
    if (!get_buf(q_o, q, 8 * T * H * D, "q") || !get_buf(k_o, k, 8 * T * Hk * D, "k") ||
        !get_buf(v_o, v, 8 * T * Hk * D, "v") || !get_buf(tab_o, tab, -1, "table") ||
        !get_buf(out_o, out, 8 * T * H * D, "out", true))
        return nullptr;
    const int32_t len = (int32_t)tab.count(4);
    if (len < 1 || tab.as<int32_t>()[len - 1] != 0) return PyErr_Format(PyExc_ValueError, "the exp table must end with 0");
    const bool vnni = wide_vnni() && !scalar && D % 16 == 0 && D <= spk::IATT_MAX_D;
    const int64_t G = H / Hk, tiles = (T + spk::IATT_ROWS - 1) / spk::IATT_ROWS;
    std::vector<spk::IattHead> heads((size_t)Hk);
    Py_BEGIN_ALLOW_THREADS
    parallel_for(Hk, threads, [&](int64_t g) {
        spk::iatt_prepare(k.as<int64_t>() + g * D, v.as<int64_t>() + g * D, T, Hk * D, D, vnni, heads[g]);
    });
    // NOTE: the last rows see the most keys: hand them out first
    parallel_for(tiles * H, threads, [&](int64_t task) {
        const int64_t h = task % H, i0 = (tiles - 1 - task / H) * spk::IATT_ROWS, i1 = std::min<int64_t>(T, i0 + spk::IATT_ROWS);
        const int64_t* qh = q.as<int64_t>() + h * D;
        int64_t* oh = out.as<int64_t>() + h * D;
        if (vnni) spk::iatt_rows_vnni(heads[h / G], qh, H * D, D, tab.as<int32_t>(), len, i0, i1, oh, H * D);
        else spk::iatt_rows_scalar(heads[h / G], qh, H * D, D, tab.as<int32_t>(), len, i0, i1, oh, H * D);
    });
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(vnni);
}

// split_qkv(qkv int64 (T, (H + 2 Hk) D), cos int32, sin int32 (>= T, D / 2), H, Hk, D, rope_frac, frac,
//           q int64 (T, H, D) or None when H = 0, k int64 (T, Hk, D), v int64 (T, Hk, D), mu BF16 bits
//           (2, Hk, T, D), threads): integer.split_qkv
PyObject* py_split_qkv(PyObject*, PyObject* args) {
    PyObject *x_o, *c_o, *s_o, *q_o, *k_o, *v_o, *mu_o;
    long long H, Hk, D;
    int rope_frac, frac, threads;
    if (!PyArg_ParseTuple(args, "OOOLLLiiOOOOi", &x_o, &c_o, &s_o, &H, &Hk, &D, &rope_frac, &frac, &q_o, &k_o, &v_o,
                          &mu_o, &threads))
        return nullptr;
    if (H < 0 || Hk <= 0 || D <= 0 || D % 2 || (H == 0) != (q_o == Py_None))
        return PyErr_Format(PyExc_ValueError, "split_qkv: Hk, D > 0, D even, q given exactly when H > 0");
    Buf x, c, sn, q, k, v, mu;
    if (!get_buf(x_o, x, -1, "qkv")) return nullptr;
    const int64_t W = (H + 2 * Hk) * D, T = x.count(8) / W;
    if (x.count(8) != T * W || !get_buf(c_o, c, -1, "cos") || !get_buf(s_o, sn, c.v.len, "sin") ||
        c.count(4) < T * (D / 2) || !get_buf(k_o, k, 8 * T * Hk * D, "k", true) ||
        !get_buf(v_o, v, 8 * T * Hk * D, "v", true) || !get_buf(mu_o, mu, 2 * 2 * Hk * T * D, "mu", true) ||
        (H > 0 && !get_buf(q_o, q, 8 * T * H * D, "q", true)))
        return PyErr_Occurred() ? nullptr : PyErr_Format(PyExc_ValueError, "split_qkv: qkv or tables do not fit");
    Py_BEGIN_ALLOW_THREADS
    parallel_for((T + 63) / 64, threads, [&](int64_t b) {
        for (int64_t t = b * 64; t < std::min<int64_t>(T, b * 64 + 64); ++t)
            spk::split_qkv_row(x.as<int64_t>() + t * W, c.as<int32_t>() + t * (D / 2), sn.as<int32_t>() + t * (D / 2),
                               H, Hk, D, T, t, rope_frac, frac, H > 0 ? q.as<int64_t>() + t * H * D : nullptr,
                               k.as<int64_t>() + t * Hk * D, v.as<int64_t>() + t * Hk * D, mu.as<uint16_t>());
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

}  // namespace
