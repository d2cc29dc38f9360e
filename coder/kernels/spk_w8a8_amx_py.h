// Python binding of the W8A8 linear on AMX tiles (spk_w8a8_amx.h), included by spk_native.cpp; it must
// equal w8a8.py's ``linear`` (torch._int_mm, then w8a8_dequant) bit for bit.
#pragma once
#include "spk_py.h"
#include "spk_w8a8_amx.h"

namespace {

// w8a8_amx_ready(): whether this process can run w8a8_amx_linear (AMX int8 tiles granted)
PyObject* py_w8a8_amx_ready(PyObject*, PyObject*) { return PyBool_FromLong(spk::amx_int8_ready()); }

// w8a8_amx_linear(q int8 (m, k), xs float32 (m), w8 int8 (n, k), ws float32 (n), add BF16 bits (m, n) or None,
//                 out float32 or BF16 bits (m, n), threads): out = w8a8.py's linear(q, xs, w8, ws, add)
PyObject* py_w8a8_amx_linear(PyObject*, PyObject* args) {
    PyObject *q_o, *xs_o, *w_o, *ws_o, *add_o, *out_o;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOOi", &q_o, &xs_o, &w_o, &ws_o, &add_o, &out_o, &threads)) return nullptr;
    Buf q, xs, w, ws, add, out;
    if (!get_buf(xs_o, xs, -1, "xs") || !get_buf(ws_o, ws, -1, "ws")) return nullptr;
    const int64_t m = xs.count(4), n = ws.count(4);
    if (!get_buf(q_o, q, -1, "q") || m <= 0 || q.v.len % m != 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "w8a8_amx_linear: q must hold m > 0 rows");
        return nullptr;
    }
    const int64_t k = q.v.len / m;
    if (!spk::w8a8_amx_fits(k, n) || !spk::amx_int8_ready()) {
        PyErr_Format(PyExc_ValueError, "w8a8_amx_linear: k %lld (a multiple of %lld), n %lld (of 16), AMX int8 %s",
                     (long long)k, (long long)spk::AMX_MM_K, (long long)n, spk::amx_int8_ready() ? "granted" : "not granted");
        return nullptr;
    }
    const bool bf16 = add_o != Py_None;
    if (!get_buf(w_o, w, n * k, "w8") || (bf16 && !get_buf(add_o, add, m * n * 2, "add")) ||
        !get_buf(out_o, out, m * n * (bf16 ? 2 : 4), "out", true))
        return nullptr;
    std::vector<int8_t> panels((size_t)(n * k));  // NOTE: packed per call: no second resident copy of the weights
    const int64_t tasks = (m + spk::AMX_MM_ROWS - 1) / spk::AMX_MM_ROWS;
    Py_BEGIN_ALLOW_THREADS
    parallel_for(n / 16, threads, [&](int64_t c) { spk::pack_panel(w.as<int8_t>(), k, c, panels.data() + c * 16 * k); });
    parallel_for(tasks, threads, [&](int64_t t) {
        const int64_t i0 = t * spk::AMX_MM_ROWS, i1 = std::min<int64_t>(m, i0 + spk::AMX_MM_ROWS);
        spk::amx_rows(q.as<int8_t>(), panels.data(), k, n, i0, i1, xs.as<float>(), ws.as<float>(),
                      bf16 ? add.as<uint16_t>() : nullptr, out.v.buf, bf16);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

}  // namespace
