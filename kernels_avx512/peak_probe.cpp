// Peak multiply-add rate probes: enough independent accumulators to hide FMA latency.
#include "cpu_features.h"
#include "vec.h"

KT_NAMESPACE_BEGIN
namespace {

constexpr int kChains = 12;  // as in dpbf16_peak_probe
volatile float probe_sink;   // keeps the loop from being optimised away

double fma_probe(int64_t iterations) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(float(c));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  for (int64_t i = 0; i < iterations; ++i)
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  __m512 sum = acc[0];
  for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  probe_sink = _mm512_reduce_add_ps(sum);
  return double(iterations) * kChains * 16 * 2;
}

}  // namespace

double avx512::peak_probe(PeakOp op, int64_t iterations) {
  switch (op) {
    case PeakOp::kFmaF32:
      return fma_probe(iterations);
    case PeakOp::kDpBf16:
      return detect_cpu_features().avx512_bf16 ? avx512::dpbf16_peak_probe(iterations) : 0.0;
    case PeakOp::kDpInt8:
      return detect_cpu_features().avx512_vnni ? avx512::dpbusd_peak_probe(iterations) : 0.0;
    case PeakOp::kTileBf16:  // the amx build's table puts its own probe in
      return 0.0;
  }
  return 0.0;
}

KT_NAMESPACE_END
