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
//                     B. (threads) the chunks' strings sized and allocated, then each
//                        block's states, count and words and each chunk's raw sections
//                        written straight into them
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
#include "spk_py.h"

namespace {

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

enum { PATH_AUTO = -1, PATH_COMPUTED = 0, PATH_LOOKUP = 1, PATH_VECTOR = 2, PATH_VECTOR512 = 3 };

// The path a call runs: PATH_AUTO becomes the fastest one here; -2 (ValueError set) for a path
// this CPU cannot run or an unknown one.
int resolve_path(int path) {
    if (path == PATH_AUTO)
        return spk::cpu_has_avx512() ? PATH_VECTOR512 : spk::cpu_has_avx2() ? PATH_VECTOR : PATH_LOOKUP;
    if (path < PATH_COMPUTED || path > PATH_VECTOR512) return PyErr_SetString(PyExc_ValueError, "bad path"), -2;
    if (path == PATH_VECTOR && !spk::cpu_has_avx2())
        return PyErr_SetString(PyExc_ValueError, "the vector path needs a CPU with AVX2"), -2;
    if (path == PATH_VECTOR512 && !spk::cpu_has_avx512())
        return PyErr_SetString(PyExc_ValueError, "the vector512 path needs a CPU with AVX-512"), -2;
    return path;
}

// The vector paths' tables (null on the scalar paths), marked for the AVX-512 loops on PATH_VECTOR512.
std::unique_ptr<spk::SimdTableData> simd_tables(int path, const spk::Tables& t) {
    if (path < PATH_VECTOR) return nullptr;
    auto simd = std::make_unique<spk::SimdTableData>(t.cum, t.freq, t.n_symbols, t.off, t.radius);
    simd->view.wide = path == PATH_VECTOR512;
    return simd;
}

// What encode and decode both take: the geometry, the model's tables, mu, L and the
// optional context table, each checked against the geometry.
struct Batch {
    spk::Geometry g;
    Buf tb[5], mu, L;
    spk::Tables t;
    const uint32_t* table = nullptr;  // BF16, scalar path: the context table (or null: computed)
    std::unique_ptr<spk::SimdTableData> simd;  // BF16, vector path: its tables (or null)

