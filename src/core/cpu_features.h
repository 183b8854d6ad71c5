// What the running CPU (and OS) can execute, from CPUID / XGETBV. cpu_features.cpp is compiled
// WITHOUT the variant's ISA flags, so these checks run safely on any x86-64 CPU.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "common.h"

KT_NAMESPACE_BEGIN

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx_vnni = false;  // VEX vpdpbusd on ymm (Alder Lake and later clients, Sapphire Rapids, Zen 5)
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, avx512_vnni = false, avx512_vbmi = false;
  bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
  bool intel = false;  // CPUID vendor GenuineIntel
};

// Flags are reported only where the OS also saves the registers they need (XCR0).
CpuFeatures detect_cpu_features();

// The flags the builds require, by their /proc/cpuinfo names: the one table of those names in C++
// (build_requirements names its flags from it; the requirement check and the bindings'
// cpu_features() read it).
struct CpuFlag {
  const char* name;
  bool CpuFeatures::*present;
};
inline constexpr CpuFlag kBuildFlags[] = {
    {"avx2", &CpuFeatures::avx2},
    {"fma", &CpuFeatures::fma},
    {"f16c", &CpuFeatures::f16c},
    {"avx512f", &CpuFeatures::avx512f},
    {"avx512bw", &CpuFeatures::avx512bw},
    {"avx512vl", &CpuFeatures::avx512vl},
    {"avx512dq", &CpuFeatures::avx512dq},
    {"avx512_bf16", &CpuFeatures::avx512_bf16},
    {"avx512_vnni", &CpuFeatures::avx512_vnni},
    {"amx_tile", &CpuFeatures::amx_tile},
    {"amx_int8", &CpuFeatures::amx_int8},
    {"amx_bf16", &CpuFeatures::amx_bf16},
};

// Whether the environment variable `name` is set to something other than "" or "0": the switches
// that turn a build's finer paths off (KT_KERNEL_DISABLE_*) so that the tests cover both.
bool env_flag(const char* name);

// Each build and the CPU flags (as /proc/cpuinfo names them) it needs, best build first: the one
// table of them in C++. loader/select.py's REQUIRED_FLAGS says the same for the loader, and
// tests/test_loader.py checks that the two agree.
const std::vector<std::pair<std::string, std::vector<std::string>>>& build_requirements();

// Throws std::runtime_error (an ImportError at module load) naming what this CPU lacks for the
// given build, or that the build is unknown; for "amx" also asks Linux for AMX tile permission.
void require_cpu_support(const std::string& variant);

KT_NAMESPACE_END
