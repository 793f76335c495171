// Work sharing for the native CPU kernels (cpu_attention.cc, cpu_matmul.cc, cpu_sampler.cc).
//
// A kernel's items [0, total) are cut into one contiguous range per worker: the calling thread
// and tasks on XLA's intra-op thread pool (the FFI ThreadPool context). Each worker claims the
// items of its own range in order; one whose range is empty steals the back half of another's
// (a late task's range is taken by the others, and what they leave it is still one run). So each
// thread walks one sequential stream where consecutive items are adjacent in memory (the blocked
// matmul weights). With the items dealt out in turn instead, each thread jumped a block at every
// item: SmolLM2's dot stack on two threads (no XLA, a spinning pool) took 46.5-46.9 ms at 32 rows
// and 18.5-19.3 at 1 row, against 35.2-35.5 and 17.5-18.0 in ranges.
// The caller waits only for items already claimed, which are in progress, so no wait depends on a
// task being scheduled; a task that starts after the call returned finds no item left and touches
// nothing but its own copy of the shared state.

#ifndef JAXPAGED_CPU_POOL_H_
#define JAXPAGED_CPU_POOL_H_

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxpaged {

// One worker's items [next, end), packed in one word (next in the low 32 bits) so that its owner's
// claims and a thief's split are single compare-and-swaps; its own cache line.
struct alignas(64) ItemRange {
  std::atomic<uint64_t> span{0};

  static uint64_t pack(int64_t next, int64_t end) { return uint64_t(end) << 32 | uint64_t(next); }

  void reset(int64_t next, int64_t end) { span.store(pack(next, end)); }

  // The next item, or -1 if none is left.
  int64_t claim() {
    uint64_t s = span.load();
    while (true) {
      const int64_t next = s & 0xffffffffu, end = s >> 32;
      if (next >= end) return -1;
      if (span.compare_exchange_weak(s, pack(next + 1, end))) return next;
    }
  }

  // Moves the back half of this range (at least one item) into `empty`; false if none is left.
  bool split_into(ItemRange& empty) {
    uint64_t s = span.load();
    while (true) {
      const int64_t next = s & 0xffffffffu, end = s >> 32, mid = next + (end - next) / 2;
      if (next >= end) return false;
      if (span.compare_exchange_weak(s, pack(next, mid))) {
        empty.reset(mid, end);  // no one else writes an empty range
        return true;
      }
    }
  }
};

// Runs do_item(i) for every i in [0, total) on this thread and the pool's others; returns when
// all are done. do_item is copied into each task: it must hold its inputs by value or shared_ptr.
template <typename DoItem>
void run_items(xla::ffi::ThreadPool& pool, int64_t total, const DoItem& do_item) {
  if (total > INT32_MAX) {  // the ranges pack 32-bit item ids; no kernel here comes near
    for (int64_t i = 0; i < total; ++i) do_item(i);
    return;
  }
  struct Shared {
    explicit Shared(int64_t n) : workers(n), ranges(new ItemRange[n]) {}
    const int64_t workers;
    std::unique_ptr<ItemRange[]> ranges;
    std::atomic<int64_t> done{0};
  };
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), total));
  auto shared = std::make_shared<Shared>(workers);
  for (int64_t w = 0; w < workers; ++w) shared->ranges[w].reset(total * w / workers, total * (w + 1) / workers);
  auto work = [shared, do_item](int64_t worker) {
    ItemRange& own = shared->ranges[worker];
    bool stole = true;
    while (stole) {
      for (int64_t i; (i = own.claim()) >= 0; shared->done.fetch_add(1)) do_item(i);
      stole = false;
      for (int64_t r = 1; r < shared->workers && !stole; ++r)
        stole = shared->ranges[(worker + r) % shared->workers].split_into(own);
    }
  };
  for (int64_t w = 1; w < workers; ++w) pool.Schedule([work, w]() { work(w); });  // it owns the task
  work(0);
  while (shared->done.load() < total) std::this_thread::yield();
}

}  // namespace jaxpaged

#endif  // JAXPAGED_CPU_POOL_H_
