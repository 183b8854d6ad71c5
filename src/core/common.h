// Shared definitions for every translation unit of a variant module.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

// Each variant module compiles the same C++ with different ISA flags. An inline namespace named
// after the variant gives every type a distinct identity, so several variant modules can be loaded
// into one process (e.g. during a fallback) without their nanobind types colliding.
#ifndef KT_VARIANT_NS
#error "KT_VARIANT_NS must name the variant (set by CMakeLists.txt)"
#endif
#define KT_NAMESPACE_BEGIN namespace kt { inline namespace KT_VARIANT_NS {
#define KT_NAMESPACE_END } }

KT_NAMESPACE_BEGIN

using bf16_t = uint16_t;  // raw bfloat16 bits

constexpr size_t kCacheLine = 64;
// The largest hidden_size / moe_intermediate_size: sizes, strides and row offsets then stay far
// from int overflow (round_up, packed group counts, row * stride products).
constexpr int kMaxDimension = 1 << 24;

constexpr int round_up(int value, int multiple) { return (value + multiple - 1) / multiple * multiple; }
constexpr int ceil_div(int value, int divisor) { return (value + divisor - 1) / divisor; }

// Heap array aligned to a cache line. Contents are not preserved by reserve().
template <typename T>
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t count) { reserve(count); }

  // Makes room for at least `count` elements, reallocating only when it must grow.
  void reserve(size_t count) {
    if (count <= capacity_) return;
    size_t bytes = (count * sizeof(T) + kCacheLine - 1) / kCacheLine * kCacheLine;
    T* fresh = static_cast<T*>(std::aligned_alloc(kCacheLine, bytes));
    if (fresh == nullptr) throw std::bad_alloc();
    data_.reset(fresh);
    capacity_ = count;
  }
  void release() {
    data_.reset();
    capacity_ = 0;
  }
  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  size_t capacity() const { return capacity_; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  size_t capacity_ = 0;
};

KT_NAMESPACE_END
