"""KTMoEWrapper: the upstream-compatible entry point to the CPU expert engine. A facade: it checks
and serializes calls, and hands them to the room that does the work (loading: kt_kernel.loading;
a forward: kt_kernel.direct_path or kt_kernel.stream_path; the deferred hand-off: kt_kernel.deferred;
write-back: kt_kernel.write_back)."""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from . import checkpoint, deferred, expert_cache, formats, stream_path, write_back
from ._native import ext
from .arguments import (
    THREADS_PER_CPU_LIMIT,
    check_gpu_mask,
    check_layer_options,
    follow_gpu_mask,
    initial_gpu_mask,
)
from .direct_path import DirectForward
from .loading import LOAD_PARTS, LayerWeights
from .subpools import intermediate_granularity, plan_subpools, split_intermediate

__all__ = [
    "IMPLEMENTED_FORMATS", "LOAD_PARTS", "THREADS_PER_CPU_LIMIT", "KTMoEWrapper", "intermediate_granularity",
    "split_intermediate",
]  # fmt: skip

#: Formats the engine runs.
IMPLEMENTED_FORMATS = tuple(formats.FORMATS)
#: set_capture_batch_sizes takes batch sizes up to this (SGLang captures a few hundred at most).
MAX_CAPTURE_BATCH_SIZE = 1 << 16


