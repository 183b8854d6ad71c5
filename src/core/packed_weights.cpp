#include "packed_weights.h"

#include <cstring>
#include <utility>

#include <sys/mman.h>

KT_NAMESPACE_BEGIN
namespace {

// Weights on transparent huge pages: THP in "madvise" mode, the common default, gives them only to
// buffers that ask before they are first touched (the 2 MiB-aligned part of the buffer). On the
// Xeon VM, 12 layers in turn ran 0.6-15 % faster, and the same layer call no longer ran up to 25 %
// slower on the weight sets loaded first (docs/perf-log/2026-11-24-xeon-model-stack-and-huge-pages.md).
// Best effort: where the kernel refuses, the buffer keeps 4 KiB pages.
void advise_huge_pages(uint8_t* data, size_t bytes) {
  constexpr uintptr_t kPage = 4096;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) & ~(kPage - 1);
  madvise(reinterpret_cast<void*>(begin), reinterpret_cast<uintptr_t>(data) + bytes - begin, MADV_HUGEPAGE);
}

}  // namespace

void PackedBytes::reserve(size_t bytes) {
  view_ = nullptr;
  view_bytes_ = 0;
  keep_.reset();
  owned_.reserve(bytes);
  if (bytes > 0) advise_huge_pages(owned_.data(), bytes);
}

void PackedBytes::view(const uint8_t* data, size_t bytes, std::shared_ptr<const void> keep) {
  owned_.release();
  view_ = data;
  view_bytes_ = bytes;
  keep_ = std::move(keep);
}

void PackedBytes::release() {
  owned_.release();
  view_ = nullptr;
  view_bytes_ = 0;
  keep_.reset();
}

void PackedBytes::own() {
  if (view_ == nullptr) return;
  const uint8_t* source = view_;
  const size_t bytes = view_bytes_;
  const std::shared_ptr<const void> keep = std::move(keep_);  // mapped until copied
  reserve(bytes);
  if (bytes > 0) std::memcpy(owned_.data(), source, bytes);
}

void PackedProjection::own() {
  values.own();
  scales.own();
  zeros.own();
}

void PackedProjection::allocate(const FormatTraits& format, int experts, int rows_, int k_, int scale_group_,
                                bool zero_points, const HeldLayout& held_) {
  rows = rows_;
  k = k_;
  scale_group = scale_group_;
  held = held_;
  const HeldLayouts* layouts = format.held_layouts;
  group_bytes = layouts ? layouts->group_bytes(held, k) : format.group_bytes(k);
  group_scale_bytes =
      layouts ? layouts->group_scale_bytes(held, k, scale_group) : format.group_scale_bytes(k, scale_group);
  values.reserve(size_t(experts) * expert_value_bytes());
  scales.reserve(size_t(experts) * expert_scale_bytes());
  factors.assign(experts, 1.0f);
  has_zeros = zero_points;
  if (has_zeros) zeros.reserve(size_t(experts) * expert_scale_bytes());
}

void PackedProjection::add_zero_points(const FormatTraits& format, int experts) {
  if (has_zeros) return;
  zeros.reserve(size_t(experts) * expert_scale_bytes());
  has_zeros = true;
  for (int e = 0; e < experts; ++e) pack_zero_offsets(format, e);
}

void PackedProjection::pack_zero_offsets(const FormatTraits& format, int expert) {
  const std::vector<int8_t> none(size_t(rows) * format.scales_per_row(k, scale_group), 0);
  format.pack_zeros(none.data(), rows, k, scale_group, expert_zeros(expert));
}

PackedGroups PackedProjection::groups(int expert, int first, int count) const {
  const size_t index = size_t(expert) * packed_groups(rows) + first;
  PackedGroups groups{values.data() + index * group_bytes, scales.data() + index * group_scale_bytes, group_bytes,
                      group_scale_bytes, k, count, scale_group};
  if (has_zeros) {
    groups.zeros = zeros.data() + index * group_scale_bytes;
    groups.group_zero_bytes = group_scale_bytes;
  }
  if (held.value_bits == 4) groups.levels = held.levels.data();
  if (held.value_bits != 4 && held.value_bits != 8) groups.value_offset = uint8_t(held.levels[0]);
  groups.value_bits = held.value_bits;
  groups.factored_scales = held.factored_scales;
  groups.mins = held.mins;
  groups.e4m3_scales = held.e4m3_scales;
  groups.half_scales = held.half_scales;
  groups.half_factors = held.half_factors;
  groups.multiple_bits = held.multiple_bits;
  groups.multiple_bias = held.multiple_bias;
  if (held.factored_scales) {
    groups.multiples_at = uint32_t(gguf_multiples_offset(held, k));
    groups.factors_at = uint32_t(gguf_factors_offset(held, k, scale_group));
  }
  if (size_t(expert) < factors.size()) groups.scale_factor = factors[expert];
  return groups;
}

