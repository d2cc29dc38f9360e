// speckv's native CPU coder: the CPython extension speckv.coder._native.
//
// The whole per-scalar pipeline of a batch of consecutive chunks - mu correction,
// context, symbolisation, bit sections and the 32-lane rANS - in the per-element
// code of spk_model.cuh / rans_lane.cuh that the CUDA kernels (spk_fused.cu) run
// too. Threads work over rANS blocks with the GIL released. The streams are the
// numpy reference's (coder/codec.py) byte for byte; coder/native.py wraps this.
//
// Encode, per batch:  A. per block (threads): contexts, symbols, the block's own
//                        bit sections, then its 32 lanes' rANS steps (last first)
//                     B. per chunk (threads): words and sections concatenated
// Decode, per batch:  A. per block (threads): rANS steps, each element's bin and kind
//                     B. per chunk: section sizes checked, unary codes read
//                     C. per block (threads): bit patterns from bins and raw fields
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "spk_decode.h"
#include "spk_encode.h"
#include "spk_portable.h"

namespace {

// -- buffers from Python (buffer protocol; dtypes checked by coder/native.py) --------
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

bool parse_tables(PyObject* cum, PyObject* freq, PyObject* off, PyObject* size, PyObject* radius,
                  Buf* bufs, spk::Tables& t) {
    if (!get_buf(cum, bufs[0], -1, "cum") || !get_buf(freq, bufs[1], bufs[0].v.len, "freq") ||
        !get_buf(off, bufs[2], -1, "offset") || !get_buf(size, bufs[3], bufs[2].v.len, "size") ||
        !get_buf(radius, bufs[4], bufs[2].v.len, "radius"))
        return false;
    t = spk::Tables{bufs[0].as<uint16_t>(), bufs[1].as<uint16_t>(), bufs[2].as<int32_t>(), bufs[3].as<int32_t>(),
                    bufs[4].as<int32_t>(), (int32_t)bufs[2].count(4), bufs[0].count(2)};
    if (t.n_tables != SPK_N_GAUSS + 1) {
        PyErr_Format(PyExc_ValueError, "expected %d tables, got %d", SPK_N_GAUSS + 1, t.n_tables);
        return false;
    }
    return true;
}

bool parse_geometry(PyObject* layer_counts, long long heads, long long tokens, long long dim, long long epl,
                    spk::Geometry& g) {
    if (heads < 1 || tokens < 0 || dim < 1 || epl < 1 || epl > 65536) {
        PyErr_SetString(PyExc_ValueError, "bad geometry");
        return false;
    }
    PyObject* seq = PySequence_Fast(layer_counts, "layer counts must be a sequence");
    if (!seq) return false;
    std::vector<int64_t> counts;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
        long long c = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (c < 1) {
            Py_DECREF(seq);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "layer counts must be >= 1");
            return false;
        }
        counts.push_back(c);
    }
    Py_DECREF(seq);
    g.init(heads, tokens, dim, (int32_t)epl, counts);
    return true;
}

enum { PATH_AUTO = -1, PATH_COMPUTED = 0, PATH_LOOKUP = 1, PATH_VECTOR = 2 };

// What encode and decode both take: the geometry, the model's tables, mu, L and the
// optional context table, each checked against the geometry.
struct Batch {
    spk::Geometry g;
    Buf tb[5], mu, L;
    spk::Tables t;
    const uint32_t* table = nullptr;  // BF16, scalar path: the context table (or null: computed)
    std::unique_ptr<spk::SimdTableData> simd;  // BF16, vector path: its tables (or null)

    // path: PATH_COMPUTED, PATH_LOOKUP, PATH_VECTOR (AVX2 only) or PATH_AUTO (the fastest here)
    bool parse(int fp8, PyObject* lc, long long heads, long long tokens, long long dim, long long epl,
               PyObject* const tables[5], PyObject* mu_o, PyObject* l_o, int path) {
        if (path == PATH_AUTO) path = spk::cpu_has_avx2() ? PATH_VECTOR : PATH_LOOKUP;
        if (path == PATH_VECTOR && !spk::cpu_has_avx2())
            return PyErr_SetString(PyExc_ValueError, "the vector path needs a CPU with AVX2"), false;
        if (path < PATH_AUTO || path > PATH_VECTOR) return PyErr_SetString(PyExc_ValueError, "bad path"), false;
        table = !fp8 && path == PATH_LOOKUP ? spk::bf16_context_table() : nullptr;
        if (!(parse_geometry(lc, heads, tokens, dim, epl, g) &&
              parse_tables(tables[0], tables[1], tables[2], tables[3], tables[4], tb, t) &&
              get_buf(mu_o, mu, g.n_elements * (fp8 ? 4 : 2), "mu") && get_buf(l_o, L, g.n_rows * dim * 4, "L")))
            return false;
        if (path == PATH_VECTOR) simd = std::make_unique<spk::SimdTableData>(t.cum, t.freq, t.n_symbols, t.off, t.radius);
        return true;
    }
    const spk::SimdTables* vector_tables() const { return simd ? &simd->view : nullptr; }
};

