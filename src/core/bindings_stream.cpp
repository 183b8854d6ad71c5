// The stream path's bindings (stream_calls.h): addresses in, addresses out. The Python wrapper
// (kt_kernel/stream_path.py) checks every tensor before it hands their addresses over.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cuda_runtime.h"
#include "engine.h"
#include "stream_calls.h"
#include "subpools.h"

namespace nb = nanobind;

namespace {

template <typename T>
T* address(uintptr_t value) {
  return reinterpret_cast<T*>(value);
}

}  // namespace

void bind_stream_calls(nb::module_& m) {
  m.def("cuda_runtime_path", [] { return kt::CudaRuntime::get().path(); },
        "Load the CUDA runtime (KT_KERNEL_CUDART, else the libcudart this process has loaded) and return its path; "
        "RuntimeError where there is none.");

  m.def("queue_fence", &kt::queue_fence, nb::arg("stream"), nb::call_guard<nb::gil_scoped_release>(),
        "Queue a fence on the stream and return its id (0: the stream is being captured, try later).");
  m.def("fence_passed", &kt::fence_passed, nb::arg("fence"), "Whether the stream has run the fence.");

  nb::class_<kt::StreamLayer>(m, "StreamLayer")
      .def_static(
          "create",
          [](kt::MoESubpools* layer, kt::MoESubpools* deferred, int num_experts, int hidden, int top_k) {
            return kt::StreamLayer::create(layer, deferred, num_experts, hidden, top_k);
          },
          nb::arg("layer"), nb::arg("deferred").none(), nb::arg("num_experts"), nb::arg("hidden"), nb::arg("top_k"),
          nb::rv_policy::reference,
          "The stream path of a layer. Never freed (host functions may run after the layer is gone): close() it.")
      .def(
          "submit",
          [](kt::StreamLayer& self, uintptr_t stream, int tokens, uintptr_t x, uintptr_t ids, bool ids_int32,
             uintptr_t weights, uintptr_t deferred_ids, uintptr_t slot_x, uintptr_t slot_ids, uintptr_t slot_weights,
             uintptr_t slot_deferred_ids, uintptr_t slot_out, uintptr_t slot_deferred_out, uintptr_t adds,
             uintptr_t gpu_mask) {
            kt::StreamInputs inputs;
            inputs.x = address<const void>(x), inputs.ids = address<const void>(ids);
            inputs.weights = address<const void>(weights), inputs.deferred_ids = address<const void>(deferred_ids);
            inputs.ids_int32 = ids_int32;
            inputs.gpu_mask = address<const uint8_t>(gpu_mask);
            kt::StreamSlot slot;
            slot.x = address<void>(slot_x), slot.ids = address<void>(slot_ids);
            slot.weights = address<void>(slot_weights), slot.deferred_ids = address<void>(slot_deferred_ids);
            slot.out = address<kt::bf16_t>(slot_out), slot.deferred_out = address<kt::bf16_t>(slot_deferred_out);
            return reinterpret_cast<uintptr_t>(self.submit(stream, tokens, inputs, slot, address<kt::StreamCall>(adds)));
          },
          nb::call_guard<nb::gil_scoped_release>(),
          "Queue the input copies and the host function that starts the task; returns the call's handle. "
          "gpu_mask: the address of num_experts bools, read each time the task starts (also at every replay of "
          "a CUDA graph): the caller keeps it alive (0: keep the engines' set).")
      .def(
          "sync",
          [](kt::StreamLayer& self, uintptr_t call, uintptr_t stream, uintptr_t device_out) {
            self.sync(address<kt::StreamCall>(call), stream, address<void>(device_out));
          },
          nb::call_guard<nb::gil_scoped_release>(),
          "Queue the host function that waits for the call, then the copy of its output to device_out.")
      .def(
          "drop_deferred",
          [](kt::StreamLayer& self, uintptr_t call, uintptr_t stream) {
            self.drop_deferred(address<kt::StreamCall>(call), stream);
          },
          nb::call_guard<nb::gil_scoped_release>(),
          "Queue the host function that waits for the call's deferred experts, which no later call adds.")
      .def("rethrow_error", &kt::StreamLayer::rethrow_error, "Raise the first error a host function met, once.")
      .def_prop_ro("outstanding", &kt::StreamLayer::outstanding)
      .def_prop_ro("queued", &kt::StreamLayer::queued)
      .def_prop_ro("completed", &kt::StreamLayer::completed)
      .def("close", &kt::StreamLayer::close, nb::call_guard<nb::gil_scoped_release>());
}
