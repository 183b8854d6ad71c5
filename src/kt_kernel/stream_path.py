"""Forwards ordered on a caller's CUDA stream: SGLang's GPU path (``submit_forward(..., cuda_stream)``).

Per call, on the caller's stream: the inputs are copied into host buffers (pinned where torch has
CUDA), a host function (``cudaLaunchHostFunc``) hands the CPU task to the worker threads, and at sync
a host function waits for it before the output is copied into a device buffer. Everything is queued,
nothing waits on the host, so the GPU work the caller queues between submit and sync overlaps the
CPU task, and a CUDA graph that captures the calls replays them. The CUDA runtime is loaded only
here, at the first call with a stream (``ext.cuda_runtime_path``): the extension is compiled
without CUDA.

Buffers are shared by every layer, as upstream's: host buffers are taken per call from a pool per
batch size and given back at sync, which is safe because everything that uses them is ordered on
the stream; device outputs are kept per (device, batch size, layer parity), so the output a sync
returns stays valid until the sync of the same batch size two layers later. Calls on several
streams share them too (a CUDA graph is captured on a stream of its own): the caller orders such
streams (wait_stream), as SGLang's one forward stream does.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ._native import ext


def stream_handle(cuda_stream: object, hidden_states: object) -> int | None:
    """The stream a call runs on: ``cuda_stream`` as an int handle (SGLang passes
    ``torch.cuda.current_stream().cuda_stream``) or a ``torch.cuda.Stream``; without one, CUDA
    inputs run on their device's current stream. None (the direct path): CPU inputs without a
    stream, or with one where no CUDA runtime can exist (torch without CUDA and KT_KERNEL_CUDART
    unset: the stream can order nothing, and such calls always ran directly)."""
    device = getattr(hidden_states, "device", None)
    on_gpu = isinstance(device, torch.device) and device.type == "cuda"
    if cuda_stream is None:
        return torch.cuda.current_stream(device).cuda_stream if on_gpu else None
    handle = cuda_stream if isinstance(cuda_stream, int) else getattr(cuda_stream, "cuda_stream", None)
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise TypeError(
            "cuda_stream must be an int stream handle or a torch.cuda.Stream, got "
            f"{type(cuda_stream).__name__}"
        )
    if not 0 <= handle < 2**64:
        raise ValueError(f"cuda_stream = {handle} is not a stream handle")
    if not on_gpu and not os.environ.get("KT_KERNEL_CUDART") and not torch.cuda.is_available():
        return None
    return handle


def as_engine_reads(x: object, ids: object, weights: object) -> bool:
    """Whether the inputs need no torch operation before their copies: contiguous bf16 x, int32 or
    int64 ids, float32 weights (anything else, malformed inputs included, goes the checked way)."""
    return (
        isinstance(x, torch.Tensor) and isinstance(ids, torch.Tensor) and isinstance(weights, torch.Tensor)
        and x.dtype == torch.bfloat16 and ids.dtype in (torch.int32, torch.int64)
        and weights.dtype == torch.float32
        and x.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()
    )  # fmt: skip


_external_streams: dict[tuple[int, torch.device], Any] = {}


@contextlib.contextmanager
def on_stream(handle: int, device: torch.device) -> Iterator[None]:
    """torch operations on CUDA tensors inside this block are queued on stream ``handle``."""
    if device.type != "cuda":
        yield
        return
    key = (handle, device)
    stream = _external_streams.get(key)
    if stream is None:
        stream = _external_streams[key] = torch.cuda.ExternalStream(handle, device=device)
    with torch.cuda.stream(stream):
        yield


@dataclass
class Slot:
    """The host buffers of one call (stream_calls.h: StreamSlot)."""

    x: torch.Tensor  # bf16 [T, H]
    ids: torch.Tensor  # int64 [T, K] (int32 ids use its first half)
    weights: torch.Tensor  # float32 [T, K]
    out: torch.Tensor  # bf16 [T, H]
    deferred_ids: torch.Tensor | None = None  # int64 [T, K]
    deferred_out: torch.Tensor | None = None  # bf16 [T, H]


def _host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # Pinned memory makes the copies asynchronous and capturable; without CUDA (the stand-in runtime
    # of the tests) plain memory does.
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


class StreamBuffers:
    """The process's host slots and device outputs, shared by every layer (see the module doc)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._free: dict[tuple, list[Slot]] = {}
        self._outputs: dict[tuple, torch.Tensor] = {}
        self._retired: list[Slot] = []  # slots queued copies may still write (a layer closed mid-call)

    def acquire(self, tokens: int, hidden: int, top_k: int, deferred: bool) -> Slot:
        with self.lock:
            free = self._free.get((tokens, hidden, top_k))
            slot = free.pop() if free else None
        if slot is None:
            slot = Slot(
                _host((tokens, hidden), torch.bfloat16), _host((tokens, top_k), torch.int64),
                _host((tokens, top_k), torch.float32), _host((tokens, hidden), torch.bfloat16),
            )  # fmt: skip
        if deferred and slot.deferred_ids is None:
            slot.deferred_ids = _host((tokens, top_k), torch.int64)
            slot.deferred_out = _host((tokens, hidden), torch.bfloat16)
        return slot

    def release(self, slot: Slot) -> None:
        tokens, hidden = slot.x.shape
        with self.lock:
            self._free.setdefault((tokens, hidden, slot.ids.shape[1]), []).append(slot)

    def retire(self, slot: Slot) -> None:
        with self.lock:
            self._retired.append(slot)

    def output(self, tokens: int, hidden: int, device: torch.device, parity: int) -> torch.Tensor:
        key = (tokens, hidden, device, parity)
        out = self._outputs.get(key)
        if out is None:
            with self.lock:
                out = self._outputs.setdefault(
                    key, torch.empty((tokens, hidden), dtype=torch.bfloat16, device=device)
                )
        return out

    def prepare(
        self, sizes: list[int], hidden: int, top_k: int, device: torch.device, deferred: bool
    ) -> None:
        """Allocate ahead what calls of these batch sizes use (allocating while a CUDA graph is
        captured may fail): one slot (two with deferred experts) and both device outputs each."""
        for tokens in sizes:
            slots = [self.acquire(tokens, hidden, top_k, deferred) for _ in range(1 + deferred)]
            for slot in slots:
                self.release(slot)
            for parity in (0, 1):
                self.output(tokens, hidden, device, parity)

    def clear(self) -> None:
        with self.lock:
            self._free.clear()
            self._outputs.clear()
            self._retired.clear()

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()


