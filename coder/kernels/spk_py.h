// Buffers from Python (buffer protocol; dtypes are checked by the Python callers) and a small
// thread pool loop, shared by the extension's bindings (spk_native.cpp, spk_portable_py.h).
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

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

void parallel_for(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
    if (threads <= 1 || n <= 1) {
        for (int64_t i = 0; i < n; ++i) fn(i);
        return;
    }
    std::atomic<int64_t> next{0};
    auto work = [&]() { for (int64_t i; (i = next.fetch_add(1)) < n;) fn(i); };
    std::vector<std::thread> pool;
    for (int t = 1; t < std::min<int64_t>(threads, n); ++t) pool.emplace_back(work);
    work();
    for (auto& th : pool) th.join();
}

}  // namespace