namespace {

CanonicalMatrices canonical(const SourceProjection& src, size_t count, int rows, int k) {
  return {static_cast<const uint8_t*>(src.values), static_cast<const uint8_t*>(src.scales), count, rows, k,
          src.scale_group};
}

}  // namespace

HeldLayout held_layout(const FormatTraits& format, const SourceProjection& src, size_t count, int rows, int k) {
  return format.held_layouts ? format.held_layouts->of(canonical(src, count, rows, k)) : HeldLayout{};
}

bool holds(const FormatTraits& format, const PackedProjection& dst, const SourceProjection& src, size_t first,
           size_t count) {
  if (!format.held_layouts || count == 0) return true;
  CanonicalMatrices matrices = canonical(src, count, dst.rows, dst.k);
  matrices.values += first * dst.rows * format.row_bytes(dst.k);
  if (matrices.scales != nullptr)
    matrices.scales += first * dst.rows * format.scales_per_row(dst.k, src.scale_group) * format.scale_bytes();
  return format.held_layouts->holds(dst.held, matrices);
}

void pack_matrix(const FormatTraits& format, SourceProjection src, size_t matrix, PackedProjection& dst, int expert) {
  const int rows = dst.rows, k = dst.k;
  const size_t scales_per_row = format.scales_per_row(k, src.scale_group);
  const uint8_t* scales = static_cast<const uint8_t*>(src.scales);
  const uint8_t* values = static_cast<const uint8_t*>(src.values) + matrix * rows * format.row_bytes(k);
  const uint8_t* matrix_scales = scales ? scales + matrix * rows * scales_per_row * format.scale_bytes() : nullptr;
  if (format.held_layouts)
    format.held_layouts->pack(dst.held, values, matrix_scales, rows, k, src.scale_group, dst.expert_values(expert),
                              dst.expert_scales(expert), &dst.factors[expert]);
  else
    format.pack(values, matrix_scales, rows, k, src.scale_group, dst.expert_values(expert), dst.expert_scales(expert));
  if (src.zeros != nullptr)
    format.pack_zeros(static_cast<const int8_t*>(src.zeros) + matrix * rows * scales_per_row, rows, k,
                      src.scale_group, dst.expert_zeros(expert));
  else if (dst.has_zeros)
    dst.pack_zero_offsets(format, expert);
}

void rehold(const FormatTraits& format, PackedProjection& dst, const std::vector<uint8_t>& packed,
            const SourceProjection& src, const int64_t* source_of_slot) {
  const int rows = dst.rows, k = dst.k;
  const size_t row_scale_bytes = format.scales_per_row(k, dst.scale_group) * format.scale_bytes();
  const size_t value_bytes = size_t(rows) * format.row_bytes(k), scale_bytes = size_t(rows) * row_scale_bytes;
  std::vector<int> slots;  // the canonical matrices gathered: the slots held so far, then the part's
  for (int slot = 0; slot < int(packed.size()); ++slot)
    if (packed[slot] && source_of_slot[slot] < 0) slots.push_back(slot);
  const size_t held = slots.size();
  for (int slot = 0; slot < int(packed.size()); ++slot)
    if (source_of_slot[slot] >= 0) slots.push_back(slot);
  std::vector<uint8_t> values(slots.size() * value_bytes), scales(slots.size() * scale_bytes);
  for (size_t i = 0; i < slots.size(); ++i) {
    uint8_t* v = values.data() + i * value_bytes;
    uint8_t* s = scales.data() + i * scale_bytes;
    if (i < held) {
      const UnpackRegion whole{0, rows, 0, k, v, format.row_bytes(k), s, row_scale_bytes};
      format.unpack(dst.groups(slots[i], 0, packed_groups(rows)), whole);
    } else {
      const size_t matrix = size_t(source_of_slot[slots[i]]);
      std::memcpy(v, static_cast<const uint8_t*>(src.values) + matrix * value_bytes, value_bytes);
      std::memcpy(s, static_cast<const uint8_t*>(src.scales) + matrix * scale_bytes, scale_bytes);
    }
  }
  const SourceProjection all{values.data(), scales.data(), dst.scale_group};
  PackedProjection fresh;
  fresh.allocate(format, int(packed.size()), rows, k, dst.scale_group, false,
                 held_layout(format, all, slots.size(), rows, k));
  for (size_t i = 0; i < held; ++i) pack_matrix(format, all, i, fresh, slots[i]);
  dst = std::move(fresh);
}

bool ExpertWeights::ready() const {
  for (size_t slot = 0; slot < packed.size(); ++slot)
    if (!packed[slot] && !skip[slot]) return false;
  return !packed.empty();
}

KT_NAMESPACE_END
