// The machine's own limits, measured with the engine's threads: DRAM read bandwidth and the peak
// multiply-add rate of the instructions this build uses. For the benchmark command.
#pragma once

#include "common.h"
#include "kernels.h"

KT_NAMESPACE_BEGIN

// Median over `repeats` of a streaming read of `bytes` (far larger than the caches), in GB/s.
double measure_read_bandwidth(int threads, size_t bytes, int repeats);
// Flop/s of `op` on `threads` threads (0 when unsupported), best of a few runs, in GFLOP/s.
double measure_peak_gflops(int threads, PeakOp op);

KT_NAMESPACE_END
