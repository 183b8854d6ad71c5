#include "cuda_runtime.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>

KT_NAMESPACE_BEGIN

namespace {

constexpr int kCudaMemcpyDefault = 4;  // cudaMemcpyKind: the direction follows from the addresses

// The file name of a libcudart already mapped into this process ("" if none).
std::string loaded_cudart() {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        const char* name = info->dlpi_name;
        const char* base = name ? std::strrchr(name, '/') : nullptr;
        if (name && std::strstr(base ? base : name, "libcudart.so")) {
          *static_cast<std::string*>(out) = name;
          return 1;
        }
        return 0;
      },
      &found);
  return found;
}

template <typename Fn>
Fn symbol(void* library, const char* name, const std::string& path) {
  void* address = dlsym(library, name);
  if (!address) throw std::runtime_error("the CUDA runtime " + path + " has no " + name);
  return reinterpret_cast<Fn>(address);
}

}  // namespace

CudaRuntime::CudaRuntime(const std::string& path) : path_(path) {
  // Never closed: host functions it runs may call back into this module until the process ends.
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!library) throw std::runtime_error("cannot load the CUDA runtime " + path + ": " + dlerror());
  launch_host_func_ = symbol<decltype(launch_host_func_)>(library, "cudaLaunchHostFunc", path);
  memcpy_async_ = symbol<decltype(memcpy_async_)>(library, "cudaMemcpyAsync", path);
  stream_is_capturing_ = symbol<decltype(stream_is_capturing_)>(library, "cudaStreamIsCapturing", path);
  error_string_ = symbol<decltype(error_string_)>(library, "cudaGetErrorString", path);
}

const CudaRuntime& CudaRuntime::get() {
  static std::mutex mutex;
  static std::unique_ptr<CudaRuntime> runtime;  // released at exit only after every host function ran
  std::lock_guard<std::mutex> lock(mutex);
  if (runtime) return *runtime;
  const char* named = std::getenv("KT_KERNEL_CUDART");
  std::string path = named && *named ? named : loaded_cudart();
  if (path.empty())
    throw std::runtime_error(
        "cuda_stream was given, but this process has no CUDA runtime loaded (is torch built with CUDA?) and "
        "KT_KERNEL_CUDART does not name one");
  runtime.reset(new CudaRuntime(path));
  return *runtime;
}

void CudaRuntime::check(int status, const char* what) const {
  if (status != 0)
    throw std::runtime_error(std::string(what) + " failed: " + error_string_(status) + " (CUDA error " +
                             std::to_string(status) + ")");
}

void CudaRuntime::launch_host_func(Stream stream, HostFn fn, void* data) const {
  check(launch_host_func_(stream, fn, data), "cudaLaunchHostFunc");
}

void CudaRuntime::copy_async(void* dst, const void* src, size_t bytes, Stream stream) const {
  check(memcpy_async_(dst, src, bytes, kCudaMemcpyDefault, stream), "cudaMemcpyAsync");
}

bool CudaRuntime::capturing(Stream stream) const {
  int status = 0;
  check(stream_is_capturing_(stream, &status), "cudaStreamIsCapturing");
  return status != 0;
}

KT_NAMESPACE_END
