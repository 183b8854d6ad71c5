#include "packed_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <memory>
#include <system_error>
#include <type_traits>
#include <vector>

KT_NAMESPACE_BEGIN
namespace {

#define KT_STRINGIFY_VALUE(x) #x
#define KT_STRINGIFY(x) KT_STRINGIFY_VALUE(x)
constexpr char kBuild[] = KT_STRINGIFY(KT_VARIANT_NS);  // build_avx2, build_amx_emulated, ...
constexpr char kMagic[8] = {'K', 'T', 'P', 'A', 'C', 'K', 'E', 'D'};
constexpr uint64_t kPage = 4096;
constexpr uint64_t kHugePage = uint64_t(2) << 20;
constexpr uint64_t kMaxMetaBytes = 1 << 20;

struct Section {
  uint64_t offset, bytes;
};

struct ProjectionEntry {
  int32_t rows, k, scale_group, has_zeros;
  uint64_t group_bytes, group_scale_bytes;
  // HeldLayout's fields; half: half_scales | half_factors << 1.
  uint8_t indexed, factored_scales, mins, e4m3_scales, half, multiple_bits, multiple_bias, value_bits;
  int8_t levels[kLevels];
  Section values, scales, zeros, factors;  // factors: each expert's fp32 (PackedProjection::factors)
};

struct FileHeader {
  char magic[8];
  uint32_t version, header_bytes;
  char build[32], format[32];
  int32_t num_experts, hidden, intermediate, reserved;
  ProjectionEntry projections[3];  // gate, up, down
  Section biases[3], packed, meta;
  uint64_t file_bytes;
  uint64_t content_checksum;  // of the packed experts' bytes and the biases
  uint64_t header_checksum;   // of this header (with this field 0), the packed mask and meta
};
static_assert(std::is_trivially_copyable_v<FileHeader> && sizeof(FileHeader) < kPage);

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// A 64-bit checksum of `bytes` continuing `seed`: four multiply-rotate lanes, about memory speed.
// It finds corruption (a flipped bit, a torn write, a zeroed page), not tampering.
uint64_t checksum(const uint8_t* data, size_t bytes, uint64_t seed) {
  constexpr uint64_t k1 = 0x9E3779B185EBCA87ull, k2 = 0xC2B2AE3D27D4EB4Full;
  uint64_t lane[4] = {seed + k1, seed ^ k2, rotl(seed, 17) + bytes, rotl(seed, 41) ^ k1};
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32)
    for (int l = 0; l < 4; ++l) {
      uint64_t word;
      std::memcpy(&word, data + i + 8 * l, 8);
      lane[l] = rotl(lane[l] ^ (word * k2), 31) * k1;
    }
  uint64_t h = bytes * k1 + seed;
  for (int l = 0; l < 4; ++l) h = rotl(h ^ lane[l], 27) * k1 + k2;
  for (; i < bytes; ++i) h = (h ^ data[i]) * 0x100000001B3ull;
  return h ^ (h >> 29);
}

uint64_t page_up(uint64_t bytes, uint64_t page = kPage) { return (bytes + page - 1) / page * page; }

// The bytes of each part of a file, and where the parts go: every section at a page boundary, one
// of 2 MiB or more at a 2 MiB boundary (the gaps are holes: no disk, no memory), so that written in
// one piece it can be held by 2 MiB folios and mapped by 2 MiB entries (map_on_huge_page_boundary).
struct Sizes {
  uint64_t values[3], scales[3], zeros[3], factors[3], biases[3], packed, meta;
};
struct Plan {
  Section values[3], scales[3], zeros[3], factors[3], biases[3], packed, meta;
  uint64_t file_bytes;
};

