// The thread pool of jaxkv's native CPU kernels (see pool.h).

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// A worker spins this long after a region before it sleeps (unless the
// region asked for less): longer than the gaps between one batch-1 step's
// kernel calls, short against an idle engine.
constexpr int kSpinUs = 2000;

struct Pool {
  int workers = 0;
  std::mutex region;  // one region at a time
  std::atomic<uint64_t> epoch{0};
  std::atomic<int> next{0}, done{0};
  int num_tasks = 0;
  std::atomic<int> spin_us{kSpinUs};  // the last region's
  void (*fn)(void*, int, int) = nullptr;
  void* ctx = nullptr;
  std::mutex mu;
  std::condition_variable cv;
  int sleepers = 0;  // guarded by mu

  Pool() {
    cpu_set_t set;
    int cores = std::thread::hardware_concurrency();
    if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
    if (const char* env = std::getenv("JAXKV_CPU_THREADS")) cores = std::atoi(env);
    workers = std::max(0, cores - 1);
    for (int i = 0; i < workers; ++i) std::thread([this, i] { loop(i + 1); }).detach();
  }

  void work(int thread) {
    for (int t; (t = next.fetch_add(1, std::memory_order_relaxed)) < num_tasks;)
      fn(ctx, t, thread);
  }

  void loop(int thread) {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() +
                         std::chrono::microseconds(spin_us.load(std::memory_order_relaxed));
      for (int i = 0; epoch.load(std::memory_order_acquire) == seen; ++i) {
        _mm_pause();
        if ((i & 255) == 255 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mu);
          ++sleepers;
          cv.wait(lock, [&] { return epoch.load(std::memory_order_acquire) != seen; });
          --sleepers;
          break;
        }
      }
      seen = epoch.load(std::memory_order_acquire);
      work(thread);
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void run(int n, void (*f)(void*, int, int), void* c, int spin) {
    std::lock_guard<std::mutex> guard(region);
    num_tasks = n, fn = f, ctx = c;
    spin_us.store(spin < 0 ? kSpinUs : spin, std::memory_order_relaxed);
    next.store(0, std::memory_order_relaxed);
    done.store(0, std::memory_order_relaxed);
    epoch.fetch_add(1, std::memory_order_acq_rel);
    {
      std::lock_guard<std::mutex> lock(mu);
      if (sleepers > 0) cv.notify_all();
    }
    work(0);
    while (done.load(std::memory_order_acquire) < workers) _mm_pause();
  }
};

Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: workers outlive static destruction
  return *p;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void jaxkv_pool_run(
    int num_tasks, void (*fn)(void*, int, int), void* ctx, int spin_us) {
  pool().run(num_tasks, fn, ctx, spin_us);
}

extern "C" __attribute__((visibility("default"))) int jaxkv_pool_threads() {
  return pool().workers + 1;
}
