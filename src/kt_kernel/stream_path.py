"""Forwards ordered on a caller's CUDA stream: SGLang's GPU path (``submit_forward(..., cuda_stream)``).

Per call, on the caller's stream: the inputs are copied into host buffers (pinned where torch has
CUDA), a host function (``cudaLaunchHostFunc``) hands the CPU task to the worker threads, and at sync
a host function waits for it before the output is copied into a device buffer. Everything is queued,
nothing waits on the host, so the GPU work the caller queues between submit and sync overlaps the
CPU task, and a CUDA graph that captures the calls replays them. The CUDA runtime is loaded only
here, at the first call with a stream (``ext.cuda_runtime_path``): the extension is compiled
without CUDA.

Buffers live in stream order (docs/serving.md, "Buffers on a stream"):
- host slots (a call's inputs and output on the host) come from a pool per batch size shared by
  every layer, taken at submit and given back at sync: whatever takes a slot next queues its copies
  after that sync on the stream, so nothing is overwritten early (calls on several streams: the
  caller orders the streams, as SGLang's wait_stream does);
- device outputs are a pair per (thread, batch size, device), used in turn: the tensor a sync
  returns holds its output until the second next sync of that batch size on the same thread, so
  two threads driving their own stacks on one stream never share an output;
- a buffer that queued work may still use (a closed layer's, a dropped deferral's, everything
  clear_buffer_cache lets go) is never freed at once: it is retired with a fence queued behind that
  work on each stream it was used on, and freed once every fence has passed.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import deferred
from ._native import ext
from .arguments import check_call_inputs


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


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """A host buffer (pinned where torch has CUDA: the copies are then asynchronous and capturable;
    without CUDA, the stand-in runtime of the tests, plain memory does) or a device output."""
    try:
        if device is not None:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
        size = torch.Size(shape).numel() * dtype.itemsize
        where = "host" if device is None else str(device)
        raise MemoryError(
            f"the stream path cannot allocate a {where} buffer of {size} bytes: {error}"
        ) from None


class Retired:
    """Buffers queued work may still use, each kept until a fence behind that work has passed on
    every stream it was used on (stream_calls.h: queue_fence)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # [buffers, {stream: fence id, or 0 while the stream was being captured}]
        self._entries: list[tuple[object, dict[int, int]]] = []

    def add(self, buffers: object, streams: set[int]) -> None:
        if not streams:
            return  # never queued anywhere
        fences = {stream: self._fence(stream) for stream in streams}
        with self.lock:
            self._entries.append((buffers, fences))

    @staticmethod
    def _fence(stream: int) -> int:
        try:
            return ext.queue_fence(stream)
        except RuntimeError:
            return 0  # the runtime refused it now: tried again at the next collect

    def collect(self) -> None:
        """Free what every fence lets go; fence again where a stream was being captured."""
        if not self._entries:  # the usual case, at every submit: no lock taken
            return
        with self.lock:
            kept = []
            for buffers, fences in self._entries:
                for stream, fence in fences.items():
                    if fence == 0:
                        fences[stream] = self._fence(stream)
                if not all(fence and ext.fence_passed(fence) for fence in fences.values()):
                    kept.append((buffers, fences))
            self._entries = kept