PyObject* bytes_of(const void* p, size_t n) { return PyBytes_FromStringAndSize((const char*)p, (Py_ssize_t)n); }

// prepare_mu(fp8, mu, a|None, b|None, scales|None, layers, heads, tokens, dim, out, threads[, path])
PyObject* py_prepare_mu(PyObject*, PyObject* args) {
    int fp8, threads, path = PATH_AUTO;
    long long layers, heads, tokens, dim;
    PyObject *mu_o, *a_o, *b_o, *s_o, *out_o;
    if (!PyArg_ParseTuple(args, "pOOOOLLLLOi|i", &fp8, &mu_o, &a_o, &b_o, &s_o, &layers, &heads, &tokens, &dim,
                          &out_o, &threads, &path))
        return nullptr;
    const bool vector = spk::cpu_has_avx2() && (path == PATH_AUTO || path == PATH_VECTOR);
    Buf mu, a, b, s, out;
    const int64_t rows = layers * 2 * heads, n = rows * tokens * dim;
    if (layers < 0 || heads < 1 || tokens < 0 || dim < 1) return PyErr_Format(PyExc_ValueError, "mu: bad shape");
    if (!get_buf(mu_o, mu, 2 * n, "mu")) return nullptr;
    const bool affine = a_o != Py_None;
    if (affine && (!get_buf(a_o, a, rows * dim * 4, "a") || !get_buf(b_o, b, rows * dim * 4, "b"))) return nullptr;
    if (fp8 && !get_buf(s_o, s, rows / heads * 4, "scales")) return nullptr;
    if (!get_buf(out_o, out, n * (fp8 ? 4 : 2), "out", true)) return nullptr;
    spk::MuJob job{mu.as<uint16_t>(), affine ? a.as<float>() : nullptr, affine ? b.as<float>() : nullptr,
                   fp8 ? s.as<float>() : nullptr, heads, tokens, dim, out.v.buf, vector};
    Py_BEGIN_ALLOW_THREADS
    parallel_for(rows, threads, [&](int64_t r) { spk::prepare_mu_row(job, r); });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// encode(fp8, x, mu, L, heads, tokens, dim, epl, layer_counts, cum, freq, off, size, radius, threads[, path])
//   -> [(states, word_counts, words, bits) per chunk] as bytes
PyObject* py_encode(PyObject*, PyObject* args) {
    int fp8, threads, path = PATH_AUTO;
    long long heads, tokens, dim, epl;
    PyObject *x_o, *mu_o, *l_o, *lc_o, *cum_o, *freq_o, *off_o, *size_o, *rad_o;
    if (!PyArg_ParseTuple(args, "pOOOLLLLOOOOOOi|i", &fp8, &x_o, &mu_o, &l_o, &heads, &tokens, &dim, &epl, &lc_o,
                          &cum_o, &freq_o, &off_o, &size_o, &rad_o, &threads, &path))
        return nullptr;
    Batch B;
    PyObject* const tables[5] = {cum_o, freq_o, off_o, size_o, rad_o};
    Buf x;
    if (!B.parse(fp8, lc_o, heads, tokens, dim, epl, tables, mu_o, l_o, path) ||
        !get_buf(x_o, x, B.g.n_elements * (fp8 ? 1 : 2), "x"))
        return nullptr;
    const spk::Geometry& g = B.g;
    spk::EncodeJob job{g, B.t, x.v.buf, B.mu.v.buf, B.L.as<int32_t>(), fp8 != 0, B.table, B.vector_tables()};
    std::vector<spk::EncodedBlock> blocks(g.n_blocks);
    std::vector<spk::EncodedChunk> chunks(g.chunk_layers.size());
    Py_BEGIN_ALLOW_THREADS
    parallel_for(g.n_blocks, threads, [&](int64_t b) { spk::encode_block(job, b, blocks[b]); });
    parallel_for((int64_t)chunks.size(), threads, [&](int64_t c) { spk::assemble_chunk(g, c, blocks, chunks[c]); });
    Py_END_ALLOW_THREADS
    PyObject* out = PyList_New((Py_ssize_t)chunks.size());
    if (!out) return nullptr;
    for (size_t c = 0; c < chunks.size(); ++c) {
        const spk::EncodedChunk& e = chunks[c];
        PyObject* item = Py_BuildValue("(NNNN)", bytes_of(e.states.data(), 4 * e.states.size()),
                                       bytes_of(e.counts.data(), 4 * e.counts.size()),
                                       bytes_of(e.words.data(), 2 * e.words.size()),
                                       bytes_of(e.bits.data(), e.bits.size()));
        if (!item) { Py_DECREF(out); return nullptr; }
        PyList_SET_ITEM(out, (Py_ssize_t)c, item);
    }
    return out;
}

// decode(fp8, mu, L, heads, tokens, dim, epl, layer_counts, [(states, counts, words, bits)], cum, freq, off,
//        size, radius, out, threads[, path]) -> None, or (status, chunk, block, fig1, fig2) on a corrupt stream
PyObject* py_decode(PyObject*, PyObject* args) {
    int fp8, threads, path = PATH_AUTO;
    long long heads, tokens, dim, epl;
    PyObject *mu_o, *l_o, *lc_o, *streams_o, *cum_o, *freq_o, *off_o, *size_o, *rad_o, *out_o;
    if (!PyArg_ParseTuple(args, "pOOLLLLOOOOOOOOi|i", &fp8, &mu_o, &l_o, &heads, &tokens, &dim, &epl, &lc_o,
                          &streams_o, &cum_o, &freq_o, &off_o, &size_o, &rad_o, &out_o, &threads, &path))
        return nullptr;
    Batch B;
    PyObject* const tables[5] = {cum_o, freq_o, off_o, size_o, rad_o};
    Buf out;
    if (!B.parse(fp8, lc_o, heads, tokens, dim, epl, tables, mu_o, l_o, path) ||
        !get_buf(out_o, out, B.g.n_elements * (fp8 ? 1 : 2), "out", true))
        return nullptr;
    const spk::Geometry& g = B.g;
    spk::Tables& t = B.t;
    const size_t nc = g.chunk_layers.size();
    if (!PyList_Check(streams_o) || (size_t)PyList_GET_SIZE(streams_o) != nc)
        return PyErr_Format(PyExc_ValueError, "need a list of %zu chunk streams", nc);
    std::vector<Buf> sb(4 * nc);
    std::vector<spk::ChunkStream> streams(nc);
    for (size_t c = 0; c < nc; ++c) {
        PyObject* it = PyList_GET_ITEM(streams_o, (Py_ssize_t)c);
        if (!PyTuple_Check(it) || PyTuple_GET_SIZE(it) != 4) return PyErr_Format(PyExc_ValueError, "bad chunk stream");
        const int64_t nb = g.chunk_blocks[c];
        if (!get_buf(PyTuple_GET_ITEM(it, 0), sb[4 * c], nb * SPK_LANES * 4, "states") ||
            !get_buf(PyTuple_GET_ITEM(it, 1), sb[4 * c + 1], nb * 4, "word_counts") ||
            !get_buf(PyTuple_GET_ITEM(it, 2), sb[4 * c + 2], -1, "words") ||
            !get_buf(PyTuple_GET_ITEM(it, 3), sb[4 * c + 3], -1, "bits"))
            return nullptr;
        int64_t total = 0;
        for (int64_t b = 0; b < nb; ++b) total += sb[4 * c + 1].as<uint32_t>()[b];
        if (total != sb[4 * c + 2].count(2))
            return PyErr_Format(PyExc_ValueError, "chunk %zu: word counts sum to %lld, %lld words given", c,
                                (long long)total, (long long)sb[4 * c + 2].count(2));
        streams[c] = spk::ChunkStream{sb[4 * c].as<uint32_t>(), sb[4 * c + 1].as<uint32_t>(),
                                      sb[4 * c + 2].as<uint16_t>(), sb[4 * c + 2].count(2),
                                      sb[4 * c + 3].as<uint8_t>(), sb[4 * c + 3].count(1)};
    }
    const spk::DecodeTables dt(t);
    t.bucket = dt.bucket.data(), t.cum_pad = dt.cum_pad.data();
    spk::DecodeJob job{g, t, B.mu.v.buf, B.L.as<int32_t>(), out.v.buf, fp8 != 0, streams, B.table,
                       B.vector_tables()};
    spk::Decoder dec(job);
    int64_t where[4] = {-1, -1, 0, 0};  // chunk, block, figures for the message
    int status = SPK_OK;
    Py_BEGIN_ALLOW_THREADS
    status = dec.run(threads, where, parallel_for);
    Py_END_ALLOW_THREADS
    if (status == SPK_OK) Py_RETURN_NONE;
    return Py_BuildValue("(iLLLL)", status, (long long)where[0], (long long)where[1], (long long)where[2],
                         (long long)where[3]);
}

// group_costs(fp8, x, mu, lev, n, sym_cost, surprise, cum, freq, off, size, radius, cost, surprises, threads[, path]):
// per group of n consecutive elements (x, mu as coded, lev per element), its exact coded cost
// and surprises (coder/adapt.py's element_costs, summed) into the int64 arrays cost, surprises
PyObject* py_group_costs(PyObject*, PyObject* args) {
    int fp8, threads, surprise, path = PATH_AUTO;
    long long n;
    PyObject *x_o, *mu_o, *l_o, *sc_o, *cum_o, *freq_o, *off_o, *size_o, *rad_o, *cost_o, *hit_o;
    if (!PyArg_ParseTuple(args, "pOOOLOiOOOOOOOi|i", &fp8, &x_o, &mu_o, &l_o, &n, &sc_o, &surprise, &cum_o, &freq_o,
                          &off_o, &size_o, &rad_o, &cost_o, &hit_o, &threads, &path))
        return nullptr;
    if (path == PATH_AUTO) path = spk::cpu_has_avx2() ? PATH_VECTOR : PATH_LOOKUP;
    if (n < 1 || path < PATH_COMPUTED || path > PATH_VECTOR || (path == PATH_VECTOR && !spk::cpu_has_avx2()))
        return PyErr_Format(PyExc_ValueError, "group_costs: bad group size or path");
    Buf tb[5], x, mu, L, sc, cost, hit;
    spk::Tables t;
    if (!parse_tables(cum_o, freq_o, off_o, size_o, rad_o, tb, t) || !get_buf(cost_o, cost, -1, "cost", true))
        return nullptr;
    const int64_t groups = cost.count(8), total = groups * n;
    if (!get_buf(x_o, x, total * (fp8 ? 1 : 2), "x") || !get_buf(mu_o, mu, total * (fp8 ? 4 : 2), "mu") ||
        !get_buf(l_o, L, total * 4, "lev") || !get_buf(sc_o, sc, (SPK_PROB_SCALE + 1) * 4, "sym_cost") ||
        !get_buf(hit_o, hit, groups * 8, "surprises", true))
        return nullptr;
    // NOTE: the symbol lookups index the tables by context: the same checks as encode's
    std::unique_ptr<spk::SimdTableData> simd;
    if (path == PATH_VECTOR) simd = std::make_unique<spk::SimdTableData>(t.cum, t.freq, t.n_symbols, t.off, t.radius);
    const uint32_t* table = !fp8 && path == PATH_LOOKUP ? spk::bf16_context_table() : nullptr;
    spk::Geometry g;  // unused by the cost pass
    spk::EncodeJob job{g, t, x.v.buf, mu.v.buf, nullptr, fp8 != 0, table, simd ? &simd->view : nullptr};
    spk::CostJob cj{job, L.as<int32_t>(), sc.as<int32_t>(), surprise, n};
    Py_BEGIN_ALLOW_THREADS
    parallel_for(groups, threads, [&](int64_t i) { spk::group_cost(cj, i, cost.as<int64_t>(), hit.as<int64_t>()); });
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// contexts(fp8, mu, L, out, path): packed context of each (mu, L) pair, as model.ContextTable
// packs it, on the BF16 path 0 (integer), 1 (float, as the CUDA kernels), 2 (the CPU coder's
// table lookup) or 3 (its AVX2 stage); tests compare the native model with numpy's
PyObject* py_contexts(PyObject*, PyObject* args) {
    int fp8, path;
    PyObject *mu_o, *l_o, *out_o;
    if (!PyArg_ParseTuple(args, "pOOOi", &fp8, &mu_o, &l_o, &out_o, &path)) return nullptr;
    Buf mu, L, out;
    if (!get_buf(mu_o, mu, -1, "mu")) return nullptr;
    const int64_t n = mu.count(fp8 ? 4 : 2);
    if (!get_buf(l_o, L, 4 * n, "L") || !get_buf(out_o, out, 4 * n, "out", true)) return nullptr;
    const uint32_t* tab = spk::bf16_context_table();
    if (path == 3) {  // the vector stage, as the coder runs it on a block
        if (!spk::cpu_has_avx2()) return PyErr_Format(PyExc_ValueError, "no vector path here");
        const spk::SimdTableData simd(nullptr, nullptr, 0, nullptr, nullptr);
        if (fp8) spk::contexts_avx2<SpkE4M3>(mu.v.buf, L.as<int32_t>(), n, simd.view.log2q8, out.as<uint32_t>());
        else spk::contexts_avx2<SpkBF16>(mu.v.buf, L.as<int32_t>(), n, simd.view.log2q8, out.as<uint32_t>());
        Py_RETURN_NONE;
    }
    for (int64_t i = 0; i < n; ++i) {
        const int32_t l = L.as<int32_t>()[i];
        const uint32_t m = fp8 ? mu.as<uint32_t>()[i] : mu.as<uint16_t>()[i];
        const SpkContext c = fp8 ? spk_context<SpkE4M3, SpkFP32>(m, l)
                             : path == 1 ? spk_context_float<SpkBF16, SpkBF16>(m, l)
                             : path == 2 ? spk_context_bf16_lookup(tab, m, l)
                                         : spk_context<SpkBF16, SpkBF16>(m, l);
        out.as<uint32_t>()[i] = spk_pack_context(c);
    }
    Py_RETURN_NONE;
}

// int_softmax(S int32 (rows, n), pos int64 (rows), mf float32 (rows), table int32, hi int8 (rows, n),
//             lo int8 (rows, n), sums int64 (rows), split, threads): the portable predictor's exp stage
PyObject* py_int_softmax(PyObject*, PyObject* args) {
    PyObject *s_o, *pos_o, *mf_o, *tab_o, *hi_o, *lo_o, *sum_o;
    int split, threads;
    if (!PyArg_ParseTuple(args, "OOOOOOOii", &s_o, &pos_o, &mf_o, &tab_o, &hi_o, &lo_o, &sum_o, &split, &threads))
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
                                                     hi.as<int8_t>() + r * n, lo.as<int8_t>() + r * n);
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

PyMethodDef methods[] = {
    {"silu_mul", py_silu_mul, METH_VARARGS, "the portable predictor's gated MLP product (integer.py)"},
    {"wide_quantise", py_wide_quantise, METH_VARARGS, "the portable predictor's wide row quantisation (integer.py)"},
    {"wide_dequant", py_wide_dequant, METH_VARARGS, "the portable predictor's wide dequantisation (integer.py)"},
    {"int_softmax", py_int_softmax, METH_VARARGS, "the portable predictor's softmax numerators (int_attention.py)"},
    {"contexts", py_contexts, METH_VARARGS, "packed contexts of (mu, L) pairs (tests)"},
    {"prepare_mu", py_prepare_mu, METH_VARARGS, "mu correction (model 2) and the FP8 division, threaded"},
    {"encode", py_encode, METH_VARARGS, "code a batch of consecutive chunks"},
    {"group_costs", py_group_costs, METH_VARARGS, "exact coded cost and surprises per group (adapt.py)"},
    {"decode", py_decode, METH_VARARGS, "decode a batch of consecutive chunks into a buffer"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "speckv's native CPU coder (coder/kernels)", -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) {
    PyObject* m = PyModule_Create(&module);
    if (!m) return nullptr;
    const struct { const char* name; long value; } consts[] = {
        {"PROB_BITS", SPK_PROB_BITS}, {"LANES", SPK_LANES}, {"WORD_BITS", SPK_WORD_BITS}, {"RANS_L", SPK_RANS_L},
        {"X_MAX_SHIFT", SPK_X_MAX_SHIFT}, {"SIGMA_FRAC_BITS", SPK_SIGMA_FRAC_BITS},
        {"GRID_BELOW_SIGMA", SPK_GRID_BELOW_SIGMA}, {"LAMBDA_MIN", SPK_LAMBDA_MIN}, {"LAMBDA_MAX", SPK_LAMBDA_MAX},
        {"OFFSET_BITS", SPK_OFFSET_BITS}, {"LAMBDA_OFFSET", SPK_LAMBDA_OFFSET}, {"N_GAUSS", SPK_N_GAUSS},
        {"NOOP_TABLE", SPK_NOOP_TABLE}, {"MAX_BIN", SPK_MAX_BIN}, {"NEAR_TOP_Q8", SPK_NEAR_TOP_Q8},
        {"SHIFT_MAX", SPK_SHIFT_MAX},
    };
    for (const auto& c : consts)
        if (PyModule_AddIntConstant(m, c.name, c.value) != 0) return nullptr;
    if (PyModule_AddIntConstant(m, "AVX2", spk::cpu_has_avx2()) != 0) return nullptr;  // the vector path runs here
    return m;
}
