// The emulator's scheduler and launch entry (after the kernel source; see cuda_emu.h).
#pragma once

namespace spk_emu {

Cta* g = nullptr;

#if defined(__x86_64__)
// save_sp <- this stack (callee-saved registers, MXCSR and the x87 control word pushed on it);
// then that of load_sp, popped in the same order
asm(R"(
    .text
    .globl spk_emu_switch
    .type spk_emu_switch, @function
spk_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size spk_emu_switch, .-spk_emu_switch
)");
#endif

[[noreturn]] inline void fiber_main() {
    const uint64_t* a = g->argv;
    g->fn(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15],
          a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23], a[24], a[25], a[26], a[27], a[28], a[29], a[30],
          a[31]);
    Fiber& me = g->f[g->cur];
    me.op = DONE;
    switch_to(&me.ctx, &g->sched);
    fail("a finished thread was resumed", g->cur);
}

// A fresh fiber on stack [lo, lo + bytes) that starts in fiber_main.
inline void start_fiber(Fiber& f, char* lo, size_t bytes) {
#if defined(__x86_64__)
    // NOTE: as if fiber_main had been called: its return-address slot at 8 mod 16; below it
    // spk_emu_switch's frame: the address it returns to, six registers, MXCSR and the x87 word
    uint64_t* top = (uint64_t*)(((uintptr_t)(lo + bytes)) & ~(uintptr_t)15);
    uint64_t* sp = top - 1 - 1 - 6 - 1;
    std::memset(sp, 0, 9 * sizeof(uint64_t));
    sp[7] = (uint64_t)(uintptr_t)&fiber_main;
    const uint32_t mxcsr = 0x1F80u, fpucw = 0x037Fu;  // the ABI's initial values
    std::memcpy(sp, &mxcsr, 4), std::memcpy((char*)sp + 4, &fpucw, 4);
    f.ctx.sp = sp;
#else
    getcontext(&f.ctx.uc);
    f.ctx.uc.uc_stack.ss_sp = lo;
    f.ctx.uc.uc_stack.ss_size = bytes;
    f.ctx.uc.uc_link = nullptr;
    makecontext(&f.ctx.uc, (void (*)())fiber_main, 0);
#endif
}

// Results of warp w's collective, once all its lanes wait at one; false while some still run.
inline bool resolve_warp(int w0, int n) {
    Fiber* f = &g->f[w0];
    int waiting = 0, live = 0;
    for (int l = 0; l < n; ++l) live += f[l].op != DONE, waiting += f[l].op != DONE && f[l].op != RUN && f[l].op != SYNC;
    if (!waiting || waiting != live) return false;
    const Op op = f[0].op;
    for (int l = 0; l < n; ++l) {
        if (f[l].op != op) fail(f[l].op == DONE ? "a warp collective without every lane of the warp (some exited)"
                                               : "lanes of one warp at different collectives", w0 + l);
        if (f[l].mask != 0xFFFFFFFFu || n != 32) fail("a warp collective with less than the full warp", w0 + l);
    }
    uint64_t vote = 0;
    for (int l = 0; l < 32; ++l) vote |= (uint64_t)(f[l].val != 0) << l;
    for (int l = 0; l < 32; ++l) {
        const int a = f[l].arg;
        switch (op) {
            case SHFL_IDX: f[l].res = f[a & 31].val; break;
            case SHFL_UP: f[l].res = l >= a ? f[l - a].val : f[l].val; break;
            case SHFL_XOR: f[l].res = f[(l ^ a) & 31].val; break;
            case BALLOT: f[l].res = vote; break;
            case ALL: f[l].res = vote == 0xFFFFFFFFull; break;
            case ANY: f[l].res = vote != 0; break;
            default: fail(OP_NAMES[op], w0 + l);
        }
    }
    for (int l = 0; l < 32; ++l) f[l].op = RUN;
    return true;
}

inline void run_cta(Cta& c) {
    const int n = (int)c.f.size();
    for (int i = 0; i < n; ++i) {
        Fiber& f = c.f[i];
        f.tid = {(unsigned)i % c.bdim.x, 0, 0};
        f.op = RUN;
        start_fiber(f, c.stacks + (size_t)i * STACK_BYTES, STACK_BYTES);
    }
    for (;;) {
        bool progress = false;
        int done = 0, sync = 0;
        for (int i = n - 1; i >= 0; --i) {  // NOTE: highest thread first (see cuda_emu.h)
            if (c.f[i].op == RUN) {
                c.cur = i;
                switch_to(&c.sched, &c.f[i].ctx);
                progress = true;
            }
            done += c.f[i].op == DONE, sync += c.f[i].op == SYNC;
        }
        if (done == n) return;
        for (int w = 0; w < n; w += 32) progress |= resolve_warp(w, n - w < 32 ? n - w : 32);
        if (sync && sync + done == n) {
            for (auto& f : c.f)
                if (f.op == SYNC) f.op = RUN;
            progress = true;
        }
        if (!progress) {
            for (int i = 0; i < n; ++i)
                if (c.f[i].op != DONE) fail(c.f[i].op == SYNC ? "__syncthreads not reached by every live thread"
                                                              : "deadlock at a warp collective", i);
        }
    }
}

}  // namespace spk_emu

// A kernel's parameters for the Python side's checks: 0 a pointer, +-bytes a signed / unsigned integer.
template <class T>
constexpr int spk_emu_kind() {
    return std::is_pointer<T>::value ? 0 : (std::is_signed<T>::value ? 1 : -1) * (int)sizeof(T);
}
template <class... A>
int spk_emu_sig(void (*)(A...), int* out, int cap) {
    const int k[] = {spk_emu_kind<A>()..., 0};
    const int n = (int)sizeof...(A);
    for (int i = 0; i < n && i < cap; ++i) out[i] = k[i];
    return n;
}

// Runs kernel fn over grid x block threads (1-D) with up to 32 integer/pointer arguments.
// NOTE: every argument travels as a 64-bit integer: the kernels take only pointers and
// integers, which the x86-64 and AArch64 calling conventions pass in 64-bit slots (an int32
// parameter reads the low half); unused trailing arguments are ignored by the callee.
extern "C" int spk_emu_launch(void* fn, unsigned grid, unsigned block, unsigned long long smem,
                              const uint64_t* argv, int nargs) {
    if (nargs > spk_emu::MAX_ARGS || smem > SPK_EMU_SMEM_BYTES || block == 0 || block > 1024) return -1;
    uint64_t a[spk_emu::MAX_ARGS] = {};
    std::memcpy(a, argv, sizeof(uint64_t) * (size_t)nargs);
    spk_emu::Cta c;
    c.bdim = {block, 1, 1}, c.gdim = {grid, 1, 1};
    c.f.resize(block);
    static std::vector<char> stacks;  // NOTE: reused, never zeroed: a launch's threads start fresh frames
    if (stacks.size() < (size_t)block * spk_emu::STACK_BYTES) stacks.resize((size_t)block * spk_emu::STACK_BYTES);
    c.stacks = stacks.data();
    c.fn = (spk_emu::Kernel)fn, c.argv = a;
    spk_emu::g = &c;
    for (unsigned b = grid; b-- > 0;) {  // NOTE: the last CTA first (see cuda_emu.h)
        c.bid = {b, 0, 0};
        std::memset(spk_smem, 0xA5, smem);  // NOTE: garbage, as on a device: kernels must stage what they read
        spk_emu::run_cta(c);
    }
    spk_emu::g = nullptr;
    return 0;
}
