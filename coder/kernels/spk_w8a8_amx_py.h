// Python binding of the W8A8 linear on AMX tiles (spk_w8a8_amx.h), included by spk_native.cpp; it must
// equal w8a8.py's ``linear`` (torch._int_mm, then w8a8_dequant) bit for bit.
#pragma once
#include <algorithm>
#include <memory>

#include "spk_py.h"
#include "spk_mlp_amx.h"
#include "spk_w8a8_amx.h"

namespace {

// w8a8_amx_ready(): whether this process can run w8a8_amx_linear (AMX int8 tiles granted)
PyObject* py_w8a8_amx_ready(PyObject*, PyObject*) { return PyBool_FromLong(spk::amx_int8_ready()); }

// w8a8_amx_fits(k, n): whether w8a8_amx_linear takes a product of that inner size and width
PyObject* py_w8a8_amx_fits(PyObject*, PyObject* args) {
    long long k, n;
    if (!PyArg_ParseTuple(args, "LL", &k, &n)) return nullptr;
    return PyBool_FromLong(spk::w8a8_amx_fits(k, n));
}

// w8a8_amx_linear(q int8 (m, k), xs float32 (m), w8 int8 (n, k), ws float32 (n), add BF16 bits (m, n) or None,
//                 out float32 or BF16 bits (m, n), m, n, k, threads): out = w8a8.py's linear(q, xs, w8, ws, add)
PyObject* py_w8a8_amx_linear(PyObject*, PyObject* args) {
    PyObject *q_o, *xs_o, *w_o, *ws_o, *add_o, *out_o;
    long long m, n, k;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOOLLLi", &q_o, &xs_o, &w_o, &ws_o, &add_o, &out_o, &m, &n, &k, &threads))
        return nullptr;
    if (m <= 0 || !spk::w8a8_amx_fits(k, n) || !spk::amx_int8_ready()) {
        PyErr_Format(PyExc_ValueError, "w8a8_amx_linear: m %lld (> 0), k %lld (a multiple of %lld, at most %lld), "
                     "n %lld (a multiple of %lld), AMX int8 %s", m, k, (long long)spk::AMX_MM_K,
                     (long long)spk::AMX_MM_MAX_K, n, (long long)spk::AMX_MM_PANEL,
                     spk::amx_int8_ready() ? "granted" : "not granted");
        return nullptr;
    }
    const bool bf16 = add_o != Py_None;
    Buf q, xs, w, ws, add, out;
    if (!get_buf(q_o, q, -1, "q") || !get_buf(w_o, w, -1, "w8") || !get_buf(xs_o, xs, -1, "xs") ||
        !get_buf(ws_o, ws, -1, "ws"))
        return nullptr;
    // NOTE: m and n are bounded by the buffers' lengths (by division) before any product of them is formed
    if (q.v.len % k || q.v.len / k != m || w.v.len % k || w.v.len / k != n || xs.v.len != m * 4 ||
        ws.v.len != n * 4 || n > (int64_t)(PY_SSIZE_T_MAX / 4) / m) {
        PyErr_Format(PyExc_ValueError, "w8a8_amx_linear: q %zd bytes, w8 %zd, xs %zd, ws %zd "
                     "do not fit m %lld, n %lld, k %lld", q.v.len, w.v.len, xs.v.len, ws.v.len, m, n, k);
        return nullptr;
    }
    if ((bf16 && !get_buf(add_o, add, m * n * 2, "add")) || !get_buf(out_o, out, m * n * (bf16 ? 2 : 4), "out", true))
        return nullptr;
    // NOTE: packed per call, so no second copy of the weights stays resident; pack_panel writes every byte
    std::unique_ptr<int8_t[]> panels(new int8_t[(size_t)(n * k)]);
    const int64_t tasks = (m + spk::AMX_MM_ROWS - 1) / spk::AMX_MM_ROWS;
    Py_BEGIN_ALLOW_THREADS
    parallel_for(n / spk::AMX_MM_PANEL, threads, [&](int64_t c) {
        spk::pack_panel(w.as<int8_t>(), k, c, panels.get() + c * spk::AMX_MM_PANEL * k);
    });
    parallel_for(tasks, threads, [&](int64_t t) {
        const int64_t i0 = t * spk::AMX_MM_ROWS, i1 = std::min<int64_t>(m, i0 + spk::AMX_MM_ROWS);
        spk::amx_rows(q.as<int8_t>(), panels.get(), k, n, i0, i1, xs.as<float>(), ws.as<float>(),
                      bf16 ? add.as<uint16_t>() : nullptr, out.v.buf, bf16);
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// w8a8_amx_mlp(q int8 (m, k), xs float32 (m), gate_up int8 (2I, k), ws_gu float32 (2I), f_down float32 (I),
//              down int8 (n, I), ws_d float32 (n), add BF16 bits (m, n), out BF16 bits (m, n), xs2 float32 (m),
//              m, I, k, n, threads): w8a8_pass._mlp's MLP with speckv's SiLU (spk_mlp_amx.h); xs2 gets the
//              down product's row scales (a NaN: that row was not finite, and the caller must raise)
PyObject* py_w8a8_amx_mlp(PyObject*, PyObject* args) {
    PyObject *q_o, *xs_o, *gu_o, *wsgu_o, *fd_o, *d_o, *wsd_o, *add_o, *out_o, *xs2_o;
    long long m, I, k, n;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOLLLLi", &q_o, &xs_o, &gu_o, &wsgu_o, &fd_o, &d_o, &wsd_o, &add_o, &out_o,
                          &xs2_o, &m, &I, &k, &n, &threads))
        return nullptr;
    if (m <= 0 || !spk::amx_mlp_fits(k, I, n) || !spk::amx_int8_ready()) {
        PyErr_Format(PyExc_ValueError, "w8a8_amx_mlp: m %lld (> 0), k %lld and I %lld (multiples of %lld), n %lld "
                     "(a multiple of %lld), AMX int8 %s", m, k, I, (long long)spk::AMX_MM_K, n,
                     (long long)spk::AMX_MM_PANEL, spk::amx_int8_ready() ? "granted" : "not granted");
        return nullptr;
    }
    Buf q, xs, gu, wsgu, fd, d, wsd, add, out, xs2;
    // NOTE: k, I, n are bounded by amx_mlp_fits (<= AMX_MM_MAX_K); m by the buffer xs, by division, and then
    // so that m times any of them (times 4) stays far below 2^63, before any product with it is formed
    if (!get_buf(xs_o, xs, -1, "xs")) return nullptr;
    if (xs.v.len % 4 || xs.v.len / 4 != m || m > (int64_t)(PY_SSIZE_T_MAX / 4) / std::max(k, n)) {
        PyErr_Format(PyExc_ValueError, "w8a8_amx_mlp: xs %zd bytes, not m %lld floats", xs.v.len, m);
        return nullptr;
    }
    if (!get_buf(q_o, q, m * k, "q") ||
        !get_buf(gu_o, gu, 2 * I * k, "gate_up") || !get_buf(wsgu_o, wsgu, 2 * I * 4, "ws_gu") ||
        !get_buf(fd_o, fd, I * 4, "f_down") || !get_buf(d_o, d, n * I, "down") || !get_buf(wsd_o, wsd, n * 4, "ws_d") ||
        !get_buf(add_o, add, m * n * 2, "add") || !get_buf(out_o, out, m * n * 2, "out", true) ||
        !get_buf(xs2_o, xs2, m * 4, "xs2", true))
        return nullptr;
    // NOTE: packed per call, as w8a8_amx_linear's panels (no second copy of the weights stays resident)
    std::unique_ptr<int8_t[]> gp(new int8_t[(size_t)(2 * I * k)]), dp(new int8_t[(size_t)(n * I)]);
    const spk::AmxMlp a{q.as<int8_t>(), xs.as<float>(), gp.get(), wsgu.as<float>(), fd.as<float>(), dp.get(),
                        wsd.as<float>(), add.as<uint16_t>(), out.as<uint16_t>(), xs2.as<float>(), k, I, n};
    const int64_t tasks = (m + spk::AMX_MM_ROWS - 1) / spk::AMX_MM_ROWS, gpan = 2 * I / spk::AMX_MM_PANEL;
    Py_BEGIN_ALLOW_THREADS
    parallel_for(gpan + n / spk::AMX_MM_PANEL, threads, [&](int64_t c) {
        if (c < gpan) spk::pack_panel(gu.as<int8_t>(), k, c, gp.get() + c * spk::AMX_MM_PANEL * k);
        else spk::pack_panel(d.as<int8_t>(), I, c - gpan, dp.get() + (c - gpan) * spk::AMX_MM_PANEL * I);
    });
    parallel_for(tasks, threads, [&](int64_t t) {
        spk::amx_mlp_rows(a, t * spk::AMX_MM_ROWS, std::min<int64_t>(m, (t + 1) * spk::AMX_MM_ROWS));
    });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

}  // namespace