class KTMoEWrapper:
    """Routed experts of one MoE layer, computed on the CPU.

    ``forward`` returns ``out[t] = sum_k topk_weights[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``
    with ``e = topk_ids[t,k]`` (with the expert biases, where loaded, added to gate, up and down);
    id -1 and experts with ``gpu_experts_mask[e]`` contribute nothing.
    Keyword names follow upstream kt-kernel; ``cpu_save`` is accepted and stored. With CUDA inputs or
    a ``cuda_stream``, a call is ordered on that stream (kt_kernel.stream_path, docs/serving.md).
    ``method`` keeps the name given ('AMXINT4'); ``weight_format`` is the format it means ('INT4').

    GPU experts: ``gpu_experts_mask`` (bool [num_experts]) or upstream's ``num_gpu_experts=n``
    (experts 0..n-1; both given: they must agree). ``gpu_experts_mask`` is a CPU bool tensor the
    caller may update in place (``wrapper.gpu_experts_mask.copy_(m)``, from any device) or assign;
    the engines read it when a CPU task starts (on a CUDA stream: when the stream gets there, so a
    replayed CUDA graph uses the mask of that moment). By default every expert's weights are
    packed, masked ones too, so any expert can come back to the CPU without a reload. With
    ``skip_gpu_expert_cpu_copy=True`` (upstream's option name) the experts masked at load are left
    out of CPU memory; one the mask hands back later is read from ``weight_path`` at the next submit
    (a RuntimeError when the weights came from tensors).

    ``threadpool_count`` > 1 splits the layer into that many subpools, each with its share of
    ``cpuinfer_threads`` and a contiguous slice of the intermediate dimension of every expert
    (gate/up rows and down columns); their fp32 partial outputs are summed and rounded to bf16
    once. ``numa_nodes[i]`` pins subpool i's threads to that NUMA node's CPUs (its weight slice is
    first touched, so placed, by those threads); without it, subpool i is pinned to the i-th node
    when the machine has ``threadpool_count`` > 1 nodes, and nothing is pinned otherwise.
    ``subpools`` says what was done; ``worker_cpus()`` reads the threads' CPU sets back.

    ``mmap_experts_dir`` (a directory, made if missing): ``load_weights()`` writes each subpool's
    packed experts there, and a later load of the layer with the same key (source files, layer,
    format, experts in CPU memory, subpool split, build) maps them read-only instead of packing:
    shared between processes, no anonymous copy (kt_kernel.expert_cache, docs/expert-cache.md).
    Without the keyword, the ``KT_KERNEL_MMAP_EXPERTS_DIR`` environment variable names it.
    """

    _capture_batch_sizes: ClassVar[list[int]] = []
    _instances: ClassVar[weakref.WeakSet[KTMoEWrapper]] = weakref.WeakSet()

    def __init__(
        self,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        # Optional so that upstream's num_gpu_experts= may replace it; the arguments after it stay
        # required (None is refused with a TypeError naming them), weight_path excepted.
        gpu_experts_mask: torch.Tensor | Sequence[bool] | int | None = None,
        cpuinfer_threads: int | None = None,
        threadpool_count: int | None = None,
        weight_path: str | None = None,
        chunked_prefill_size: int | None = None,
        cpu_save: bool = False,
        max_deferred_experts_per_token: int | None = None,
        method: str = "AMXINT4",
        numa_nodes: Sequence[int] | None = None,
        *,
        num_gpu_experts: int | None = None,
        mode: str = "inference",
        swiglu_limit: float | None = None,
        swiglu_alpha: float | None = None,
        int8_activations: bool = False,
        skip_gpu_expert_cpu_copy: bool = False,
        mmap_experts_dir: str | os.PathLike | None = None,
    ) -> None:
        o = check_layer_options(locals(), ext.MAX_DIMENSION)  # the arguments as given, checked by name
        for name, value in vars(o).items():  # public, under upstream's names
            setattr(self, name, value)
        # A GGUF model's float experts under method GGUF are held as BF16 (checkpoint.engine_format).
        self._format = formats.get(checkpoint.engine_format(weight_path, self.layer_idx, method))
        # Method NVFP4 is read as FP8 (nvfp4_to_fp8) and held as GGUF: 4-bit indices, E4M3 scales.
        nvfp4 = formats.nvfp4_held_as_gguf(method, hidden_size, moe_intermediate_size)
        self._read_format = self._format.name
        if nvfp4:
            self._format = formats.GGUF
        self._format.check_dimensions(
            {"hidden_size": hidden_size, "moe_intermediate_size": moe_intermediate_size}
        )
        self.weight_format = self._format.name
        self.method = method
        self.weight_path = weight_path
        self.cpu_save = bool(cpu_save)
        cache = expert_cache.open_cache(mmap_experts_dir)
        self.mmap_experts_dir = None if cache is None else str(cache.directory)
        # The engines read this tensor's memory when a task starts: it is replaced only in place.
        self._gpu_experts_mask = initial_gpu_mask(gpu_experts_mask, num_gpu_experts, num_experts)
        self._gpu_mask_address = self._gpu_experts_mask.data_ptr()
        self._mask_shape = (num_experts,)
        self._layer, self._pools, self._subpools = plan_subpools(
            num_experts=num_experts, top_k=num_experts_per_tok, hidden=hidden_size,
            intermediate=moe_intermediate_size, weight_format=self.weight_format, threads=cpuinfer_threads,
            count=threadpool_count, numa_nodes=self.numa_nodes,
            skip=torch.nonzero(self._gpu_experts_mask).flatten().tolist(),
            int8_activations=int8_activations, swiglu_limit=self.swiglu_limit or 0.0,
            swiglu_alpha=self.swiglu_alpha or 0.0,
        )  # fmt: skip
        self._weights = LayerWeights(
            self._format, self._subpools, num_experts, hidden_size, moe_intermediate_size, layer_idx,
            skip_gpu_expert_cpu_copy, cache, nvfp4,
        )  # fmt: skip
        # Deferred experts run as a second call of this layer, on the same weights and threads; their
        # output goes into the next call's output (kt_kernel.deferred).
        per_token = o.max_deferred_experts_per_token
        self._deferred = (
            deferred.DeferredExperts(layer_idx, self._layer.twin(), per_token) if per_token else None
        )
        # The two call paths, with the same small interface (submit, sync, busy, close): the direct
        # one, and the stream one, made at the first call with a CUDA stream.
        self._direct = DirectForward(
            self._layer, self._deferred, layer_idx, num_experts, hidden_size, num_experts_per_tok
        )
        self._stream: stream_path.StreamForward | None = None
        self._in_flight: DirectForward | stream_path.StreamForward | None = (
            None  # the path of the call in flight
        )
        # _lock guards the engines and the paths: every method takes turns on it, so calls from
        # several Python threads are serialized (or refused while a forward is in flight).
        # _forward_lock makes forward() (submit + sync) one turn.
        self._lock = threading.Lock()
        self._forward_lock = threading.Lock()
        KTMoEWrapper._instances.add(self)

    # ---- construction helpers ---------------------------------------------------------------
    @property
    def subpools(self) -> list[dict[str, Any]]:
        """Each subpool: ``threads``, its ``intermediate`` slice (start, stop), the ``numa_node``
        it is pinned to and the ``cpus`` its threads were pinned to (both None: not pinned)."""
        return [
            {
                "threads": sp.threads,
                "intermediate": (sp.start, sp.stop),
                "numa_node": sp.numa_node,
                "cpus": None if sp.cpus is None else list(sp.cpus),
            }
            for sp in self._subpools
        ]

    def worker_cpus(self) -> list[list[list[int]]]:
        """Per subpool, per worker thread: the CPUs the kernel lets that thread run on, read by the
        thread itself (sched_getaffinity), so pinning can be checked."""
        with self._lock:
            self._require_idle("query the worker threads")
            return [sp.engine.worker_cpus() for sp in self._subpools]

    @property
    def gpu_experts_mask(self) -> torch.Tensor:
        """CPU bool [num_experts]: True = computed on the GPU, skipped here. Update it in place or
        assign it; the engines read it when each CPU task starts (docs/serving.md)."""
        return self._gpu_experts_mask

    @gpu_experts_mask.setter
    def gpu_experts_mask(self, mask: torch.Tensor | Sequence[bool] | None) -> None:
        checked, current = check_gpu_mask(mask, self.num_experts), self._gpu_experts_mask
        # In place (a reference the caller kept stays live), unless the caller broke its storage.
        if current.is_cpu and current.dtype == torch.bool and current.shape == self._mask_shape:
            current.copy_(checked)
        else:
            current.data = checked
        self._gpu_mask_address = current.data_ptr()

    @property
    def num_gpu_experts(self) -> int:
        """How many experts gpu_experts_mask marks now."""
        return int(self._gpu_experts_mask.sum())

    def load_weights_from_tensors(
        self,
        gate_proj: torch.Tensor,
        up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        physical_to_logical_map_cpu: torch.Tensor | None = None,
        *,
        gate_scale: torch.Tensor | None = None,
        up_scale: torch.Tensor | None = None,
        down_scale: torch.Tensor | None = None,
        gate_zeros: torch.Tensor | None = None,
        up_zeros: torch.Tensor | None = None,
        down_zeros: torch.Tensor | None = None,
        gate_bias: torch.Tensor | None = None,
        up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
        """Copy expert weights into engine-owned memory in the method's format.

        Without scales: float weights (bf16, fp16 or fp32), gate_proj/up_proj [E, I, H] and
        down_proj [E, H, I], quantized on load (kt_kernel.quant.quantize). With scales: the
        method's canonical layout, taken bit-exactly (N x K = I x H for gate/up, H x I for down):
        MXFP4 E2M1 codes [E, N, K/2] (uint8, or int8 viewed as uint8) and E8M0 scales [E, N, K/32]
        (uint8 or float8_e8m0fnu); INT8 int8 [E, N, K] and float32/bf16 scales [E, N]; INT4 uint8
        (or int8) [E, N, K/2] and float32/bf16 scales [E, N, K/G], G in {32, 64, 128}, and
        optionally zero points (asymmetric INT4, as GPTQ makes it) gate_zeros/up_zeros/down_zeros:
        integers in -8..8 shaped like the scales, w = (q - zero) * scale; FP8 uint8 (or
        float8_e4m3fn) [E, N, K] and float32/bf16 scales [E, N] or [E, N, K/128].
        physical_to_logical_map_cpu[p] is the expert (first dim of the tensors) whose weights
        physical slot p holds; topk_ids name physical slots. Default: identity.
        Expert biases (gpt-oss has them), each optional, float: gate_bias and up_bias [E, I], added to
        the gate and up outputs before the activation, and down_bias [E, H], added to the expert's
        output before its routing weight; held and added in fp32.
        Nothing refers to the given tensors after this returns.
        """
        tensors = dict(gate=gate_proj, up=up_proj, down=down_proj, gate_scale=gate_scale, up_scale=up_scale,
                       down_scale=down_scale, gate_zeros=gate_zeros, up_zeros=up_zeros, down_zeros=down_zeros,
                       gate_bias=gate_bias, up_bias=up_bias, down_bias=down_bias)  # fmt: skip
        with self._lock:
            self._require_idle("load weights")
            self._weights.load_tensors(self._gpu_experts_mask, tensors, physical_to_logical_map_cpu)

    def load_weights(self, physical_to_logical_map_cpu: torch.Tensor | None = None) -> None:
        """Load layer ``layer_idx`` from the checkpoint directory or GGUF model ``weight_path``.

        A directory written by ``kt-kernel convert`` (it holds kt_manifest.json) in the method's
        format; a GGUF model (a .gguf file, a split set or a directory of them: method GGUF for any
        of its experts, float ones held as BF16); otherwise a Hugging Face model directory as it ships
        (BF16, FP8, compressed-tensors or GPTQ INT4) or, for MXFP4, the DeepSeek-V4-Flash or gpt-oss
        layout (with its expert biases; see kt_kernel.checkpoint).
        Experts 0..E-1 of the layer, or as many as physical_to_logical_map_cpu refers to, read and
        packed in LOAD_PARTS parts: the memory it needs beyond the packed layer is about one part.
        Where a part fails, the layer is left unloaded.
        """
        slot_map = self._weights.checkpoint_slot_map(self.weight_path, physical_to_logical_map_cpu)
        with self._lock:
            self._require_idle("load weights")
            self._weights.load_checkpoint(
                self.weight_path, slot_map, self._gpu_experts_mask, self._read_format, self.method
            )

    # ---- forward ------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        cuda_stream: object | None = None,
    ) -> torch.Tensor:
        """Compute the routed experts for hidden_states [T, H] bf16; returns a [T, H] bf16 tensor
        (new on the direct path; on a stream, see sync_forward).

        Calls from several threads on one wrapper run one after another. An exception between the
        two halves (KeyboardInterrupt, say) leaves nothing in flight: the call is waited for and
        dropped, and the next call works."""
        with self._forward_lock:
            try:
                self.submit_forward(hidden_states, topk_ids, topk_weights, cuda_stream)
                return self.sync_forward(hidden_states, cuda_stream)
            except BaseException:
                self._drop_in_flight()
                raise

    def _drop_in_flight(self) -> None:
        """Wait for a direct-path call in flight and forget it (a stream call's host functions finish
        it)."""
        with self._lock:
            if self._in_flight is self._direct and self._layer is not None:
                self._direct.drop()
                self._in_flight = None

    def submit_forward(
        self,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        cuda_stream: object | None = None,
    ) -> None:
        """Start a forward and return at once; ``sync_forward`` waits for it and returns the output.

        Direct path (CPU tensors, no ``cuda_stream``): the inputs are read before this returns, so the
        caller may overwrite them at once. Stream path (CUDA tensors, or any with ``cuda_stream``: an
        int handle or a ``torch.cuda.Stream``; CUDA tensors without one use their device's current
        stream): everything is queued on that stream, inputs read in its order, and this returns
        without waiting for the stream (docs/serving.md)."""
        # (The common direct call, CPU tensors and no stream, skips the look-up: a microsecond.)
        on_cpu = cuda_stream is None and not getattr(hidden_states, "is_cuda", False)
        stream = None if on_cpu else stream_path.stream_handle(cuda_stream, hidden_states)
        with self._lock:
            if not self._weights.loaded:
                raise RuntimeError(
                    "this wrapper is closed"
                    if self._layer is None
                    else "weights are not loaded: call load_weights_from_tensors first"
                )
            if self._gpu_experts_mask.data_ptr() != self._gpu_mask_address:  # new storage: checked once
                self._gpu_mask_address = 0  # until it checks out
                self._gpu_mask_address = follow_gpu_mask(self._gpu_experts_mask, self.num_experts)
            if self._weights.unpacked is not None:
                idle = "load the experts gpu_experts_mask hands to the CPU"
                self._weights.load_handed_back(
                    self.weight_path,
                    self._gpu_experts_mask,
                    self._read_format,
                    lambda: self._require_idle(idle, deferred_too=False),
                )
            if stream is None:
                self._require_idle("submit a forward", deferred_too=False)
                # In flight before the engines start: a KeyboardInterrupt the moment submit returns
                # still finds the call (forward drops it, a next submit is refused), where the next
                # submit replaced its output while the engines wrote it (ASan: use after free).
                self._in_flight = self._direct
                try:
                    self._direct.submit(hidden_states, topk_ids, topk_weights, self._gpu_mask_address)
                except BaseException:
                    if not self._direct.busy:  # refused, or dropped by submit itself
                        self._in_flight = None
                    raise
                return
            self._require_idle("submit a forward", deferred_too=False, stream_too=False)
            if self._stream is None:
                self._stream = stream_path.StreamForward(
                    self._layer, self._deferred, self.layer_idx, self.num_experts, self.hidden_size,
                    self.num_experts_per_tok,
                )  # fmt: skip
            self._stream.submit(
                stream, hidden_states, topk_ids, topk_weights, KTMoEWrapper._capture_batch_sizes,
                self._gpu_experts_mask,
            )  # fmt: skip
            self._in_flight = self._stream

    def sync_forward(
        self, hidden_states: torch.Tensor | None = None, cuda_stream: object | None = None
    ) -> torch.Tensor:
        """Wait for the forward started by ``submit_forward`` and return its [T, H] bf16 output.

        Direct path: waits, and returns a new tensor. Stream path: queues the wait and the copy of
        the output on the stream and returns at once; the tensor returned (on the inputs' device) is
        one of a pair per (thread, batch size, device): it holds this output once the stream has
        reached this point and until the second next sync of the same batch size on this thread.
        An error of the CPU task (a bad expert id, say) is raised by this or a later sync_forward of
        this layer, and that call's output is NaN."""
        with self._lock:
            path = self._in_flight
            if path is None:
                raise RuntimeError("sync_forward called without a submit_forward")
            try:
                return path.sync(cuda_stream)
            finally:
                if not path.busy:
                    self._in_flight = None

    # ---- deferred experts (max_deferred_experts_per_token > 0): kt_kernel.deferred ------------------
    def select_deferred_experts(
        self, expert_ids: torch.Tensor, expert_scores: torch.Tensor, protected_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Split routing into (immediate_ids, deferred_ids), as upstream: an expert among some token's
        ``protected_k`` highest-scored ones runs now for every token routed to it; the others are
        deferred. Entries not in a split are -1 there (as are -1 entries in both)."""
        return deferred.split_routing(expert_ids, expert_scores, protected_k, self.num_experts)

    @staticmethod
    def flush_deferred() -> torch.Tensor | None:
        """Wait for the deferred experts no later call of this thread's stack has taken yet and
        return their [T, H] bf16 output (None if there are none): after the last layer, add it to
        that layer's output. (On a CUDA stream there is nothing to flush: the last layer must not
        defer; such experts are dropped here, with a RuntimeError saying so.)"""
        return deferred.flush()

    # ---- writing an expert back (SGLang uploads CPU experts to the GPU for long prefills) -------
    def submit_write_weight_scale_to_buffer(
        self,
        gpu_tp_count: int,
        expert_id: int,
        w13_weight_ptrs: Sequence[int],
        w13_scale_ptrs: Sequence[int] | None,
        w2_weight_ptrs: Sequence[int],
        w2_scale_ptrs: Sequence[int] | None,
    ) -> None:
        """Write physical slot ``expert_id``'s weights and scales into caller host buffers, in the
        bytes upstream kt-kernel writes for this wrapper's ``method`` (SGLang repacks them for its
        GPU kernels): the canonical layout ``load_weights_from_tensors`` takes with scales, except
        MXFP4 scales as bf16 2^(e-127), RAWINT4 nibbles as q + 8 with bf16 scales, and FP8 block
        scales one per 128 x 128 block (kt_kernel.write_back, docs/serving.md). Values bit-exact:
        the bytes that were loaded, or that kt_kernel.quant.quantize made on load.

        The pointer lists hold ``gpu_tp_count`` raw addresses (``tensor.data_ptr()``); part r
        covers intermediate rows [r * I/tp, (r + 1) * I/tp) (I = moe_intermediate_size):
        ``w13_weight_ptrs[r]``: gate rows of the part then up rows, [2 * I/tp, H] values;
        ``w13_scale_ptrs[r]``: their scales, gate then up; ``w2_weight_ptrs[r]``: columns of the
        part of every down row, [H, I/tp]; ``w2_scale_ptrs[r]``: their scales (per-row down scales:
        all H, [H]). Scale lists may be None or empty for BF16. Each buffer must be that large.

        The work is done here, on the engines' threads, before this returns;
        ``sync_write_weight_scale_to_buffer`` then has nothing left to wait for.
        """
        with self._lock:
            self._require_idle("write weights back")
            self._require_loaded()
            write_back.write_layer_expert(
                self._weights, self.method, gpu_tp_count, expert_id,
                w13_weight_ptrs, w13_scale_ptrs, w2_weight_ptrs, w2_scale_ptrs,
            )  # fmt: skip

    def write_buffer_nbytes(self, gpu_tp_count: int) -> dict[str, int]:
        """The bytes each buffer of one part needs for ``submit_write_weight_scale_to_buffer`` with the
        weights as loaded: ``w13_weight``, ``w13_scale``, ``w2_weight``, ``w2_scale`` (0: no scales).
        A ValueError where the loaded weights cannot be written in this method's layout."""
        with self._lock:
            self._require_idle("size the write-back buffers", stream_too=False)
            self._require_loaded()
            return write_back.layer_buffer_nbytes(self._weights, self.method, gpu_tp_count)

    def _require_loaded(self) -> None:
        if not self._weights.loaded:
            raise RuntimeError("weights are not loaded: call load_weights_from_tensors first")

    def sync_write_weight_scale_to_buffer(self) -> None:
        """Kept for upstream's call sequence: submit_write_weight_scale_to_buffer finished the work."""

    def close(self) -> None:
        """Wait for a forward in flight, then free the weights and stop the worker threads.

        Later calls raise RuntimeError. Runs by itself when the wrapper is garbage-collected and,
        for every wrapper still alive, when the interpreter exits. Calls still queued on a CUDA
        stream then give NaN (a RuntimeWarning says so)."""
        self._close(warn=True)

    def _close(self, warn: bool) -> None:
        with self._lock:
            if self._layer is None:
                return  # closed before
            try:
                if self._in_flight is self._direct:
                    self._direct.close()
                if self._stream is not None:  # queued host functions of this layer start nothing from now on
                    self._stream.close(warn)
                elif self._deferred is not None:
                    deferred.close(self._deferred)
            except RuntimeError:
                pass  # a forward lost to fork(): nothing of it runs any more
            finally:
                self._in_flight = None
                self._weights.loaded, self._weights.subpools = False, []  # the engines go with the wrapper
                self._layer, self._subpools, self._pools, self._deferred, self._direct = (
                    None,
                    [],
                    None,
                    None,
                    None,
                )

    def __del__(self) -> None:
        if getattr(self, "_lock", None) is not None:  # __init__ got that far
            self.close()

    def _require_idle(self, action: str, deferred_too: bool = True, stream_too: bool = True) -> None:
        """Refuse `action` on a closed wrapper, with a forward in flight, (deferred_too) while this
        layer's deferred experts still run on its weights, or (stream_too) while calls of it queued
        on a CUDA stream have not run."""
        if self._layer is None:
            raise RuntimeError(f"cannot {action}: this wrapper is closed")
        if self._in_flight is not None:
            raise RuntimeError(f"cannot {action} while a forward is in flight: call sync_forward first")
        own = self._deferred
        if (
            stream_too
            and self._stream is not None
            and (self._stream.layer.outstanding or own and own.stream_call)
        ):
            raise RuntimeError(
                f"cannot {action} while calls of this layer queued on a CUDA stream have not run: "
                "synchronize the stream first"
            )
        if deferred_too and own is not None and own.out is not None:
            raise RuntimeError(
                f"cannot {action} while this layer's deferred experts are in flight: sync the next layer "
                "or call KTMoEWrapper.flush_deferred() first"
            )

    # ---- upstream class-level buffer management ------------------------------------------------
    @classmethod
    def set_capture_batch_sizes(cls, batch_sizes: Sequence[int]) -> None:
        """Record the batch sizes a CUDA-graph runner captures: the stream path allocates their
        buffers ahead, outside any capture. Ints from 1 to MAX_CAPTURE_BATCH_SIZE."""
        sizes = list(batch_sizes)
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_CAPTURE_BATCH_SIZE:
                raise ValueError(
                    f"capture batch sizes must be ints from 1 to {MAX_CAPTURE_BATCH_SIZE}, got {size!r}"
                )
        cls._capture_batch_sizes = sizes

    @classmethod
    def get_capture_batch_sizes(cls) -> list[int]:
        return list(cls._capture_batch_sizes)

    @classmethod
    def clear_buffer_cache(cls) -> None:
        """Free the per-call scratch buffers of every idle wrapper (they grow back on demand; a
        wrapper busy on another thread keeps its own), and let go of the stream path's host and
        device buffers: each is freed once the work queued on its streams so far has run (CUDA graphs
        captured before use them: capture again)."""
        for wrapper in list(cls._instances):
            if not wrapper._lock.acquire(blocking=False):
                continue
            try:
                if wrapper._in_flight is None and wrapper._layer is not None:
                    wrapper._layer.release_scratch()
                    wrapper._direct.release_scratch()
                    if wrapper._deferred is not None:
                        deferred.release_scratch(wrapper._deferred)
            finally:
                wrapper._lock.release()
        stream_path.BUFFERS.clear()

    @classmethod
    def _close_all(cls) -> None:
        for wrapper in list(cls._instances):
            wrapper._close(warn=False)  # the process is ending: no output is read any more
        stream_path.BUFFERS.keep_at_exit()  # a stream may still run copies into them

    @classmethod
    def _after_fork_in_child(cls) -> None:
        # Another thread of the parent may have held a lock at the fork; it does not exist here.
        deferred.after_fork_in_child()
        stream_path.BUFFERS.after_fork_in_child()
        for wrapper in list(cls._instances):
            wrapper._lock = threading.Lock()
            wrapper._forward_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"KTMoEWrapper(layer_idx={self.layer_idx}, num_experts={self.num_experts}, "
            f"num_experts_per_tok={self.num_experts_per_tok}, hidden_size={self.hidden_size}, "
            f"moe_intermediate_size={self.moe_intermediate_size}, method={self.method!r}, "
            f"cpuinfer_threads={self.cpuinfer_threads}, threadpool_count={self.threadpool_count})"
        )


# At exit, forwards in flight finish and the engines go before the extension module does.
atexit.register(KTMoEWrapper._close_all)
os.register_at_fork(after_in_child=KTMoEWrapper._after_fork_in_child)
