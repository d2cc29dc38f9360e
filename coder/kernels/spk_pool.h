// parallel_for over a persistent worker pool, shared by every binding of the extension.
//
// Spawning and joining a std::thread costs ~75 us on a 2-vCPU VM: as much as a small call's
// whole work (the encoder's cost samples, prepare_mu), and it recurs on every call. The pool
// keeps its workers parked on a condition variable between calls instead.
//
// NOTE: one job at a time. A caller that finds the pool busy (two Python threads in native
// code at once, the GIL released) spawns its own threads for that call, as before the pool,
// so concurrent callers never wait for each other. fn must not throw (nor did it before: an
// exception escaping a std::thread terminates the process).
// NOTE: fork: a child holds the pool's memory but none of its threads; pthread_atfork gives
// the child a fresh pool (the old one is leaked: its mutexes may be held by parent threads).
// The pool is never destroyed: workers stay parked until the process exits.
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

constexpr int POOL_MAX_WORKERS = 63;  // CodecConfig caps threads at 64: the caller and 63 workers

using Task = std::function<void(int64_t)>;

inline void run_tasks(std::atomic<int64_t>& next, int64_t n, const Task& fn) {
    for (int64_t i; (i = next.fetch_add(1)) < n;) fn(i);
}

class Pool {
   public:
    // fn(0..n-1) on the caller and min(threads, n) - 1 workers; false (nothing run) when busy.
    bool run(int64_t n, int threads, const Task& fn) {
        std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
        if (!busy.owns_lock()) return false;
        const int want = (int)std::min<int64_t>(std::min(threads, POOL_MAX_WORKERS + 1), n) - 1;
        {
            std::lock_guard<std::mutex> lk(m_);
            while ((int)workers_.size() < want) {
                const int id = (int)workers_.size();
                workers_.push_back(new std::thread([this, id] { loop(id); }));  // NOTE: never joined
            }
            fn_ = &fn, n_ = n, next_.store(0), want_ = want, finished_ = 0, ++gen_;
        }
        wake_.notify_all();
        run_tasks(next_, n, fn);
        std::unique_lock<std::mutex> lk(m_);
        done_.wait(lk, [this] { return finished_ == want_; });  // fn outlives every worker's use
        fn_ = nullptr;
        return true;
    }

   private:
    void loop(int id) {
        uint64_t seen = 0;
        std::unique_lock<std::mutex> lk(m_);
        for (;;) {
            wake_.wait(lk, [&] { return gen_ != seen; });
            seen = gen_;
            if (id >= want_) continue;  // not part of this job
            const Task* fn = fn_;
            const int64_t n = n_;
            lk.unlock();
            run_tasks(next_, n, *fn);
            lk.lock();
            if (++finished_ == want_) done_.notify_one();
        }
    }

    std::mutex busy_, m_;
    std::condition_variable wake_, done_;
    std::vector<std::thread*> workers_;
    const Task* fn_ = nullptr;
    std::atomic<int64_t> next_{0};
    int64_t n_ = 0;
    uint64_t gen_ = 0;
    int want_ = 0, finished_ = 0;
};

Pool*& pool() {
    static Pool* p = [] {
        pthread_atfork(nullptr, nullptr, [] { pool() = new Pool(); });
        return new Pool();
    }();
    return p;
}

// fn(0..n-1) on up to `threads` threads, the caller's included.
void parallel_for(int64_t n, int threads, const Task& fn) {
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