Plan plan(const Sizes& s) {
  Plan p{};
  uint64_t at = sizeof(FileHeader);
  auto place = [&at](Section& section, uint64_t bytes, bool page) {
    if (page) at = page_up(at, bytes >= kHugePage ? kHugePage : kPage);
    section = {at, bytes};
    at += bytes;
  };
  place(p.packed, s.packed, false);
  place(p.meta, s.meta, false);
  for (int i = 0; i < 3; ++i) {
    place(p.values[i], s.values[i], true);
    place(p.scales[i], s.scales[i], true);
    place(p.zeros[i], s.zeros[i], true);
    place(p.factors[i], s.factors[i], false);
  }
  for (int i = 0; i < 3; ++i) place(p.biases[i], s.biases[i], true);
  p.file_bytes = page_up(at);
  return p;
}

bool same(const Section& a, const Section& b) { return a.offset == b.offset && a.bytes == b.bytes; }

std::array<const PackedProjection*, 3> projections_of(const ExpertWeights& w) { return {&w.gate, &w.up, &w.down}; }
std::array<const std::vector<float>*, 3> biases_of(const ExpertWeights& w) {
  return {&w.gate_bias, &w.up_bias, &w.down_bias};
}

// The bytes of one slot of a projection's values (part 0), scales (1) or zero points (2).
uint64_t slot_bytes(const ProjectionEntry& p, int part) {
  return uint64_t(packed_groups(p.rows)) * (part == 0 ? p.group_bytes : p.group_scale_bytes);
}
Section part_of(const ProjectionEntry& p, int part) { return part == 0 ? p.values : part == 1 ? p.scales : p.zeros; }

// The content checksum: each packed slot's bytes of every part of every projection, then the biases.
uint64_t content_checksum(const FileHeader& h, const uint8_t* packed, const uint8_t* const parts[3][3],
                          const uint8_t* const biases[3], const uint8_t* const factors[3]) {
  uint64_t sum = 0;
  for (int p = 0; p < 3; ++p)
    for (int part = 0; part < 3; ++part) {
      const uint64_t bytes = slot_bytes(h.projections[p], part);
      if (part_of(h.projections[p], part).bytes == 0) continue;
      for (int slot = 0; slot < h.num_experts; ++slot)
        if (packed[slot]) sum = checksum(parts[p][part] + slot * bytes, bytes, sum);
    }
  for (int b = 0; b < 3; ++b)
    if (h.biases[b].bytes > 0) sum = checksum(biases[b], h.biases[b].bytes, sum);
  for (int p = 0; p < 3; ++p) sum = checksum(factors[p], h.projections[p].factors.bytes, sum);
  return sum;
}

uint64_t header_checksum(FileHeader h, const uint8_t* packed, const uint8_t* meta) {
  h.header_checksum = 0;
  uint64_t sum = checksum(reinterpret_cast<const uint8_t*>(&h), sizeof(h), 0);
  sum = checksum(packed, h.packed.bytes, sum);
  return checksum(meta, h.meta.bytes, sum);
}

// A file being written: pwrite at offsets; on any failure the file is closed and removed, and
// std::system_error names it.
class NewFile {
 public:
  explicit NewFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "cannot create " + path);
  }
  ~NewFile() {
    if (fd_ >= 0) abandon(0);
  }
  void write(const void* data, size_t bytes, uint64_t offset) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    while (bytes > 0) {
      const ssize_t done = ::pwrite(fd_, p, bytes, off_t(offset));
      if (done < 0 && errno == EINTR) continue;
      if (done <= 0) fail("cannot write");
      p += done, bytes -= size_t(done), offset += uint64_t(done);
    }
  }
  void finish(uint64_t file_bytes) {
    if (::ftruncate(fd_, off_t(file_bytes)) != 0) fail("cannot size");
    if (::fsync(fd_) != 0) fail("cannot sync");
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
      const int error = errno;
      ::unlink(path_.c_str());
      throw std::system_error(error, std::generic_category(), "cannot close " + path_);
    }
  }

 private:
  [[noreturn]] void fail(const char* what) {
    const int error = errno != 0 ? errno : EIO;
    abandon(error);
    throw std::system_error(error, std::generic_category(), std::string(what) + " " + path_);
  }
  void abandon(int) {
    ::close(fd_);
    fd_ = -1;
    ::unlink(path_.c_str());
  }
  std::string path_;
  int fd_ = -1;
};

