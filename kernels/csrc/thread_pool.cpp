// The worker pool behind ts::parallel_for (see thread_pool.h for why it exists).
//
// One loop at a time: the caller publishes it by bumping `gen_`, runs chunk 0, and waits until
// every worker has acknowledged the generation (workers with no chunk of it acknowledge at once).
// Waiting for all, not only the ones with work, means no worker can lag a generation behind and
// read the next loop's fields as its own.
//
// Sleeping without a lost wake-up: the caller bumps gen_ and then reads sleepers_; a worker adds
// itself to sleepers_ and then reads gen_ (both sequentially consistent, the worker under mu_), so
// at least one of them sees the other's write: the worker does not sleep, or the caller notifies.
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ts {
namespace {

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

thread_local bool in_loop = false;  // this thread runs a chunk: nested loops run inline
std::atomic<int64_t> g_spin_us{kDefaultSpinUs};

class Pool {
 public:
  // chunk(i) for i in [0, n): 1..n-1 on workers, 0 here. Returns when all have run.
  void run(int n, const std::function<void(int)>& chunk) {
    grow(n - 1);
    job_ = &chunk;
    job_chunks_ = n;
    error_ = nullptr;
    pending_.store(nworkers_, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    std::exception_ptr mine;
    try {
      chunk(0);
    } catch (...) {
      mine = std::current_exception();
    }
    for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
      cpu_relax();
      if (spins > 4096) sched_yield();  // a worker was preempted (busy box): let it run
    }
    if (mine) std::rethrow_exception(mine);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void grow(int workers) {
    while (nworkers_ < workers) {
      const int id = ++nworkers_;
      const uint64_t seen = gen_.load(std::memory_order_relaxed);
      std::thread([this, id, seen] { work(id, seen); }).detach();  // lives as long as the process
    }
  }

  void work(int id, uint64_t seen) {
    in_loop = true;
    for (;;) {
      seen = next(seen);
      if (id < job_chunks_) {
        try {
          (*job_)(id);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu_);
          if (!error_) error_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  // Wait for a generation after `seen`: awake for spin_us, then asleep on the condition variable.
  // The spin yields the core between checks; a yield that takes long means another task wanted
  // this core (a busy box): a spinning worker would then only answer after that task's time
  // slice, where a sleeping one is woken with priority, so workers stop spinning for a while.
  uint64_t next(uint64_t seen) {
    const auto start = Clock::now();
    const auto until = start + std::chrono::microseconds(g_spin_us.load());
    const bool spin = until > start && start >= contested_until_.load();
    for (int spins = 1; spin; ++spins) {
      const uint64_t g = gen_.load(std::memory_order_acquire);
      if (g != seen) return g;
      if (spins % 64 == 0) {
        const auto now = Clock::now();
        if (now >= until) break;
        sched_yield();
        // Even one: waiting for a second slow yield made a loaded box 1.3-3x slower.
        if (Clock::now() - now > kContested) {
          contested_until_.store(now + kContestedFor);
          break;
        }
      }
      cpu_relax();
    }
    std::unique_lock<std::mutex> lock(mu_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    cv_.wait(lock, [&] { return gen_.load(std::memory_order_seq_cst) != seen; });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return gen_.load(std::memory_order_acquire);
  }

  static constexpr auto kContested = std::chrono::microseconds(20);  // a quiet yield: ~1 us
  static constexpr auto kContestedFor = std::chrono::milliseconds(200);

  std::atomic<uint64_t> gen_{0};
  std::atomic<Clock::time_point> contested_until_{Clock::time_point{}};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  int nworkers_ = 0;
  const std::function<void(int)>* job_ = nullptr;
  int job_chunks_ = 0;
  std::exception_ptr error_;
  std::mutex mu_;
  std::condition_variable cv_;

 public:
  std::mutex caller_;  // one loop at a time; a second caller runs its loop inline
};

// Never destroyed (its detached workers outlive static destruction); made again in a forked
// child, which has none of the parent's threads.
Pool* pool() {
  static std::mutex made;
  static Pool* p = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(made);
  if (p == nullptr || owner != getpid()) p = new Pool(), owner = getpid();
  return p;
}

}  // namespace

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn, int threads) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t t = threads > 0 ? threads : at::get_num_threads();
  const int64_t chunks = std::min<int64_t>(t, (n + grain - 1) / grain);
  if (chunks <= 1 || in_loop) return fn(begin, end);
  Pool* p = pool();
  std::unique_lock<std::mutex> lock(p->caller_, std::try_to_lock);
  if (!lock.owns_lock()) return fn(begin, end);
  const int64_t size = (n + chunks - 1) / chunks;
  const std::function<void(int)> chunk = [&](int i) {
    const int64_t b = begin + i * size;
    if (b < end) fn(b, std::min(end, b + size));
  };
  in_loop = true;
  try {
    p->run(static_cast<int>(chunks), chunk);
  } catch (...) {
    in_loop = false;
    throw;
  }
  in_loop = false;
}

void set_spin_us(int64_t us) { g_spin_us.store(std::max<int64_t>(0, us)); }
int64_t spin_us() { return g_spin_us.load(); }

}  // namespace ts
