// parallel_for over a persistent worker pool, shared by every binding of the extension.
//
// Spawning and joining std::threads on every call costs, on a small VM, as much as a small
// call's whole work (the encoder's cost samples, prepare_mu). The pool keeps its workers
// parked on a condition variable between calls instead.
//
// A job: the caller publishes (fn, n) under a new generation and wakes `want` workers; each
// woken worker claims a slot (at most `want` do), then all of them and the caller take
// indices from one atomic counter. When the caller runs out of indices it closes the job
// (no more claims) and waits only for the workers that claimed, so it never waits for a
// worker the scheduler has not run yet, and `fn` outlives every use of it.
//
// NOTE: one job at a time. A caller that finds the pool busy (two Python threads in native
// code at once, the GIL released) spawns its own threads for that call, as before the pool,
// so concurrent callers never wait for each other. No task calls parallel_for (nesting
// would take that fallback). fn must not throw: an exception escaping a worker terminates
// the process, as it did from a std::thread before the pool.
// Held cores: a thread of the process that computes beside the pool (the codec's lookahead
// helper, coder/lookahead.py) holds a core while it runs (hold_core). A job then starts that
// many workers fewer, and a core given back mid-job wakes a worker to join it. NOTE: without
// this, the helper, the caller and a worker are three runnable threads on two cores: the
// scheduler queued the caller and the worker on one core while the other idled (perf sched on
// a 2-core VM: up to 1.4 ms a pass), and the caller waits at the job's end for a preempted
// worker's task. Holding is advice: a job's caller always runs, and the cap is `threads`.
// NOTE: fork: a child holds the pool's memory but none of its threads; the pthread_atfork
// child handler (registered by pool_init, at module import) gives it a fresh pool, and the
// old one is leaked (its mutexes may be held by parent threads). The pool is never
// destroyed: its workers stay parked until the process exits.
#pragma once
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

constexpr int MAX_THREADS = 64;  // per call, the caller's included (CodecConfig's cap too)

using Task = std::function<void(int64_t)>;

inline void run_tasks(std::atomic<int64_t>& next, int64_t n, const Task& fn) {
    for (int64_t i; (i = next.fetch_add(1)) < n;) fn(i);
}

std::atomic<int> g_held{0};  // cores held beside the pool (hold_core)

class Pool {
   public:
    Pool() { workers_.reserve(MAX_THREADS); }

    // fn(0..n-1) on the caller and up to min(threads, n) - 1 workers, fewer while cores are
    // held; false (nothing run) when busy.
    bool run(int64_t n, int threads, const Task& fn) {
        std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
        if (!busy.owns_lock()) return false;
        const int target = (int)std::min<int64_t>(threads, n) - 1;
        int want;
        {
            std::lock_guard<std::mutex> lk(m_);
            while ((int)workers_.size() < target)  // NOTE: never joined (see the head of this file)
                workers_.push_back(new std::thread([this] { loop(); }));
            fn_ = &fn, n_ = n, next_.store(0), target_ = target, claimed_ = 0, finished_ = 0, ++gen_;
            want = want_ = allowed(), open_ = true;
            ++stats_.jobs, stats_.short_starts += want < target, stats_.last_want = want;
        }
        for (int i = 0; i < want; ++i) wake_.notify_one();  // NOTE: every parked worker is eligible now
        run_tasks(next_, n, fn);
        std::unique_lock<std::mutex> lk(m_);
        open_ = false;  // close the job: a worker waking from now on sits it out
        done_.wait(lk, [this] { return finished_ == claimed_; });
        fn_ = nullptr;
        return true;
    }

    // A held core was given back: the open job, if any, may take one more worker.
    void top_up() {
        std::lock_guard<std::mutex> lk(m_);
        if (!open_ || allowed() <= want_) return;
        want_ = allowed(), ++stats_.top_ups;
        wake_.notify_all();  // NOTE: not notify_one: a worker done with this job may be parked again
    }

    struct Stats {
        int64_t jobs = 0, short_starts = 0, top_ups = 0;  // jobs run, started short of workers, topped up
        int last_want = 0;                                 // workers the last job started with
        bool open = false;                                 // a job is taking workers now
    };
    Stats stats() {
        std::lock_guard<std::mutex> lk(m_);
        Stats s = stats_;
        s.open = open_;
        return s;
    }

   private:
    // NOTE: clamped both ways: a count below zero (a stray give-back) never lifts a job past `threads`
    int allowed() const { return std::clamp(target_ - g_held.load(), 0, target_); }

    void loop() {
        uint64_t joined = 0;  // the last job this worker ran in
        std::unique_lock<std::mutex> lk(m_);
        for (;;) {
            wake_.wait(lk, [&] { return open_ && gen_ != joined && claimed_ < want_; });
            joined = gen_;
            ++claimed_;
            const Task* fn = fn_;
            const int64_t n = n_;
            lk.unlock();
            run_tasks(next_, n, *fn);
            lk.lock();
            if (++finished_ == claimed_) done_.notify_one();
        }
    }

    std::mutex busy_, m_;
    std::condition_variable wake_, done_;
    std::vector<std::thread*> workers_;
    const Task* fn_ = nullptr;
    std::atomic<int64_t> next_{0};
    int64_t n_ = 0;
    uint64_t gen_ = 0;
    int target_ = 0, want_ = 0, claimed_ = 0, finished_ = 0;
    bool open_ = false;
    Stats stats_;
};

// NOTE: a plain atomic, not a function-local static: a fork during a static's guarded
// initialisation would leave the child waiting on the guard forever.
std::atomic<Pool*> g_pool{nullptr};

Pool* pool() {
    Pool* p = g_pool.load(std::memory_order_acquire);
    if (p) return p;
    Pool* fresh = new Pool();
    if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return fresh;
    delete fresh;  // another thread's pool won (ours has no workers yet)
    return p;
}

// Once, at module import (PyInit): a forked child starts with a fresh, empty pool.
void pool_init() {
    pthread_atfork(nullptr, nullptr, [] {
        g_pool.store(new Pool(), std::memory_order_release);
        g_held.store(0);  // the parent's helpers are not the child's
    });
}

// A thread beside the pool takes (delta 1) or gives back (delta -1) a core (see the head of this file).
void hold_core(int delta) {
    g_held.fetch_add(delta);
    if (delta < 0) pool()->top_up();
}

// fn(0..n-1) on up to `threads` threads (at most MAX_THREADS), the caller's included.
void parallel_for(int64_t n, int threads, const Task& fn) {
    threads = std::min(threads, MAX_THREADS);
    if (threads <= 1 || n <= 1) {
        for (int64_t i = 0; i < n; ++i) fn(i);
        return;
    }
    if (pool()->run(n, threads, fn)) return;
    std::atomic<int64_t> next{0};  // the pool is busy: this call's own threads
    std::vector<std::thread> own;
    for (int t = 1; t < std::min<int64_t>(threads, n); ++t) own.emplace_back([&] { run_tasks(next, n, fn); });
    run_tasks(next, n, fn);
    for (auto& th : own) th.join();
}

}  // namespace
