// The extension's own worker threads for its parallel loops (in place of ATen's OpenMP ones).
//
// Why: a decode step runs ~150 parallel loops (5 per layer), each a few hundred microseconds,
// separated by a few tens of microseconds of Python. Under OMP_WAIT_POLICY=PASSIVE an OpenMP
// worker sleeps on a futex the moment a loop ends, so every loop pays a wake-up; on a 2-vCPU VM
// the idle vCPU halts and its wake-up is an inter-processor interrupt through the hypervisor,
// ~100-200 us. ACTIVE (or a large GOMP_SPINCOUNT) keeps the workers awake but makes a busy box
// 1.5-3x slower (they spin through their time slices). These workers spin for a short, bounded
// time after each loop (`set_spin_us`, default kDefaultSpinUs; sched_yield between checks, so a
// busy box gets the core back), then sleep: back-to-back loops in one forward pass find them
// awake, and between steps they sleep as PASSIVE ones do.
#pragma once
#include <cstdint>
#include <functional>

namespace ts {

constexpr int64_t kDefaultSpinUs = 100;

// fn(b, e) over [begin, end) in at most `threads` contiguous chunks of at least `grain` items (the
// same split as at::parallel_for), chunk 0 on the calling thread. threads <= 0: torch's thread
// count. Runs inline for one chunk, and when called from inside a loop or from a second thread
// while another's loop runs.
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn, int threads = 0);

// How long an idle worker waits awake for the next loop before it sleeps (0: sleep at once).
void set_spin_us(int64_t us);
int64_t spin_us();

}  // namespace ts