def keep_forever(buffers: object) -> None:
    """At interpreter exit: a stream may still run queued copies after Python has gone, so what they
    may touch is never freed (one reference more, taken at the C level, that nothing gives back)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(buffers))


class StreamBuffers:
    """The process's host slots and device outputs (see the module doc)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._free: dict[tuple, list[Slot]] = {}
        self._outputs: dict[tuple, list[torch.Tensor]] = {}  # (thread, T, H, device) -> the pair
        self._turns: dict[tuple, int] = {}  # which of the pair the next sync takes
        self.streams: set[int] = set()  # every stream the buffers above were used on
        self.generation = 0  # increased by clear(): what was prepared ahead is gone
        self.retired = Retired()

    def acquire(self, tokens: int, hidden: int, top_k: int, deferred: bool) -> Slot:
        with self.lock:
            free = self._free.get((tokens, hidden, top_k))
            slot = free.pop() if free else None
        if slot is None:
            slot = Slot(
                _allocate((tokens, hidden), torch.bfloat16), _allocate((tokens, top_k), torch.int64),
                _allocate((tokens, top_k), torch.float32), _allocate((tokens, hidden), torch.bfloat16),
            )  # fmt: skip
        if deferred and slot.deferred_ids is None:
            slot.deferred_ids = _allocate((tokens, top_k), torch.int64)
            slot.deferred_out = _allocate((tokens, hidden), torch.bfloat16)
        return slot

    def used_on(self, stream: int) -> None:
        with self.lock:
            self.streams.add(stream)

    def release(self, slot: Slot) -> None:
        tokens, hidden = slot.x.shape
        with self.lock:
            self._free.setdefault((tokens, hidden, slot.ids.shape[1]), []).append(slot)

    def retire(self, slot: Slot | None, stream: int) -> None:
        """A slot queued work on `stream` may still use: freed once the stream has run that work."""
        if slot is not None:
            self.retired.add(slot, {stream})

    def output(self, tokens: int, hidden: int, device: torch.device) -> torch.Tensor:
        """The device output of this thread's next sync of `tokens` tokens (one of a pair, in turn)."""
        key = (threading.get_ident(), tokens, hidden, device)
        with self.lock:
            pair = self._outputs.get(key)
            turn = self._turns.get(key, 0)
            self._turns[key] = turn ^ 1
        if pair is None:
            pair = [_allocate((tokens, hidden), torch.bfloat16, device) for _ in range(2)]
            with self.lock:
                pair = self._outputs.setdefault(key, pair)
        return pair[turn]

    def prepare(
        self, sizes: list[int], hidden: int, top_k: int, device: torch.device, deferred: bool
    ) -> None:
        """Allocate ahead what calls of these batch sizes use (allocating while a CUDA graph is
        captured may fail): one slot (two with deferred experts) and this thread's output pair."""
        for tokens in sizes:
            slots = [self.acquire(tokens, hidden, top_k, deferred) for _ in range(1 + deferred)]
            for slot in slots:
                self.release(slot)
            key = (threading.get_ident(), tokens, hidden, device)
            if key not in self._outputs:
                pair = [_allocate((tokens, hidden), torch.bfloat16, device) for _ in range(2)]
                with self.lock:
                    self._outputs.setdefault(key, pair)

    def clear(self) -> None:
        """Let go of every free slot and every output: retired behind the work queued so far on every
        stream they were used on (CUDA graphs captured before use them: capture again)."""
        with self.lock:
            buffers = (self._free, self._outputs)
            streams = self.streams
            self._free, self._outputs, self._turns, self.streams = {}, {}, {}, set()
            self.generation += 1
        self.retired.add(buffers, streams)
        self.retired.collect()

    def keep_at_exit(self) -> None:
        with self.lock:
            keep_forever((self._free, self._outputs, self.retired._entries))

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()
        self.retired.lock = threading.Lock()


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
    path: StreamForward | None = None  # the layer's stream path that submitted it


