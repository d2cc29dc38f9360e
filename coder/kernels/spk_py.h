// Buffers from Python (buffer protocol; dtypes are checked by the Python callers) and
// parallel_for (spk_pool.h), shared by the extension's bindings (spk_native.cpp, spk_portable_py.h).
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>

#include "spk_pool.h"

namespace {

struct Buf {
    Py_buffer v{};
    bool held = false;
    ~Buf() { if (held) PyBuffer_Release(&v); }
    template <class T> T* as() const { return static_cast<T*>(v.buf); }
    int64_t count(size_t item) const { return (int64_t)v.len / (int64_t)item; }
};

bool get_buf(PyObject* o, Buf& b, int64_t want_bytes, const char* name, bool writable = false) {
    if (PyObject_GetBuffer(o, &b.v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) != 0) return false;
    b.held = true;
    if (want_bytes >= 0 && b.v.len != want_bytes) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %lld", name, b.v.len, (long long)want_bytes);
        return false;
    }
    return true;
}

}  // namespace
