// The worker threads of jaxkv's native CPU kernels: one pool per process
// (pool.cc, loaded by pallas_kernels/native.py before the kernels, which
// resolve these symbols against it), shared by every kernel library.
//
// Why not OpenMP: XLA runs custom calls on whichever of its threads is
// free, and libgomp keeps one team per calling thread; with several teams
// alive on a 2-core machine libgomp spins only briefly ("throttled"), so
// nearly every call woke a sleeping helper (~0.1 ms): a batch-1 decode
// step's ~240 kernel calls paid it each. The pool's workers spin (with
// pause) for a while after each region and then sleep, whichever thread
// calls it.

#pragma once

extern "C" {
// Runs fn(ctx, task, thread) for task in [0, num_tasks) on the calling
// thread (thread 0) and the pool's workers (threads 1..), tasks handed out
// one at a time; returns when all have run. One region at a time. The
// workers then spin spin_us microseconds (< 0: the pool's default, 2 ms)
// waiting for the next region before they sleep.
void jaxkv_pool_run(int num_tasks, void (*fn)(void*, int, int), void* ctx, int spin_us);
// Threads a region runs on (the workers plus the caller).
int jaxkv_pool_threads();
}

namespace jaxkv {

inline int pool_threads() { return jaxkv_pool_threads(); }

// f(task, thread) for every task; inline when threads <= 1 or one task.
// spin_us: how long the workers wait spinning for the next region (< 0:
// the pool's default); a short one suits a kernel called milliseconds
// apart, whose spinning workers would take cores from XLA's own threads.
template <class F>
void parallel_for(int num_tasks, int threads, F&& f, int spin_us = -1) {
  if (threads <= 1 || num_tasks <= 1 || jaxkv_pool_threads() <= 1) {
    for (int i = 0; i < num_tasks; ++i) f(i, 0);
    return;
  }
  using Fn = std::remove_reference_t<F>;
  jaxkv_pool_run(
      num_tasks, [](void* c, int i, int t) { (*static_cast<Fn*>(c))(i, t); },
      const_cast<void*>(static_cast<const void*>(&f)), spin_us);
}

}  // namespace jaxkv
