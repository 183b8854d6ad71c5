// Peak multiply-add rate probe: enough independent accumulators to hide FMA latency.
#include <immintrin.h>

#include "vec.h"

KT_NAMESPACE_BEGIN
namespace {

constexpr int kChains = 12;
volatile float probe_sink;  // keeps the loop from being optimised away

double fma_probe(int64_t iterations) {
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(float(c));
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  __m256 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, acc[c]);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  probe_sink = lanes[0] + lanes[7];
  return double(iterations) * kChains * 8 * 2;
}

}  // namespace

namespace avx2 {
double peak_probe(PeakOp op, int64_t iterations) { return op == PeakOp::kFmaF32 ? fma_probe(iterations) : 0.0; }
}  // namespace avx2

KT_NAMESPACE_END
