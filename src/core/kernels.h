// The kernel interface: declared once here, defined once per kernels_<isa>/ directory. A variant
// module links src/core with exactly one kernels directory, so the choice of implementation is made
// by the linker, not by branches in hot loops.
#pragma once

#include "common.h"

KT_NAMESPACE_BEGIN

// ---- Packed BF16 weights (one layout for every build) ----------------------------------------
// A weight matrix W[rows][k] (rows = outputs) is stored in groups of kGroupRows output rows. Inside
// a group, for each input pair (2p, 2p+1) the 16 rows' two values lie side by side:
//   group g, pair p, row r -> { W[16g + r][2p], W[16g + r][2p + 1] }
// so one 64-byte line holds 16 rows x 2 inputs: one vdpbf16ps operand, or two AVX2 fp32 vectors
// after a shift / mask. Rows are padded to a multiple of 16 and k to an even count, with zeros.
constexpr int kGroupRows = 16;

inline int packed_k(int k) { return round_up(k, 2); }
inline size_t packed_group_elems(int k) { return size_t(packed_k(k)) * kGroupRows; }
inline int packed_groups(int rows) { return ceil_div(rows, kGroupRows); }

void pack_bf16(const bf16_t* weights, int rows, int k, bf16_t* packed);

// y[i][j] = sum_k x_i[k] * W[j][k] for i < m and j < kGroupRows * groups (fp32 accumulate).
//   x_i = x + (row_ids ? row_ids[i] : i) * x_stride; each x_i is readable (zero) up to packed_k(k).
//   packed points at the first of `groups` consecutive groups of a matrix packed by pack_bf16.
//   y is overwritten; row stride y_stride floats.
void gemm_bf16(const bf16_t* x, size_t x_stride, const int32_t* row_ids, int m, const bf16_t* packed,
               int k, int groups, float* y, size_t y_stride);

// ---- Machine-limit probes (for the benchmark) -------------------------------------------------
enum class PeakOp { kFmaF32, kDpBf16 };
// Runs `iterations` rounds of independent multiply-adds of kind `op` on the calling thread and
// returns the flops done (0 when this build or CPU cannot execute `op`).
double peak_probe(PeakOp op, int64_t iterations);

// ---- Start-up ------------------------------------------------------------------------------------
// Picks the finer paths of this build (e.g. AVX512_BF16 or plain AVX512F) from CPUID, once.
void init_kernels();

struct KernelInfo {
  const char* isa;        // the kernels directory linked in
  const char* bf16_path;  // how gemm_bf16 multiplies
};
KernelInfo kernel_info();

KT_NAMESPACE_END