// The file mapped read-only at a 2 MiB boundary, so that file offsets and addresses agree modulo
// 2 MiB: where the page cache holds the file in 2 MiB folios (large folios: Linux 6.x on ext4, xfs,
// tmpfs), the kernel can map each by one page-table entry, as the packed weights' huge pages are.
// MADV_HUGEPAGE asks it to read such folios from disk (best effort: older kernels ignore it).
void* map_on_huge_page_boundary(int fd, size_t bytes) {
  constexpr size_t kHuge = kHugePage;
  void* room = ::mmap(nullptr, bytes + kHuge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (room == MAP_FAILED) return MAP_FAILED;
  const uintptr_t start = reinterpret_cast<uintptr_t>(room);
  const uintptr_t aligned = (start + kHuge - 1) & ~uintptr_t(kHuge - 1);
  void* base = ::mmap(reinterpret_cast<void*>(aligned), bytes, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
  const int error = errno;
  if (base == MAP_FAILED) {
    ::munmap(room, bytes + kHuge);
    errno = error;
    return MAP_FAILED;
  }
  // The room around the file's mapping is given back.
  if (aligned > start) ::munmap(room, aligned - start);
  const uintptr_t end = aligned + page_up(bytes), room_end = start + bytes + kHuge;
  if (room_end > end) ::munmap(reinterpret_cast<void*>(end), room_end - end);
  ::madvise(base, bytes, MADV_HUGEPAGE);
  return base;
}

// The file's pages, unmapped when the last view of them goes.
struct Mapping {
  void* base;
  size_t bytes;
  Mapping(void* b, size_t n) : base(b), bytes(n) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { ::munmap(base, bytes); }
};

void copy_name(char (&dst)[32], const char* name) { std::strncpy(dst, name, sizeof(dst) - 1); }
std::string name_of(const char (&src)[32]) { return std::string(src, strnlen(src, sizeof(src))); }

// The expected rows and inputs of projection p (gate, up, down) of an engine of `shape`.
std::array<int, 2> dims_of(const MoEShape& shape, int p) {
  return p == 2 ? std::array<int, 2>{shape.hidden, shape.intermediate}
                : std::array<int, 2>{shape.intermediate, shape.hidden};
}

// Why projection entry `e` (p: gate, up, down) cannot be `format`'s layout for `shape`, or "".
std::string check_projection(const ProjectionEntry& e, int p, const MoEShape& shape, const FormatTraits& format,
                             HeldLayout* held) {
  static const char* const names[3] = {"gate", "up", "down"};
  const std::string what = std::string(names[p]) + ": ";
  const auto [rows, k] = dims_of(shape, p);
  if (e.rows != rows || e.k != k) return what + "another shape";
  bool group_ok = !format.has_scales() && e.scale_group == 0;
  for (int group : format.allowed_scale_groups()) group_ok = group_ok || group == e.scale_group;
  if (!group_ok || (e.scale_group > 0 && k % e.scale_group != 0)) return what + "a scale group the format lacks";
  if (e.has_zeros != 0 && (e.has_zeros != 1 || !format.has_zero_points())) return what + "zero points the format lacks";
  *held = HeldLayout{};
  if (format.held_layouts != nullptr) {
    held->value_bits = e.value_bits;
    held->factored_scales = e.factored_scales != 0;
    held->mins = e.mins != 0;
    held->e4m3_scales = e.e4m3_scales != 0;
    held->half_scales = (e.half & 1) != 0;
    held->half_factors = (e.half & 2) != 0;
    held->multiple_bits = e.multiple_bits;
    held->multiple_bias = e.multiple_bias;
    std::memcpy(held->levels.data(), e.levels, kLevels);
    // Planes: levels[0] alone (their offset).
    const bool planes = e.value_bits == 2 || e.value_bits == 3 || e.value_bits == 5 || e.value_bits == 6;
    if ((e.value_bits != 8 && e.value_bits != 4 && !planes) || e.indexed != (e.value_bits == 4) ||
        (planes && std::any_of(e.levels + 1, e.levels + kLevels, [](int8_t l) { return l != 0; })) ||
        (e.value_bits == 5 && e.scale_group % 32 != 0))
      return what + "a value layout the format lacks";
    const bool six = e.multiple_bits == 6 && (e.multiple_bias == 0 || e.multiple_bias == 32);
    const bool unbiased = (e.multiple_bits == 4 || e.multiple_bits == 8) && e.multiple_bias == 0;
    if (e.half > 3 || !(six || unbiased))
      return what + "a scale layout the format lacks";
  } else {
    static const int8_t none[kLevels] = {};
    if (e.indexed != 0 || e.factored_scales != 0 || e.mins != 1 || e.e4m3_scales != 0 || e.value_bits != 8 ||
        e.half != 0 || e.multiple_bits != 8 || e.multiple_bias != 0 || std::memcmp(e.levels, none, kLevels) != 0)
      return what + "a held layout the format lacks";
  }
  const HeldLayouts* layouts = format.held_layouts;
  const size_t group_bytes = layouts ? layouts->group_bytes(*held, k) : format.group_bytes(k);
  const size_t scale_bytes =
      layouts ? layouts->group_scale_bytes(*held, k, e.scale_group) : format.group_scale_bytes(k, e.scale_group);
  if (e.group_bytes != group_bytes || e.group_scale_bytes != scale_bytes)
    return what + "group sizes that are not this build's layout";
  return "";
}

}  // namespace

void write_packed_file(const std::string& path, const ExpertWeights& w, const MoEShape& shape,
                       const FormatTraits& format, const std::string& meta) {
  const int E = shape.num_experts;
  FileHeader h;
  std::memset(&h, 0, sizeof(h));  // padding too: the header checksum covers every byte
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kPackedFileVersion;
  h.header_bytes = sizeof(FileHeader);
  copy_name(h.build, kBuild);
  copy_name(h.format, format.name);
  h.num_experts = E, h.hidden = shape.hidden, h.intermediate = shape.intermediate;
  Sizes sizes{};
  const auto projections = projections_of(w);
  const auto biases = biases_of(w);
  for (int p = 0; p < 3; ++p) {
    const PackedProjection& src = *projections[p];
    ProjectionEntry& e = h.projections[p];
    e.rows = src.rows, e.k = src.k, e.scale_group = src.scale_group, e.has_zeros = src.has_zeros;
    e.group_bytes = src.group_bytes, e.group_scale_bytes = src.group_scale_bytes;
    e.indexed = src.held.value_bits == 4, e.value_bits = src.held.value_bits;
    e.factored_scales = src.held.factored_scales, e.mins = src.held.mins;
    e.e4m3_scales = src.held.e4m3_scales;
    e.half = uint8_t(src.held.half_scales | src.held.half_factors << 1);
    e.multiple_bits = src.held.multiple_bits, e.multiple_bias = src.held.multiple_bias;
    std::memcpy(e.levels, src.held.levels.data(), kLevels);
    sizes.values[p] = uint64_t(E) * src.expert_value_bytes();
    sizes.scales[p] = uint64_t(E) * src.expert_scale_bytes();
    sizes.zeros[p] = src.has_zeros ? sizes.scales[p] : 0;
    sizes.factors[p] = uint64_t(E) * sizeof(float);
    sizes.biases[p] = biases[p]->size() * sizeof(float);
  }
  sizes.packed = uint64_t(E);
  sizes.meta = meta.size();
  if (sizes.meta > kMaxMetaBytes) throw std::invalid_argument("packed-file meta bytes over 1 MiB");
  const Plan layout = plan(sizes);
  for (int p = 0; p < 3; ++p) {
    h.projections[p].values = layout.values[p];
    h.projections[p].scales = layout.scales[p];
    h.projections[p].zeros = layout.zeros[p];
    h.projections[p].factors = layout.factors[p];
    h.biases[p] = layout.biases[p];
  }
  h.packed = layout.packed, h.meta = layout.meta, h.file_bytes = layout.file_bytes;

  NewFile file(path);
  const uint8_t* parts[3][3];
  const uint8_t* bias_data[3];
  const uint8_t* factor_data[3];
  for (int p = 0; p < 3; ++p) {
    const PackedProjection& src = *projections[p];
    parts[p][0] = src.values.data(), parts[p][1] = src.scales.data(), parts[p][2] = src.zeros.data();
    bias_data[p] = reinterpret_cast<const uint8_t*>(biases[p]->data());
    factor_data[p] = reinterpret_cast<const uint8_t*>(src.factors.data());
    file.write(factor_data[p], h.projections[p].factors.bytes, h.projections[p].factors.offset);
    for (int part = 0; part < 3; ++part) {
      const Section section = part_of(h.projections[p], part);
      const uint64_t bytes = slot_bytes(h.projections[p], part);
      if (section.bytes == 0) continue;
      for (int slot = 0; slot < E;) {  // each run of packed slots in one write; the others stay holes
        int end = slot;
        while (end < E && w.packed[end]) ++end;
        const uint64_t at = slot * bytes;
        if (end > slot) file.write(parts[p][part] + at, (end - slot) * bytes, section.offset + at);
        slot = end + 1;
      }
    }
    if (h.biases[p].bytes > 0) file.write(bias_data[p], h.biases[p].bytes, h.biases[p].offset);
  }
  file.write(w.packed.data(), E, h.packed.offset);
  file.write(meta.data(), meta.size(), h.meta.offset);
  h.content_checksum = content_checksum(h, w.packed.data(), parts, bias_data, factor_data);
  h.header_checksum = header_checksum(h, w.packed.data(), reinterpret_cast<const uint8_t*>(meta.data()));
  file.write(&h, sizeof(h), 0);
  file.finish(h.file_bytes);
}

std::string map_packed_file(const std::string& path, ExpertWeights& w, const MoEShape& shape,
                            const FormatTraits& format, bool verify_content, std::string* meta) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return std::string("cannot open it (") + std::strerror(errno) + ")";
  struct stat status;
  if (::fstat(fd, &status) != 0 || !S_ISREG(status.st_mode)) {
    ::close(fd);
    return "not a regular file";
  }
  const uint64_t size = uint64_t(status.st_size);
  if (size < sizeof(FileHeader)) {
    ::close(fd);
    return std::to_string(size) + " bytes, shorter than a header";
  }
  void* base = map_on_huge_page_boundary(fd, size);
  const int map_error = errno;
  ::close(fd);
  if (base == MAP_FAILED) return std::string("cannot map it (") + std::strerror(map_error) + ")";
  const auto mapping = std::make_shared<Mapping>(base, size);  // unmapped on return unless viewed
  const uint8_t* bytes = static_cast<const uint8_t*>(base);
  FileHeader h;
  std::memcpy(&h, bytes, sizeof(h));

  const int E = shape.num_experts;
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) return "not a packed-experts file (magic)";
  if (h.version != kPackedFileVersion)
    return "layout version " + std::to_string(h.version) + ", this build's is " + std::to_string(kPackedFileVersion);
  if (h.header_bytes != sizeof(FileHeader)) return "another header size";
  if (h.file_bytes != size)
    return std::to_string(size) + " bytes where its header says " + std::to_string(h.file_bytes) + " (truncated?)";
  auto inside = [size](const Section& s) { return s.offset <= size && s.bytes <= size - s.offset; };
  if (h.num_experts != E || h.packed.bytes != uint64_t(E) || h.meta.bytes > kMaxMetaBytes || !inside(h.packed) ||
      !inside(h.meta))
    return "another number of experts, or a damaged header";
  const uint8_t* packed = bytes + h.packed.offset;
  if (header_checksum(h, packed, bytes + h.meta.offset) != h.header_checksum) return "header checksum mismatch";
  if (name_of(h.build) != kBuild) return "written by build " + name_of(h.build) + ", this is " + kBuild;
  if (name_of(h.format) != format.name) return "holds " + name_of(h.format) + " weights, not " + format.name;
  if (h.hidden != shape.hidden || h.intermediate != shape.intermediate) return "another hidden or intermediate size";

  std::array<HeldLayout, 3> held;
  Sizes sizes{};
  for (int p = 0; p < 3; ++p) {
    const ProjectionEntry& e = h.projections[p];
    const std::string problem = check_projection(e, p, shape, format, &held[p]);
    if (!problem.empty()) return problem;
    sizes.values[p] = uint64_t(E) * slot_bytes(e, 0);
    sizes.scales[p] = uint64_t(E) * slot_bytes(e, 1);
    sizes.zeros[p] = e.has_zeros ? sizes.scales[p] : 0;
    sizes.factors[p] = uint64_t(E) * sizeof(float);
    const uint64_t bias_bytes = uint64_t(E) * packed_groups(e.rows) * kGroupRows * sizeof(float);
    if (h.biases[p].bytes != 0 && h.biases[p].bytes != bias_bytes) return "biases of another size";
    sizes.biases[p] = h.biases[p].bytes;
  }
  sizes.packed = uint64_t(E), sizes.meta = h.meta.bytes;
  const Plan layout = plan(sizes);
  bool placed = layout.file_bytes == h.file_bytes && same(layout.packed, h.packed) && same(layout.meta, h.meta);
  for (int p = 0; p < 3; ++p)
    placed = placed && same(layout.values[p], h.projections[p].values) &&
             same(layout.scales[p], h.projections[p].scales) && same(layout.zeros[p], h.projections[p].zeros) &&
             same(layout.factors[p], h.projections[p].factors) && same(layout.biases[p], h.biases[p]);
  if (!placed) return "sections that are not where the layout puts them";
  for (int slot = 0; slot < E; ++slot) {
    if (packed[slot] > 1) return "a damaged packed mask";
    if (!packed[slot] && !w.skip[slot])
      return "expert " + std::to_string(slot) + " is not in the file and the engine computes it";
  }
  const uint8_t* parts[3][3];
  const uint8_t* bias_data[3];
  const uint8_t* factor_data[3];
  for (int p = 0; p < 3; ++p) {
    for (int part = 0; part < 3; ++part) parts[p][part] = bytes + part_of(h.projections[p], part).offset;
    bias_data[p] = bytes + h.biases[p].offset;
    factor_data[p] = bytes + h.projections[p].factors.offset;
  }
  if (verify_content && content_checksum(h, packed, parts, bias_data, factor_data) != h.content_checksum)
    return "content checksum mismatch (the weights changed on disk)";

  // Checked: the engine's weights become views of the file.
  const auto projections = std::array<PackedProjection*, 3>{&w.gate, &w.up, &w.down};
  const auto biases = std::array<std::vector<float>*, 3>{&w.gate_bias, &w.up_bias, &w.down_bias};
  for (int p = 0; p < 3; ++p) {
    const ProjectionEntry& e = h.projections[p];
    PackedProjection& dst = *projections[p];
    dst.rows = e.rows, dst.k = e.k, dst.scale_group = e.scale_group, dst.has_zeros = e.has_zeros != 0;
    dst.group_bytes = e.group_bytes, dst.group_scale_bytes = e.group_scale_bytes;
    dst.held = held[p];
    dst.values.view(parts[p][0], e.values.bytes, mapping);
    dst.scales.view(parts[p][1], e.scales.bytes, mapping);
    if (dst.has_zeros)
      dst.zeros.view(parts[p][2], e.zeros.bytes, mapping);
    else
      dst.zeros.release();
    dst.factors.resize(E);
    std::memcpy(dst.factors.data(), factor_data[p], h.projections[p].factors.bytes);
    const float* bias = reinterpret_cast<const float*>(bias_data[p]);
    biases[p]->assign(bias, bias + h.biases[p].bytes / sizeof(float));
  }
  w.packed.assign(packed, packed + E);
  w.loaded = w.ready();
  meta->assign(reinterpret_cast<const char*>(bytes + h.meta.offset), h.meta.bytes);
  return "";
}

KT_NAMESPACE_END
