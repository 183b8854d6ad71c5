// One GEMM through a format's kernels, without the MoE around it: a test and timing aid.
#pragma once

#include "common.h"
#include "formats.h"
#include "packed_weights.h"

KT_NAMESPACE_BEGIN

// y[m][n] = x[m][k] . W[n][k] on the calling thread, W given like SourceProjection (one matrix):
// the kernels without the MoE around them, for tests of odd shapes and kernel timing. Packs W once,
// runs the GEMM `repeats` times and returns the mean seconds of one GEMM.
// int8_activations: one quantized row per activation row (the opt-in lossy mode), not two.
double linear(const FormatTraits& format, const bf16_t* x, int m, int k, SourceProjection w, int n, float* y,
              int repeats = 1, bool int8_activations = false);

KT_NAMESPACE_END