class StreamForward:
    """One layer's stream path: its C++ StreamLayer, the call submitted and not yet synced, and the
    host tensors its queued copies read."""

    def __init__(self, layer: Any, own: deferred.DeferredExperts | None, layer_idx: int, num_experts: int,
                 hidden: int, top_k: int) -> None:  # fmt: skip
        self.layer = ext.StreamLayer.create(layer, own and own.layer, num_experts, hidden, top_k)
        self.own, self.layer_idx, self.num_experts = own, layer_idx, num_experts
        self.hidden, self.top_k = hidden, top_k
        self.call: StreamCall | None = None  # submitted, not yet synced
        self._prepared: dict[tuple[int, torch.device], int] = {}  # (thread, device) -> BUFFERS.generation
        # Host inputs a queued copy still reads, with the queued() count that makes them free and the
        # stream that reads them.
        self._keep_alive: collections.deque[tuple[int, int, tuple[torch.Tensor | None, ...]]] = (
            collections.deque()
        )
        # Every storage of the GPU-expert mask a call was given: its host function reads the mask
        # when it runs, a captured one at every replay, so the memory stays.
        self._masks: dict[int, torch.UntypedStorage] = {}

    @property
    def busy(self) -> bool:
        return self.call is not None

    def submit(self, stream: int, hidden_states: object, topk_ids: object, topk_weights: object,
               capture_sizes: list[int], gpu_mask: torch.Tensor) -> None:  # fmt: skip
        """Check the inputs and queue the call on ``stream``; the GPU-expert mask (a checked CPU bool
        tensor) is read when the CPU task starts."""
        device = hidden_states.device if isinstance(hidden_states, torch.Tensor) else torch.device("cpu")
        # Conversions and the deferred split are torch operations: queued on the stream. Entering it
        # costs tens of microseconds, so calls that need neither (SGLang's) skip it.
        own = self.own
        plain = own is None and as_engine_reads(hidden_states, topk_ids, topk_weights)
        with contextlib.nullcontext() if plain else on_stream(stream, device):
            x, ids, weights = check_call_inputs(
                hidden_states, topk_ids, topk_weights, self.hidden, self.top_k, on_device=True
            )
            deferred_ids = None
            if own is not None and x.shape[0] > 0:
                ids, deferred_ids = deferred.split_routing(
                    ids.to(torch.int64), weights, self.top_k - own.per_token, self.num_experts
                )
        if x.shape[0] == 0:
            self.call = StreamCall(stream, 0, 0, x.device, None, None, False, self)
            return
        taken = deferred.take_pending(self, own, x.shape[0], on_stream=True)
        adds = None if taken is None else taken.stream_call
        call = self._queue(stream, x, ids, weights, deferred_ids, adds, capture_sizes, gpu_mask)
        deferred.hand_over_on_stream(taken, own, call)  # once this call is on its way, as on the direct path
        self.call = call

    def _queue(self, stream: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               deferred_ids: torch.Tensor | None, adds: StreamCall | None,
               capture_sizes: list[int], gpu_mask: torch.Tensor) -> StreamCall:  # fmt: skip
        """Queue the call (inputs checked, contiguous, on one device: x bf16, ids int64 or int32,
        weights float32, deferred_ids int64)."""
        tokens, device = x.shape[0], x.device
        BUFFERS.retired.collect()
        prepared = (threading.get_ident(), device)
        if self._prepared.get(prepared) != BUFFERS.generation:
            BUFFERS.prepare(capture_sizes, self.hidden, self.top_k, device, deferred_ids is not None)
            self._prepared[prepared] = BUFFERS.generation
        mask_address = gpu_mask.data_ptr()
        if mask_address not in self._masks:
            self._masks[mask_address] = gpu_mask.untyped_storage()
        slot = BUFFERS.acquire(tokens, self.hidden, self.top_k, deferred_ids is not None)
        BUFFERS.used_on(stream)
        deferred_address = 0 if deferred_ids is None else deferred_ids.data_ptr()
        try:
            handle = self.layer.submit(
                stream, tokens, x.data_ptr(), ids.data_ptr(), ids.dtype == torch.int32, weights.data_ptr(),
                deferred_address, slot.x.data_ptr(), slot.ids.data_ptr(), slot.weights.data_ptr(),
                0 if slot.deferred_ids is None else slot.deferred_ids.data_ptr(), slot.out.data_ptr(),
                0 if slot.deferred_out is None else slot.deferred_out.data_ptr(),
                0 if adds is None else adds.handle, mask_address,
            )  # fmt: skip
        except BaseException:
            BUFFERS.retire(slot, stream)  # copies queued before the failure may still write it
            raise
        if device.type == "cpu":  # no caching allocator orders their reuse after the copies
            done = self.layer.completed
            while self._keep_alive and self._keep_alive[0][0] <= done:
                self._keep_alive.popleft()
            self._keep_alive.append((self.layer.queued, stream, (x, ids, weights, deferred_ids)))
        return StreamCall(stream, handle, tokens, device, slot, adds, deferred_ids is not None, self)

    def sync(self, cuda_stream: object = None) -> torch.Tensor:
        """Queue the wait and the output copy of the call submitted; returns the device output."""
        call = self.call
        given = None if cuda_stream is None else stream_handle(cuda_stream, None)
        if given is not None and given != call.stream:
            raise ValueError(
                f"sync_forward's cuda_stream ({given}) is not the one submit_forward used ({call.stream})"
            )
        self.call = None
        if call.tokens == 0:
            return torch.empty((0, self.hidden), dtype=torch.bfloat16, device=call.device)
        return self._sync(call)

    def _sync(self, call: StreamCall) -> torch.Tensor:
        """Queue the wait and the output copy; returns the device output. Raises the first error a
        host function of this layer met (of this call or an earlier one)."""
        out = BUFFERS.output(call.tokens, self.hidden, call.device)
        try:
            self.layer.sync(call.handle, call.stream, out.data_ptr())
        except BaseException:
            BUFFERS.retire(call.slot, call.stream)  # the call's copies were queued: the slot stays theirs
            raise
        # Whatever reuses these slots next is queued after this sync on the same stream.
        if not call.deferred:  # else held until the call that adds its deferred output syncs
            BUFFERS.release(call.slot)
        if call.adds is not None:
            BUFFERS.release(call.adds.slot)
        self.layer.rethrow_error()
        return out

    def drop_deferred(self, call: StreamCall) -> None:
        """No later call adds `call`'s deferred experts: queue the wait for them, then retire its slot."""
        try:
            self.layer.drop_deferred(call.handle, call.stream)
        finally:
            BUFFERS.retire(call.slot, call.stream)

    def close(self, warn: bool = True) -> None:
        """Stop the layer's host functions (a CPU task in flight finishes; a sync still queued gives
        NaN); retire the slots queued copies may still write: the call submitted and not synced, and
        the call whose deferred experts nobody adds now."""
        if warn and self.layer.outstanding:
            warnings.warn(
                "a layer closed with calls queued on a CUDA stream that has not run them: their outputs "
                "will be NaN",
                RuntimeWarning,
                stacklevel=4,
            )
        deferring = deferred.close(self.own) if self.own is not None else None
        self.own = None  # its twin engines go with the layer
        if deferring is not None:
            self.drop_deferred(deferring)
        self.layer.close()
        call, self.call = self.call, None
        if call is not None and call is not deferring and call.slot is not None:
            BUFFERS.retire(call.slot, call.stream)
        for _, stream, inputs in self._keep_alive:  # queued copies may still read them: not freed with us
            BUFFERS.retired.add(inputs, {stream})
        self._keep_alive.clear()
