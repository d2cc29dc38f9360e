// A CPU emulator of the CUDA subset coder/kernels/spk_fused.cu uses, for tests only: the fused
// kernels' own source runs here, warp collectives and all, so their logic is checked against the
// native coder byte for byte on a machine without a GPU (tests/cuda_emu.py builds it).
//
// Model: a CTA is a set of fibers (one per thread), run one CTA at a time. A fiber runs
// until it reaches a collective (__shfl_*_sync, __ballot_sync, __all_sync, __any_sync,
// __syncthreads); when every thread the collective needs is waiting there, the scheduler computes
// the results and lets them go on. Strict where CUDA leaves things undefined:
// - a warp collective needs all 32 lanes of its warp, live, at the same kind of collective with
//   the full mask (the kernels use no other); anything else aborts with a message;
// - __syncthreads needs every live thread of the CTA; a deadlock aborts;
// - CTAs run last first, and the threads of a CTA highest first between collectives: CUDA
//   promises no order, and a kernel leaning on the natural one (a thread reading what a lower
//   thread or an earlier CTA writes, with no barrier or launch between) reads stale data here.
// NOTE: what this cannot check: races between threads outside collectives (fibers run one at a
// time), float32 flushing (-ftz: the kernels compute in float64 from bits anyway), speed.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <ucontext.h>
#include <vector>

namespace spk_emu {

struct Dim3 {
    unsigned x, y, z;
};

enum Op { RUN, SHFL_IDX, SHFL_UP, SHFL_XOR, BALLOT, ALL, ANY, SYNC, DONE };
static const char* const OP_NAMES[] = {"run", "shfl", "shfl_up", "shfl_xor", "ballot", "all", "any",
                                       "syncthreads", "done"};

// A fiber switch: x86-64 saves only what the ABI makes the callee keep (ucontext's swapcontext
// also saves the signal mask, a system call per switch); elsewhere, ucontext.
#if defined(__x86_64__)
extern "C" void spk_emu_switch(void** save_sp, void* load_sp);
struct Context {
    void* sp;
};
#else
struct Context {
    ucontext_t uc;
};
#endif

struct Fiber {
    Context ctx;
    Dim3 tid;
    Op op;
    uint32_t mask;
    uint64_t val, res;
    int arg;
};

typedef void (*Kernel)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                       uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                       uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                       uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);
enum { MAX_ARGS = 32, STACK_BYTES = 1 << 17 };

struct Cta {
    Dim3 bid, bdim, gdim;
    std::vector<Fiber> f;
    char* stacks;
    Context sched;
    int cur;
    Kernel fn;
    const uint64_t* argv;
};

extern Cta* g;

[[noreturn]] inline void fail(const char* what, int thread) {
    std::fprintf(stderr, "cuda_emu: block %u thread %d: %s\n", g->bid.x, thread, what);
    std::abort();
}

inline void switch_to(Context* save, Context* load) {
#if defined(__x86_64__)
    spk_emu_switch(&save->sp, load->sp);
#else
    swapcontext(&save->uc, &load->uc);
#endif
}

// The calling thread waits at collective op with its value; returns the collective's result.
inline uint64_t collective(Op op, uint32_t mask, uint64_t val, int arg) {
    Fiber& me = g->f[g->cur];
    me.op = op, me.mask = mask, me.val = val, me.arg = arg;
    switch_to(&me.ctx, &g->sched);
    return me.res;
}

}  // namespace spk_emu

// -- the CUDA vocabulary -----------------------------------------------------------------
#define __CUDACC__ 1
#define __CUDA_ARCH__ 900
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static  // NOTE: CTAs run one at a time (cuda_emu.py drops it from `extern __shared__`)
#define threadIdx (spk_emu::g->f[spk_emu::g->cur].tid)
#define blockIdx (spk_emu::g->bid)
#define blockDim (spk_emu::g->bdim)
#define gridDim (spk_emu::g->gdim)

template <class T>
inline uint64_t spk_emu_bits(T v) {
    uint64_t u = 0;
    std::memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T>
inline T spk_emu_from(uint64_t u) {
    T v;
    std::memcpy(&v, &u, sizeof(T));
    return v;
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int = 32) {
    return spk_emu_from<T>(spk_emu::collective(spk_emu::SHFL_IDX, mask, spk_emu_bits(v), src));
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int = 32) {
    return spk_emu_from<T>(spk_emu::collective(spk_emu::SHFL_UP, mask, spk_emu_bits(v), (int)d));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int m, int = 32) {
    return spk_emu_from<T>(spk_emu::collective(spk_emu::SHFL_XOR, mask, spk_emu_bits(v), m));
}
inline unsigned __ballot_sync(unsigned mask, int p) { return (unsigned)spk_emu::collective(spk_emu::BALLOT, mask, p != 0, 0); }
inline int __all_sync(unsigned mask, int p) { return (int)spk_emu::collective(spk_emu::ALL, mask, p != 0, 0); }
inline int __any_sync(unsigned mask, int p) { return (int)spk_emu::collective(spk_emu::ANY, mask, p != 0, 0); }
inline void __syncthreads() { spk_emu::collective(spk_emu::SYNC, 0, 0, 0); }

template <class T>
inline T __ldg(const T* p) { return *p; }  // the read-only cache: a plain load here
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }
inline int __clzll(unsigned long long v) { return v ? __builtin_clzll(v) : 64; }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t b = (uint64_t)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)(b >> (8 * ((s >> (4 * i)) & 7u)) & 0xFFu) << (8 * i);
    return r;
}
inline unsigned atomicOr(unsigned* p, unsigned v) { const unsigned o = *p; *p = o | v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned o = *p; *p = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    const unsigned long long o = *p;
    *p = o + v;
    return o;
}
inline float __uint_as_float(unsigned u) { return spk_emu_from<float>(u); }
inline unsigned __float_as_uint(float f) { return (unsigned)spk_emu_bits(f); }
inline double __longlong_as_double(long long u) { return spk_emu_from<double>((uint64_t)u); }
inline long long __double_as_longlong(double d) { return (long long)spk_emu_bits(d); }
inline float __double2float_rn(double d) { return (float)d; }  // the default rounding: to nearest even
inline unsigned long long __double2ull_rn(double d) { return (unsigned long long)std::nearbyint(d); }
inline double __dmul_rn(double a, double b) { return a * b; }  // NOTE: built with -ffp-contract=off
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
using std::fabs;
using std::isnan;

// dynamic shared memory (`extern __shared__ int32_t spk_smem[]` in the kernels), one CTA's
enum { SPK_EMU_SMEM_BYTES = 1 << 22 };
alignas(16) int32_t spk_smem[SPK_EMU_SMEM_BYTES / 4];
