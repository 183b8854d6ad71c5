// The avx512 build's kernel interface (kernels.h): the AVX512 paths this CPU has (paths.cpp).
#include "vec.h"

KT_NAMESPACE_BEGIN

void init_kernels() { avx512::paths(); }
const Kernels& kernels() { return avx512::paths(); }
KernelInfo kernel_info() { return avx512::paths_info(); }

KT_NAMESPACE_END