    // path: PATH_COMPUTED, PATH_LOOKUP, PATH_VECTOR (AVX2), PATH_VECTOR512 (AVX-512) or PATH_AUTO
    bool parse(int fp8, PyObject* lc, long long heads, long long tokens, long long dim, long long epl,
               PyObject* const tables[5], PyObject* mu_o, PyObject* l_o, int path) {
        if ((path = resolve_path(path)) < 0) return false;
        table = !fp8 && path == PATH_LOOKUP ? spk::bf16_context_table() : nullptr;
        if (!(parse_geometry(lc, heads, tokens, dim, epl, g) &&
              parse_tables(tables[0], tables[1], tables[2], tables[3], tables[4], tb, t) &&
              get_buf(mu_o, mu, g.n_elements * (fp8 ? 4 : 2), "mu") && get_buf(l_o, L, g.n_rows * dim * 4, "L")))
            return false;
        simd = simd_tables(path, t);
        return true;
    }
    const spk::SimdTables* vector_tables() const { return simd ? &simd->view : nullptr; }
};

PyObject* bytes_of(const void* p, size_t n) { return PyBytes_FromStringAndSize((const char*)p, (Py_ssize_t)n); }

// [(states, word_counts, words, bits) per chunk]: strings of the sizes `lay` gives, not yet written
// (dst: where each one's bytes go), or null with the exception set
PyObject* chunk_strings(const std::vector<spk::ChunkLayout>& lay, std::vector<spk::ChunkDst>& dst) {
    PyObject* out = PyList_New((Py_ssize_t)lay.size());
    if (!out) return nullptr;
    for (size_t c = 0; c < lay.size(); ++c) {
        const spk::ChunkLayout& L = lay[c];
        PyObject* item = Py_BuildValue("(NNNN)", PyBytes_FromStringAndSize(nullptr, 4 * SPK_LANES * L.nb),
                                       PyBytes_FromStringAndSize(nullptr, 4 * L.nb),
                                       PyBytes_FromStringAndSize(nullptr, (Py_ssize_t)(2 * L.words)),
                                       PyBytes_FromStringAndSize(nullptr, (Py_ssize_t)L.bits_bytes));
        if (!item) { Py_DECREF(out); return nullptr; }
        PyList_SET_ITEM(out, (Py_ssize_t)c, item);
        uint8_t* p[4];
        for (int j = 0; j < 4; ++j) p[j] = (uint8_t*)PyBytes_AS_STRING(PyTuple_GET_ITEM(item, j));
        dst[c] = {p[0], p[1], p[2], p[3]};
    }
    return out;
}

// prepare_mu(fp8, mu, a|None, b|None, scales|None, layers, heads, tokens, dim, out, threads[, path])
PyObject* py_prepare_mu(PyObject*, PyObject* args) {
    int fp8, threads, path = PATH_AUTO;
    long long layers, heads, tokens, dim;
    PyObject *mu_o, *a_o, *b_o, *s_o, *out_o;
    if (!PyArg_ParseTuple(args, "pOOOOLLLLOi|i", &fp8, &mu_o, &a_o, &b_o, &s_o, &layers, &heads, &tokens, &dim,
                          &out_o, &threads, &path))
        return nullptr;
    if ((path = resolve_path(path)) < 0) return nullptr;
    Buf mu, a, b, s, out;
    const int64_t rows = layers * 2 * heads, n = rows * tokens * dim;
    if (layers < 0 || heads < 1 || tokens < 0 || dim < 1) return PyErr_Format(PyExc_ValueError, "mu: bad shape");
    if (!get_buf(mu_o, mu, 2 * n, "mu")) return nullptr;
    const bool affine = a_o != Py_None;
    if (affine && (!get_buf(a_o, a, rows * dim * 4, "a") || !get_buf(b_o, b, rows * dim * 4, "b"))) return nullptr;
    if (fp8 && !get_buf(s_o, s, rows / heads * 4, "scales")) return nullptr;
    if (!get_buf(out_o, out, n * (fp8 ? 4 : 2), "out", true)) return nullptr;
    spk::MuJob job{mu.as<uint16_t>(), affine ? a.as<float>() : nullptr, affine ? b.as<float>() : nullptr,
                   fp8 ? s.as<float>() : nullptr, heads, tokens, dim, out.v.buf, path >= PATH_VECTOR,
                   path == PATH_VECTOR512};
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
    const int64_t nc = (int64_t)g.chunk_layers.size();
    std::vector<spk::EncodedBlock> blocks(g.n_blocks);
    std::vector<spk::ChunkLayout> lay(nc);
    Py_BEGIN_ALLOW_THREADS
    parallel_for(g.n_blocks, threads, [&](int64_t b) { spk::encode_block(job, b, blocks[b]); });
    for (int64_t c = 0; c < nc; ++c) lay[c] = spk::chunk_layout(g, c, blocks);
    Py_END_ALLOW_THREADS
    std::vector<spk::ChunkDst> dst(nc);
    PyObject* out = chunk_strings(lay, dst);
    if (!out) return nullptr;
    std::vector<int64_t> chunk_of(g.n_blocks);
    for (int64_t c = 0; c < nc; ++c)
        for (int64_t k = 0; k < lay[c].nb; ++k) chunk_of[lay[c].b0 + k] = c;
    Py_BEGIN_ALLOW_THREADS  // NOTE: `out` is this call's alone until it returns: writing its strings is safe
    parallel_for(nc + g.n_blocks, threads, [&](int64_t t) {  // the chunks' sections first: the longest tasks
        if (t < nc) return spk::place_bits(blocks, lay[t], dst[t].bits);
        const int64_t b = t - nc, c = chunk_of[b];
        spk::place_block(blocks[b], b - lay[c].b0, lay[c], dst[c]);
    });
    Py_END_ALLOW_THREADS
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
    if (n < 1) return PyErr_Format(PyExc_ValueError, "group_costs: bad group size");
    if ((path = resolve_path(path)) < 0) return nullptr;
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
    const std::unique_ptr<spk::SimdTableData> simd = simd_tables(path, t);
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
// table lookup), 3 (its AVX2 stage) or 4 (its AVX-512 build); tests compare the native model with numpy's
PyObject* py_contexts(PyObject*, PyObject* args) {
    int fp8, path;
    PyObject *mu_o, *l_o, *out_o;
    if (!PyArg_ParseTuple(args, "pOOOi", &fp8, &mu_o, &l_o, &out_o, &path)) return nullptr;
    Buf mu, L, out;
    if (!get_buf(mu_o, mu, -1, "mu")) return nullptr;
    const int64_t n = mu.count(fp8 ? 4 : 2);
    if (!get_buf(l_o, L, 4 * n, "L") || !get_buf(out_o, out, 4 * n, "out", true)) return nullptr;
    const uint32_t* tab = spk::bf16_context_table();
    if (path == 3 || path == 4) {  // the vector stage, as the coder runs it on a block
        if (!(path == 3 ? spk::cpu_has_avx2() : spk::cpu_has_avx512()))
            return PyErr_Format(PyExc_ValueError, "no vector path here");
        spk::SimdTableData simd(nullptr, nullptr, 0, nullptr, nullptr);
        simd.view.wide = path == 4;
        if (fp8) spk::contexts_vec<SpkE4M3>(simd.view, mu.v.buf, L.as<int32_t>(), n, out.as<uint32_t>());
        else spk::contexts_vec<SpkBF16>(simd.view, mu.v.buf, L.as<int32_t>(), n, out.as<uint32_t>());
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


// One rANS block's steps on the scalar (path 0), AVX2 (1) or AVX-512 (2) path (tests: each against coder/rans.py)
PyObject* py_rans_blocks(PyObject*, PyObject* args) {
    PyObject* ops_o;
    long long steps;
    int path;
    if (!PyArg_ParseTuple(args, "OLi", &ops_o, &steps, &path)) return nullptr;
    Buf ops;
    if (!get_buf(ops_o, ops, -1, "ops")) return nullptr;
    if (steps < 1 || steps > (1LL << 24) || ops.count(4) % (steps * SPK_LANES) != 0)
        return PyErr_Format(PyExc_ValueError, "ops: %zd bytes are not whole blocks of %lld steps", ops.v.len, steps);
    for (int64_t i = 0; i < ops.count(4); ++i) {  // coder/rans.py's op checks: the stage trusts its tables
        const uint32_t op = ops.as<uint32_t>()[i], f = op >> 16;
        if (f < 1 || f > SPK_PROB_SCALE || (op & 0xFFFFu) + f > SPK_PROB_SCALE)
            return PyErr_Format(PyExc_ValueError, "ops: op %lld has start %u, freq %u", (long long)i, op & 0xFFFFu, f);
    }
    if (path < 0 || path > 2 || (path == 1 && !spk::cpu_has_avx2()) || (path == 2 && !spk::cpu_has_avx512()))
        return PyErr_Format(PyExc_ValueError, "no rANS path %d here", path);
    const int64_t n_blocks = ops.count(4) / (steps * SPK_LANES);
    std::vector<uint32_t> states, counts;
    std::vector<uint16_t> words;
    for (int64_t b = 0; b < n_blocks; ++b) {
        spk::EncodedBlock o;
        const uint32_t* op = ops.as<uint32_t>() + b * steps * SPK_LANES;
#if SPK_HAVE_AVX2_BUILD
        if (path == 2) spk::rans_block_avx512(op, steps, o);
        else if (path == 1) spk::rans_block_avx2(op, steps, o);
        else
#endif
            spk::rans_block(op, steps, o);
        states.insert(states.end(), o.states, o.states + SPK_LANES);
        counts.push_back((uint32_t)o.words.size());
        words.insert(words.end(), o.words.begin(), o.words.end());
    }
    return Py_BuildValue("(NNN)", bytes_of(states.data(), 4 * states.size()), bytes_of(counts.data(), 4 * counts.size()),
                         bytes_of(words.data(), 2 * words.size()));
}

}  // namespace

#include "spk_portable_py.h"  // the portable predictor's stages (its own file: one concept per file)
#include "spk_w8a8_py.h"      // the W8A8 predictor's stages
#include "spk_w8a8_amx_py.h"  // the W8A8 linear on AMX tiles
#include "spk_attn_py.h"      // the W8A8 predictor's int8 attention
#include "spk_fp8_amx_py.h"   // an FP8 cache's attention products as vLLM's amx kernel computes them

namespace {

// hold_core(delta): a thread beside the pool takes (1) or gives back (-1) a core (spk_pool.h)
PyObject* py_hold_core(PyObject*, PyObject* args) {
    int delta;
    if (!PyArg_ParseTuple(args, "i", &delta)) return nullptr;
    if (delta != 1 && delta != -1) return PyErr_Format(PyExc_ValueError, "hold_core takes 1 or -1, not %d", delta);
    Py_BEGIN_ALLOW_THREADS  // NOTE: top_up takes the pool's lock, which a job's caller holds briefly
    hold_core(delta);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// pool_stats() -> (held cores, jobs, jobs started short of workers, top-ups, a job open now,
//                  workers the last job started with)
PyObject* py_pool_stats(PyObject*, PyObject*) {
    Pool::Stats st;
    Py_BEGIN_ALLOW_THREADS
    st = pool()->stats();
    Py_END_ALLOW_THREADS
    return Py_BuildValue("iLLLOi", g_held.load(), (long long)st.jobs, (long long)st.short_starts,
                         (long long)st.top_ups, st.open ? Py_True : Py_False, st.last_want);
}

PyMethodDef methods[] = {
    {"silu_mul", py_silu_mul, METH_VARARGS, "the portable predictor's gated MLP product (integer.py)"},
    {"wide_quantise", py_wide_quantise, METH_VARARGS, "the portable predictor's wide row quantisation (integer.py)"},
    {"wide_dequant", py_wide_dequant, METH_VARARGS, "the portable predictor's wide dequantisation (integer.py)"},
    {"w8a8_quantise", py_w8a8_quantise, METH_VARARGS, "the W8A8 predictor's row quantisation (w8a8.py)"},
    {"w8a8_dequant", py_w8a8_dequant, METH_VARARGS, "the W8A8 predictor's dequantisation (w8a8.py)"},
    {"w8a8_amx_ready", py_w8a8_amx_ready, METH_NOARGS, "whether AMX int8 tiles are granted (w8a8.py)"},
    {"w8a8_amx_fits", py_w8a8_amx_fits, METH_VARARGS, "whether w8a8_amx_linear takes (k, n) (w8a8.py)"},
    {"w8a8_amx_linear", py_w8a8_amx_linear, METH_VARARGS, "the W8A8 linear: product and dequantisation on AMX tiles (w8a8.py)"},
    {"w8a8_amx_mlp", py_w8a8_amx_mlp, METH_VARARGS, "the W8A8 MLP with speckv's SiLU on AMX tiles (w8a8_pass.py)"},
    {"w8a8_silu_mul", py_w8a8_silu_mul, METH_VARARGS, "speckv's SiLU of the gate times the up product (w8a8.py)"},
    {"w8a8_rope", py_w8a8_rope, METH_VARARGS, "the W8A8 predictor's RoPE of float32 rows to BF16 (w8a8_pass.py)"},
    {"igemm", py_igemm, METH_VARARGS, "int8 products with exact int32 sums (integer.int_mm, CPUs without VNNI)"},
    {"int_attention", py_int_attention, METH_VARARGS, "the portable rung's integer attention (int_attention.py)"},
    {"split_qkv", py_split_qkv, METH_VARARGS, "the portable rung's rope, q/k/v split and BF16 mu (integer.split_qkv)"},
    {"wide_vnni", py_wide_vnni, METH_NOARGS, "whether wide_linear's AVX-512 VNNI path runs on this CPU"},
    {"wide_pack", py_wide_pack, METH_VARARGS, "the portable rung's weight layout for wide_linear"},
    {"wide_linear", py_wide_linear, METH_VARARGS, "the portable rung's fused linear (integer.wide_linear)"},
    {"int8_attention", py_int8_attention, METH_VARARGS, "the W8A8 predictor's int8 attention (int8_attention.py)"},
    {"fp8_amx_ready", py_fp8_amx_ready, METH_NOARGS, "whether AMX BF16 tiles are granted (amx_fp8.py)"},
    {"fp8_amx_attention", py_fp8_amx_attention, METH_VARARGS, "causal attention over an FP8 cache as vLLM's amx kernel computes it (amx_fp8.py)"},
    {"fp8_amx_scores", py_fp8_amx_scores, METH_VARARGS, "unscaled FP8-cache scores on AMX tiles (amx_fp8.py)"},
    {"fp8_amx_pv", py_fp8_amx_pv, METH_VARARGS, "unscaled FP8-cache P @ V on AMX tiles (amx_fp8.py)"},
    {"int_softmax", py_int_softmax, METH_VARARGS, "the portable predictor's softmax numerators (int_attention.py)"},
    {"contexts", py_contexts, METH_VARARGS, "packed contexts of (mu, L) pairs (tests)"},
    {"rans_blocks", py_rans_blocks, METH_VARARGS, "rANS blocks of ops on the scalar, AVX2 or AVX-512 path (tests)"},
    {"prepare_mu", py_prepare_mu, METH_VARARGS, "mu correction (model 2) and the FP8 division, threaded"},
    {"encode", py_encode, METH_VARARGS, "code a batch of consecutive chunks"},
    {"group_costs", py_group_costs, METH_VARARGS, "exact coded cost and surprises per group (adapt.py)"},
    {"decode", py_decode, METH_VARARGS, "decode a batch of consecutive chunks into a buffer"},
    {"hold_core", py_hold_core, METH_VARARGS, "a thread beside the pool takes or gives back a core (lookahead.py)"},
    {"pool_stats", py_pool_stats, METH_NOARGS, "the worker pool's held cores and job counts (tests)"},
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
    if (PyModule_AddIntConstant(m, "AVX512", spk::cpu_has_avx512()) != 0) return nullptr;  // and vector512
    pool_init();  // parallel_for's workers (spk_pool.h): a forked child gets its own
    return m;
}
