#include "machine_probe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include "thread_pool.h"

KT_NAMESPACE_BEGIN
namespace {

// Sorted run times of `body`.
template <typename Body>
std::vector<double> run_times(int repeats, Body body) {
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    body();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times;
}

}  // namespace

double measure_read_bandwidth(int threads, size_t bytes, int repeats) {
  ThreadPool pool(threads);
  const size_t words = bytes / sizeof(uint64_t);
  AlignedBuffer<uint64_t> buffer(words);
  std::atomic<uint64_t> sink{0};
  auto slice = [&](int worker, size_t* begin, size_t* end) {
    *begin = words * worker / threads;
    *end = words * (worker + 1) / threads;
  };
  pool.run([&](int worker) {  // first touch by the reading threads
    size_t begin, end;
    slice(worker, &begin, &end);
    for (size_t i = begin; i < end; ++i) buffer.data()[i] = i;
  });
  const std::vector<double> times = run_times(repeats, [&] {
    pool.run([&](int worker) {
      size_t begin, end;
      slice(worker, &begin, &end);
      uint64_t acc = 0;
      for (size_t i = begin; i < end; ++i) acc ^= buffer.data()[i];  // vectorised, memory bound
      sink.fetch_xor(acc, std::memory_order_relaxed);
    });
  });
  return double(words * sizeof(uint64_t)) / times[times.size() / 2] / 1e9;  // median
}

double measure_peak_gflops(int threads, PeakOp op) {
  if (peak_probe(op, 1) == 0.0) return 0.0;
  ThreadPool pool(threads);
  constexpr int64_t kIterations = 20'000'000;
  std::vector<double> flops(threads);
  pool.run([&](int) { peak_probe(op, kIterations / 10); });  // warm up clocks
  // The fastest of a few runs: a peak is a maximum, and a run a thread lost its core in is not one.
  const double seconds =
      run_times(5, [&] { pool.run([&](int worker) { flops[worker] = peak_probe(op, kIterations); }); }).front();
  double total = 0;
  for (double f : flops) total += f;
  return total / seconds / 1e9;
}

KT_NAMESPACE_END
