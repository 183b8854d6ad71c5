// The CUDA runtime, found at run time. The package is compiled without CUDA: libcudart is loaded
// (dlopen) only when a caller hands a forward a CUDA stream, and only the few entry points the
// stream path uses are taken from it (dlsym).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common.h"

KT_NAMESPACE_BEGIN

class CudaRuntime {
 public:
  using Stream = void*;  // cudaStream_t
  using HostFn = void (*)(void*);

  // Queues fn(data) on `stream` (cudaLaunchHostFunc): it runs once the work queued before it is done.
  void launch_host_func(Stream stream, HostFn fn, void* data) const;
  // Queues a copy of `bytes` bytes on `stream` (cudaMemcpyAsync, cudaMemcpyDefault: either side host or device).
  void copy_async(void* dst, const void* src, size_t bytes, Stream stream) const;
  // Whether `stream` is being captured into a CUDA graph (cudaStreamIsCapturing).
  bool capturing(Stream stream) const;
  const std::string& path() const { return path_; }

  // The process's runtime, loaded on first use: the library KT_KERNEL_CUDART names if set, else the
  // libcudart this process has already loaded (torch's). Throws std::runtime_error saying why none
  // could be found; tries again on the next call.
  static const CudaRuntime& get();

 private:
  explicit CudaRuntime(const std::string& path);
  void check(int status, const char* what) const;

  std::string path_;
  int (*launch_host_func_)(Stream, HostFn, void*) = nullptr;
  int (*memcpy_async_)(void*, const void*, size_t, int, Stream) = nullptr;
  int (*stream_is_capturing_)(Stream, int*) = nullptr;
  const char* (*error_string_)(int) = nullptr;
};

KT_NAMESPACE_END
