// How many threads a CPU kernel of tierkv splits its work over, per calling thread.
//
// at::parallel_for would start an OpenMP team of the process's size from any thread. That is right
// on a serving engine's compute thread (its team is pinned to the compute cores), and wrong on
// one of tierkv's own threads that the engine keeps on a spare core: a team of N threads would
// spin on that one core. So each calling thread is capped at the CPUs its affinity allows,
// unless it says otherwise (set_copy_threads: 0 = its whole OpenMP team, as vLLM's worker thread
// does while it serves a synchronous load's copies; n = at most n).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <limits>
#include <mutex>
#if defined(__linux__)
#include <sched.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace tierkv {

inline int& copy_threads_cap() {
  thread_local int cap = -1;  // -1: not yet resolved; 0: no cap; n: at most n
  return cap;
}

inline void set_copy_threads(int64_t threads) {
  TORCH_CHECK(threads >= 0, "tierkv: set_copy_threads takes 0 (the calling thread's whole OpenMP team) or a "
              "positive thread count, got ", threads);
  copy_threads_cap() = static_cast<int>(threads);
}

// The threads for `items` work items on the calling thread.
inline int copy_threads(int64_t items) {
  int& cap = copy_threads_cap();
  if (cap < 0) {
    cap = 0;
#if defined(__linux__)
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) cap = CPU_COUNT(&allowed);
#endif
  }
  int threads = at::get_num_threads();
  if (cap > 0) threads = std::min(threads, cap);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, items)));
}

// The threads a large copy would use on the calling thread (for tests and `tierkv info`).
inline int64_t copy_threads_now() { return copy_threads(std::numeric_limits<int64_t>::max()); }

// fn(begin, end) over [0, count) in chunks of at least `grain` items, on copy_threads threads.
// An exception in any share is rethrown on the calling thread once every share ended (one
// escaping an OpenMP region would end the process), as at::parallel_for does.
template <typename F>
void parallel_items(int64_t count, int64_t grain, const F& fn) {
  if (count <= 0) return;
  const int threads = copy_threads((count + grain - 1) / std::max<int64_t>(grain, 1));
#if defined(_OPENMP)
  if (threads > 1 && !omp_in_parallel()) {
    std::exception_ptr failure;
    std::mutex failure_lock;
#pragma omp parallel num_threads(threads)
    {
      const int64_t n = omp_get_num_threads(), id = omp_get_thread_num();
      const int64_t per = (count + n - 1) / n;
      const int64_t begin = std::min(count, id * per), end = std::min(count, begin + per);
      try {
        if (begin < end) fn(begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> hold(failure_lock);
        if (!failure) failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
    return;
  }
#endif
  fn(0, count);
}

}  // namespace tierkv
