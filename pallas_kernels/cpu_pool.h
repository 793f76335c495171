// Work sharing for the native CPU kernels (cpu_attention.cc, cpu_matmul.cc).
//
// A kernel's work items are claimed from an atomic counter by the calling thread and by tasks
// on XLA's intra-op thread pool (the FFI ThreadPool context). The caller waits only for items
// already claimed, which are in progress, so no wait depends on a task being scheduled; a task
// that starts after the call returned finds no item left and touches nothing but its own copy
// of the shared counters.

#ifndef JAXPAGED_CPU_POOL_H_
#define JAXPAGED_CPU_POOL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxpaged {

// Runs do_item(i) for every i in [0, total) on this thread and the pool's others; returns when
// all are done. do_item is copied into each task: it must hold its inputs by value or shared_ptr.
template <typename DoItem>
void run_items(xla::ffi::ThreadPool& pool, int64_t total, const DoItem& do_item) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto work = [counters, total, do_item]() {
    int64_t i;
    while ((i = counters->next.fetch_add(1)) < total) {
      do_item(i);
      counters->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = work;  // Schedule takes ownership of a copy
    pool.Schedule(std::move(task));
  }
  work();
  while (counters->done.load() < total) std::this_thread::yield();
}

}  // namespace jaxpaged

#endif  // JAXPAGED_CPU_POOL_H_
