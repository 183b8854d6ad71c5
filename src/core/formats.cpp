// The table of weight formats: one line per format.
#include "formats.h"

#include <stdexcept>

KT_NAMESPACE_BEGIN

extern const FormatTraits kBf16Format, kMxfp4Format, kInt8Format, kInt4Format, kFp8Format, kGgufFormat;

const std::vector<const FormatTraits*>& all_formats() {
  static const std::vector<const FormatTraits*> formats = {
      &kBf16Format,
      &kMxfp4Format,
      &kInt8Format,
      &kInt4Format,
      &kFp8Format,
      &kGgufFormat,
  };
  return formats;
}

const FormatTraits& format_named(const std::string& name) {
  std::string known;
  for (const FormatTraits* format : all_formats()) {
    if (name == format->name) return *format;
    known += (known.empty() ? "" : ", ") + std::string(format->name);
  }
  throw std::invalid_argument("the engine runs " + known + " weights, not " + name);
}

void require_kernels_for_every_format() {
  const Kernels& table = kernels();
  const KernelInfo info = kernel_info();
  const std::string build = info.isa != nullptr ? info.isa : "this";
  if (table.peak == nullptr) throw std::logic_error("the " + build + " build has no peak probe");
  for (const FormatTraits* format : all_formats()) {
    if (table.*(format->gemm) == nullptr)
      throw std::logic_error("the " + build + " build has no " + format->name + " kernel");
    if (info.*(format->path) == nullptr)
      throw std::logic_error("the " + build + " build does not say how its " + format->name + " kernel computes");
  }
}

int scale_group_of(const FormatTraits& format, int k, size_t scales_per_row, const std::string& what) {
  if (!format.has_scales()) {
    if (scales_per_row != 0) throw std::invalid_argument(what + ": " + format.name + " takes no scales");
    return 0;
  }
  std::string allowed;
  for (int group : format.allowed_scale_groups()) {
    if (group > 0 && k % group != 0) continue;
    if (size_t(format.scales_per_row(k, group)) == scales_per_row) return group;
    allowed += (allowed.empty() ? "" : ", ") + std::to_string(format.scales_per_row(k, group));
  }
  throw std::invalid_argument(what + ": " + format.name + " takes " + allowed + " scales per row of " +
                              std::to_string(k) + " inputs, not " + std::to_string(scales_per_row));
}

KT_NAMESPACE_END
