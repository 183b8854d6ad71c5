// The experts' weights as the kernels read them: each projection packed per expert, from the
// canonical layout of its format (FormatTraits), and a layer's set of them.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "common.h"
#include "formats.h"
#include "kernels.h"

KT_NAMESPACE_BEGIN

// Packed bytes: owned (aligned heap memory, on huge pages where the kernel allows) or a view of
// read-only memory, a mapped cache file (packed_file.h) that `keep` keeps mapped while viewed.
class PackedBytes {
 public:
  // Owned room for `bytes` (a view is let go first); contents not preserved.
  void reserve(size_t bytes);
  // A view of `bytes` at `data` in place of what was held (owned memory is freed).
  void view(const uint8_t* data, size_t bytes, std::shared_ptr<const void> keep);
  // Nothing held: owned memory freed, a view let go.
  void release();
  // A view copied into owned memory, so that more experts can be packed into it.
  void own();
  // A view's bytes are read-only: writing them faults (they are the file's pages).
  uint8_t* data() { return view_ != nullptr ? const_cast<uint8_t*>(view_) : owned_.data(); }
  const uint8_t* data() const { return view_ != nullptr ? view_ : owned_.data(); }
  bool is_view() const { return view_ != nullptr; }

 private:
  AlignedBuffer<uint8_t> owned_;
  const uint8_t* view_ = nullptr;
  size_t view_bytes_ = 0;
  std::shared_ptr<const void> keep_;
};

// One projection (gate, up or down) of every expert, packed for the kernels.
struct PackedProjection {
  int rows = 0, k = 0, scale_group = 0;
  size_t group_bytes = 0, group_scale_bytes = 0;
  PackedBytes values, scales;  // expert e's groups start at e * packed_groups(rows)
  PackedBytes zeros;           // zero points (kernels.h), group_scale_bytes per group
  bool has_zeros = false;
  HeldLayout held;  // where the format chooses by the data (FormatTraits::held_layouts)
  std::vector<float> factors;  // per expert: its outputs' factor (PackedGroups::scale_factor)

  // scale_group: the inputs per scale of the source (FormatTraits); zero_points: the source has them;
  // held: the layout the format chose for the data (held_layout).
  void allocate(const FormatTraits& format, int experts, int rows, int k, int scale_group, bool zero_points = false,
                const HeldLayout& held = {});
  // Zero points for every expert from now on; those packed so far get zero points of 0 (their
  // weights unchanged): experts loaded in several calls, some with zero points, some without.
  void add_zero_points(const FormatTraits& format, int experts);
  // Expert `expert`'s zero points all 0 (packed as the format stores them).
  void pack_zero_offsets(const FormatTraits& format, int expert);
  uint8_t* expert_values(int expert) { return values.data() + size_t(expert) * packed_groups(rows) * group_bytes; }
  uint8_t* expert_scales(int expert) {
    return scales.data() + size_t(expert) * packed_groups(rows) * group_scale_bytes;
  }
  uint8_t* expert_zeros(int expert) {
    return has_zeros ? zeros.data() + size_t(expert) * packed_groups(rows) * group_scale_bytes : nullptr;
  }
  // Groups [first, first + count) of one expert.
  PackedGroups groups(int expert, int first, int count) const;
  // Bytes of one expert's values, and of its scales (or zero points).
  size_t expert_value_bytes() const { return size_t(packed_groups(rows)) * group_bytes; }
  size_t expert_scale_bytes() const { return size_t(packed_groups(rows)) * group_scale_bytes; }
  // Mapped bytes copied into owned memory (PackedBytes::own), before packing more experts.
  void own();
  bool mapped() const { return values.is_view(); }
};

// The canonical (unpacked) weights of one projection for all source experts, in the format's
// layout (FormatTraits): values [E, rows, row_bytes(k)], scales [E, rows, scales_per_row] or null,
// and for a format with zero points optionally int8 zeros [E, rows, scales_per_row].
struct SourceProjection {
  const void* values;
  const void* scales;
  int scale_group = 0;
  const void* zeros = nullptr;
};

// The packed experts of a layer (or of a subpool's slice), shared by the engines that run calls on
// them (MoEEngine::twin), with the set of experts computed elsewhere.
struct ExpertWeights {
  PackedProjection gate, up, down;
  std::vector<uint8_t> skip;    // per expert: 1 = GPU-resident, its routing entries are ignored
  std::vector<uint8_t> packed;  // per slot: its weights are packed (loads may come in parts)
  bool loaded = false;          // every slot packed, or skipped (a GPU expert need not be in CPU memory)
  // Expert biases in fp32, empty where there are none: per slot, gate_bias and up_bias are added to
  // the gate and up outputs before the activation, down_bias to the expert's output before its
  // routing weight. Each slot's row is padded with zeros to whole weight groups (bias_row).
  std::vector<float> gate_bias, up_bias, down_bias;
  // Whether every slot the engine may compute is packed.
  bool ready() const;
};

// Slot `slot`'s bias row for a projection of `rows` outputs, or nullptr where `bias` is empty.
inline const float* bias_row(const std::vector<float>& bias, int slot, int rows) {
  return bias.empty() ? nullptr : bias.data() + size_t(slot) * packed_groups(rows) * kGroupRows;
}

// The layout that holds `count` canonical matrices (rows x k) of `src` exactly, where the format
// chooses by the data (FormatTraits::held_layouts); else the default, unused.
HeldLayout held_layout(const FormatTraits& format, const SourceProjection& src, size_t count, int rows, int k);
// Whether dst's layout holds canonical matrices [first, first + count) of `src` (a later part of a
// load): a check of each matrix on its own, so that workers may check a part's matrices between them.
bool holds(const FormatTraits& format, const PackedProjection& dst, const SourceProjection& src, size_t first,
           size_t count);

// Packs matrix `matrix` (rows x k) of the canonical source into expert `expert` of `dst`.
void pack_matrix(const FormatTraits& format, SourceProjection src, size_t matrix, PackedProjection& dst, int expert);

// A later part of a load that dst's layout cannot hold (holds is false): the slots packed so far
// (`packed`) are unpacked and held anew, with the part's matrices, in the layout that holds them all
// (what one load of them would choose), so that whether a valid layer loads never depends on which
// experts come first. The part's slots are left for the caller to pack. Formats that choose by the
// data only (they have no zero points).
void rehold(const FormatTraits& format, PackedProjection& dst, const std::vector<uint8_t>& packed,
            const SourceProjection& src, const int64_t* source_of_slot);

KT_NAMESPACE_END
