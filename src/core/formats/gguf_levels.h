// The levels of the 4-bit and smaller ggml types, which GGUF projections of 16 levels are held as
// indices into: Q4_1, Q4_K and Q2_K's 0..15; Q4_0 and Q3_K's -8..7; MXFP4's and NVFP4's E2M1 values
// doubled; IQ4_NL's and IQ4_XS's. Exported as GGUF_LEVEL_SETS; tests/test_gguf_kernels.py holds
// kt_kernel/gguf_blocks.py's decoders to them.
#pragma once

#include <cstdint>

#include "kernels.h"

KT_NAMESPACE_BEGIN

inline constexpr int8_t kLevelSets[][kLevels] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7},
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12},
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
};

KT_NAMESPACE_END
