#include "cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

KT_NAMESPACE_BEGIN
namespace {

struct CpuidRegs {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};

CpuidRegs cpuid(unsigned leaf, unsigned subleaf) {
  CpuidRegs r;
  if (!__get_cpuid_count(leaf, subleaf, &r.eax, &r.ebx, &r.ecx, &r.edx)) return CpuidRegs{};
  return r;
}

bool bit(unsigned reg, int index) { return (reg >> index) & 1u; }

// XGETBV without -mxsave: inline asm, legal on any CPU that reports OSXSAVE.
uint64_t read_xcr0() {
  unsigned eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t(edx) << 32) | eax;
}

constexpr uint64_t kXcr0Avx = 0x6;          // SSE + AVX state
constexpr uint64_t kXcr0Avx512 = 0xE0;      // opmask + ZMM_Hi256 + Hi16_ZMM
constexpr uint64_t kXcr0Amx = 0x60000;      // XTILECFG + XTILEDATA
constexpr int kArchReqXcompPerm = 0x1023;   // arch_prctl: request an xstate component
constexpr int kXfeatureXtiledata = 18;

}  // namespace

CpuFeatures detect_cpu_features() {
  CpuFeatures f;
  const CpuidRegs leaf0 = cpuid(0, 0);
  f.intel = leaf0.ebx == 0x756E6547 && leaf0.edx == 0x49656E69 && leaf0.ecx == 0x6C65746E;  // "Genu" "ineI" "ntel"
  const CpuidRegs leaf1 = cpuid(1, 0);
  const bool osxsave = bit(leaf1.ecx, 27);
  const uint64_t xcr0 = osxsave ? read_xcr0() : 0;
  const bool os_avx = bit(leaf1.ecx, 28) && (xcr0 & kXcr0Avx) == kXcr0Avx;
  if (!os_avx) return f;
  const bool os_avx512 = (xcr0 & kXcr0Avx512) == kXcr0Avx512;
  const bool os_amx = (xcr0 & kXcr0Amx) == kXcr0Amx;

  const CpuidRegs leaf7 = cpuid(7, 0), leaf7_1 = cpuid(7, 1);
  f.fma = bit(leaf1.ecx, 12);
  f.f16c = bit(leaf1.ecx, 29);
  f.avx2 = bit(leaf7.ebx, 5);
  f.avx_vnni = bit(leaf7_1.eax, 4);
  f.avx512f = os_avx512 && bit(leaf7.ebx, 16);
  f.avx512dq = os_avx512 && bit(leaf7.ebx, 17);
  f.avx512bw = os_avx512 && bit(leaf7.ebx, 30);
  f.avx512vl = os_avx512 && bit(leaf7.ebx, 31);
  f.avx512_vnni = os_avx512 && bit(leaf7.ecx, 11);
  f.avx512_vbmi = os_avx512 && bit(leaf7.ecx, 1);
  f.avx512_bf16 = os_avx512 && bit(leaf7_1.eax, 5);
  f.amx_bf16 = os_amx && bit(leaf7.edx, 22);
  f.amx_tile = os_amx && bit(leaf7.edx, 24);
  f.amx_int8 = os_amx && bit(leaf7.edx, 25);
  return f;
}

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

const std::vector<std::pair<std::string, std::vector<std::string>>>& build_requirements() {
  static const std::vector<std::string> avx2 = {"avx2", "fma", "f16c"};
  static const auto with = [](std::vector<std::string> base, std::vector<std::string> more) {
    base.insert(base.end(), more.begin(), more.end());
    return base;
  };
  static const std::vector<std::string> avx512 = with(avx2, {"avx512f", "avx512bw", "avx512vl", "avx512dq"});
  static const std::vector<std::pair<std::string, std::vector<std::string>>> table = {
      {"amx", with(avx512, {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"})},
      {"avx512", avx512},
      {"avx2", avx2},
  };
  return table;
}

void require_cpu_support(const std::string& variant) {
  const CpuFeatures f = detect_cpu_features();
  const std::vector<std::string>* needs = nullptr;
  for (const auto& [build, flags] : build_requirements())
    if (build == variant) needs = &flags;
  // A build missing from the table must not load after a weaker check: an illegal instruction.
  if (!needs) throw std::runtime_error("kt_kernel has no CPU requirements for a build named " + variant);
  std::string missing;
  for (const std::string& flag : *needs) {
    bool found = false, has = false;
    for (const CpuFlag& known : kBuildFlags)
      if (flag == known.name) found = true, has = f.*known.present;
    if (!found) throw std::logic_error("no CPUID check for the flag " + flag);
    if (!has) missing += (missing.empty() ? "" : " ") + flag;
  }
  if (!missing.empty())
    throw std::runtime_error("the " + variant + " build of kt_kernel cannot run on this CPU: CPUID lacks " +
                             missing);
  if (variant == "amx" && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
    throw std::runtime_error(std::string("the amx build of kt_kernel needs AMX tile permission, which Linux "
                                         "refused (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
                             std::strerror(errno) + ")");
}

KT_NAMESPACE_END