BUFFERS = StreamBuffers()


@dataclass
class StreamCall:
    """A call submitted on a stream and not yet synced (KTMoEWrapper._in_flight)."""

    stream: int
    handle: int  # the C++ StreamCall
    tokens: int
    device: torch.device
    slot: Slot | None
    adds: StreamCall | None  # the call of the layer before whose deferred output this one adds
    deferred: bool


class StreamForward:
    """One layer's stream path: its C++ StreamLayer and the host tensors its queued copies read."""

    def __init__(self, layer: Any, deferred_layer: Any, num_experts: int, hidden: int, top_k: int,
                 parity: int) -> None:  # fmt: skip
        self.layer = ext.StreamLayer.create(layer, deferred_layer, num_experts, hidden, top_k)
        self.hidden, self.top_k, self.parity = hidden, top_k, parity
        self._prepared: set[torch.device] = set()
        # Host inputs a queued copy still reads, with the queued() count that makes them free.
        self._keep_alive: collections.deque[tuple[int, tuple[torch.Tensor, ...]]] = collections.deque()

    def submit(self, stream: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               deferred_ids: torch.Tensor | None, adds: StreamCall | None,
               capture_sizes: list[int], gpu_mask_address: int) -> StreamCall:  # fmt: skip
        """Queue the call (inputs checked, contiguous, on one device: x bf16, ids int64 or int32,
        weights float32, deferred_ids int64); the GPU-expert mask is read now, from its address."""
        tokens, device = x.shape[0], x.device
        if device not in self._prepared:
            BUFFERS.prepare(capture_sizes, self.hidden, self.top_k, device, deferred_ids is not None)
            self._prepared.add(device)
        slot = BUFFERS.acquire(tokens, self.hidden, self.top_k, deferred_ids is not None)
        deferred_address = 0 if deferred_ids is None else deferred_ids.data_ptr()
        try:
            handle = self.layer.submit(
                stream, tokens, x.data_ptr(), ids.data_ptr(), ids.dtype == torch.int32, weights.data_ptr(),
                deferred_address, slot.x.data_ptr(), slot.ids.data_ptr(), slot.weights.data_ptr(),
                0 if slot.deferred_ids is None else slot.deferred_ids.data_ptr(), slot.out.data_ptr(),
                0 if slot.deferred_out is None else slot.deferred_out.data_ptr(),
                0 if adds is None else adds.handle, gpu_mask_address,
            )  # fmt: skip
        except BaseException:
            BUFFERS.retire(slot)  # copies queued before the failure may still write it
            raise
        if device.type == "cpu":  # no caching allocator orders their reuse after the copies
            done = self.layer.completed
            while self._keep_alive and self._keep_alive[0][0] <= done:
                self._keep_alive.popleft()
            self._keep_alive.append((self.layer.queued, (x, ids, weights, deferred_ids)))
        return StreamCall(stream, handle, tokens, device, slot, adds, deferred_ids is not None)

    def sync(self, call: StreamCall) -> torch.Tensor:
        """Queue the wait and the output copy; returns the device output. Raises the first error a
        host function of this layer met (of this call or an earlier one)."""
        out = BUFFERS.output(call.tokens, self.hidden, call.device, self.parity)
        try:
            self.layer.sync(call.handle, call.stream, out.data_ptr())
        except BaseException:
            BUFFERS.retire(call.slot)  # the call's copies were queued: the slot stays theirs
            raise
        # Whatever reuses these slots next is queued after this sync on the same stream.
        if not call.deferred:  # else held until the call that adds its deferred output syncs
            BUFFERS.release(call.slot)
        if call.adds is not None:
            BUFFERS.release(call.adds.slot)
        self.layer.rethrow_error()
        return out

    def close(self, in_flight: StreamCall | None) -> None:
        """Stop the layer's host functions (a CPU task in flight finishes); keep every slot a queued
        copy may still write."""
        self.layer.close()
        if in_flight is not None:
            BUFFERS.retire(in_flight.slot)
