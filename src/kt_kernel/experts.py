"""KTMoEWrapper: the upstream-compatible entry point to the CPU expert engine."""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from . import checkpoint, deferred, formats, stream_path, write_back
from ._native import ext
from .arguments import (
    check_call_inputs,
    check_gpu_mask,
    initial_gpu_mask,
    optional_non_negative,
    require_addresses,
    require_expert_ids,
    require_int,
)
from .formats import require_shape
from .subpools import intermediate_granularity, plan_subpools, split_intermediate
from .expert_weights import check_slot_map, prepare, prepare_biases, subpool_slice

__all__ = ["IMPLEMENTED_FORMATS", "KTMoEWrapper", "intermediate_granularity", "split_intermediate"]

#: Formats the engine runs.
IMPLEMENTED_FORMATS = tuple(formats.FORMATS)
#: At most this many worker threads per CPU this process may run on (more only time-slice).
THREADS_PER_CPU_LIMIT = 4
#: load_weights reads and packs a layer in this many parts (a part: 1/16 of the experts or one), so
#: that it needs about one part's tensors of memory beyond the packed layer.
LOAD_PARTS = 16
#: Calls of up to this many tokens (decode) allocate the next call's output ahead (submit_forward).
_SPARE_OUTPUT_MAX_TOKENS = 16


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
    the change applies from the next ``submit_forward``. By default every expert's weights are
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
    ) -> None:
        if mode == "sft":
            raise NotImplementedError("SFT mode is not supported: kt_kernel runs inference only")
        if mode != "inference":
            raise ValueError(f"mode must be 'inference' (upstream's 'sft' is not supported), got {mode!r}")
        self.layer_idx = require_int("layer_idx", layer_idx, 0)
        self.num_experts = require_int("num_experts", num_experts, 1)
        self.num_experts_per_tok = require_int("num_experts_per_tok", num_experts_per_tok, 1)
        if num_experts_per_tok > num_experts:
            raise ValueError(
                f"num_experts_per_tok ({num_experts_per_tok}) cannot exceed num_experts ({num_experts})"
            )
        self.hidden_size = require_int("hidden_size", hidden_size, 1)
        self.moe_intermediate_size = require_int("moe_intermediate_size", moe_intermediate_size, 1)
        for name, size in (("hidden_size", hidden_size), ("moe_intermediate_size", moe_intermediate_size)):
            if size > ext.MAX_DIMENSION:
                raise ValueError(f"{name} must be <= {ext.MAX_DIMENSION}, got {size}")
        self.cpuinfer_threads = require_int("cpuinfer_threads", cpuinfer_threads, 1)
        usable_cpus = len(os.sched_getaffinity(0))
        if cpuinfer_threads > THREADS_PER_CPU_LIMIT * usable_cpus:
            raise ValueError(
                f"cpuinfer_threads={cpuinfer_threads} is more than {THREADS_PER_CPU_LIMIT} x the "
                f"{usable_cpus} CPUs this process may run on; extra threads would only take turns on them"
            )
        self.threadpool_count = require_int("threadpool_count", threadpool_count, 1)
        if threadpool_count > cpuinfer_threads:
            raise ValueError(
                f"threadpool_count ({threadpool_count}) cannot exceed cpuinfer_threads ({cpuinfer_threads}): "
                "each subpool needs a thread"
            )
        self.chunked_prefill_size = require_int("chunked_prefill_size", chunked_prefill_size, 1)
        per_token = 0
        if max_deferred_experts_per_token is not None:
            per_token = require_int("max_deferred_experts_per_token", max_deferred_experts_per_token, 0)
        if per_token >= num_experts_per_tok:
            raise ValueError(
                f"max_deferred_experts_per_token ({per_token}) must be less than num_experts_per_tok "
                f"({num_experts_per_tok})"
            )
        self.max_deferred_experts_per_token = per_token
        self._format = formats.get(method)
        self._format.check_dimensions(
            {"hidden_size": hidden_size, "moe_intermediate_size": moe_intermediate_size}
        )
        self.weight_format = self._format.name
        self.method = method
        self.weight_path = weight_path
        self.cpu_save = bool(cpu_save)
        self.numa_nodes = None if numa_nodes is None else [int(n) for n in numa_nodes]
        self.swiglu_limit = optional_non_negative("swiglu_limit", swiglu_limit)
        self.swiglu_alpha = optional_non_negative("swiglu_alpha", swiglu_alpha)
        if not isinstance(int8_activations, bool):
            raise TypeError(f"int8_activations must be a bool, got {type(int8_activations).__name__}")
        self.int8_activations = int8_activations
        if not isinstance(skip_gpu_expert_cpu_copy, bool):
            raise TypeError(
                f"skip_gpu_expert_cpu_copy must be a bool, got {type(skip_gpu_expert_cpu_copy).__name__}"
            )
        self.skip_gpu_expert_cpu_copy = skip_gpu_expert_cpu_copy
        # The engines read this tensor's memory at every submit: it is replaced only in place.
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
        # Deferred experts run as a second call of this layer, on the same weights and threads; their
        # output goes into the next call's output (kt_kernel.deferred, submit_forward).
        self._deferred = (
            deferred.DeferredExperts(layer_idx, self._layer.twin(), per_token) if per_token else None
        )
        self._adds: torch.Tensor | deferred.DeferredExperts | None = None  # what the call in flight adds
        # The stream path, made at the first call with a CUDA stream.
        self._stream: stream_path.StreamForward | None = None
        # Per projection, the inputs one scale covers (1 without group scales), set at load.
        self._scale_groups: dict[str, int] = {}
        self._zero_points = False  # INT4 loaded with zero points (asymmetric GPTQ)
        # Expert biases loaded, per slot (kt_kernel.expert_weights.prepare_biases), or None.
        self._bias_table: dict[str, torch.Tensor] | None = None
        # skip_gpu_expert_cpu_copy: the slots left out of CPU memory (GPU experts at load), and where
        # load_weights read each slot's expert from (None: the weights came from tensors).
        self._unpacked: torch.Tensor | None = None
        self._source_of_slot: torch.Tensor | None = None
        self._loaded = False
        # _lock guards the engines and _in_flight: every method takes turns on it, so calls from
        # several Python threads are serialized (or refused while a forward is in flight).
        # _forward_lock makes forward() (submit + sync) one turn.
        self._lock = threading.Lock()
        self._forward_lock = threading.Lock()
        self._interrupted = False  # an exception cut a call short: the next submit checks the engines
        # The output of the forward in flight, or its StreamCall on a CUDA stream.
        self._in_flight: torch.Tensor | stream_path.StreamCall | None = None
        # A decode call allocates the next call's output while its engines run: with the caches cold
        # from the call before, torch.empty_like costs tens of microseconds before the call starts.
        self._spare_out: torch.Tensor | None = None
        self._spare_tokens = -1  # the tokens _spare_out is for
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
        assign it; the engines see the change at the next submit_forward."""
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

    def _follow_gpu_mask(self) -> None:
        """The engines read the mask's memory at submit: where the caller gave the tensor new storage
        (``mask.data = m``, ``mask.set_(m)``, ``share_memory_()``), read the new storage, or refuse a
        mask that is no longer a CPU bool [num_experts] tensor. Never the old address."""
        mask = self._gpu_experts_mask  # new storage means a new address: checked once, here
        self._gpu_mask_address = 0  # until it checks out
        if not (mask.is_cpu and mask.layout == torch.strided and mask.is_contiguous()):
            raise ValueError(
                f"gpu_experts_mask must stay a dense contiguous CPU tensor, got device {mask.device}, "
                f"layout {mask.layout}: assign a new mask with wrapper.gpu_experts_mask = m"
            )
        if mask.dtype != torch.bool:
            raise TypeError(f"gpu_experts_mask must stay a bool tensor, got {mask.dtype}")
        require_shape("gpu_experts_mask", mask, self._mask_shape, "[num_experts]")
        self._gpu_mask_address = mask.data_ptr()

    # ---- weights ------------------------------------------------------------------------------
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
        with self._lock:
            self._require_idle("load weights")
            self._load_part(
                gate_proj,
                up_proj,
                down_proj,
                physical_to_logical_map_cpu,
                {"gate_scale": gate_scale, "up_scale": up_scale, "down_scale": down_scale},
                {"gate_zeros": gate_zeros, "up_zeros": up_zeros, "down_zeros": down_zeros},
                {"gate_bias": gate_bias, "up_bias": up_bias, "down_bias": down_bias},
            )
            self._loaded = True

    def _start_load(self) -> None:
        """Every slot of every engine unpacked: the parts of a load follow (_load_part)."""
        self._loaded = False
        self._zero_points = False
        self._bias_table = None
        self._source_of_slot = None
        self._unpacked = self._gpu_experts_mask.clone() if self.skip_gpu_expert_cpu_copy else None
        for sp in self._subpools:
            sp.engine.unload()
            sp.engine.set_biases(None, None, None)

    def _load_part(
        self,
        gate_proj: torch.Tensor,
        up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        slot_map: torch.Tensor | None,
        scales: dict[str, torch.Tensor | None],
        zeros: dict[str, torch.Tensor | None],
        biases: dict[str, torch.Tensor | None] | None = None,
        part: bool = False,
        first_expert: int = 0,
    ) -> None:
        """Packs the slots slot_map names. Without ``part`` the whole layer, checked before the
        loaded one is dropped; with it one part after _start_load (-1: a slot of another part),
        whose tensors hold the experts from ``first_expert`` on."""
        canonical, slot_map = prepare(
            self._format,
            {"gate_proj": gate_proj, "up_proj": up_proj, "down_proj": down_proj},
            scales,
            slot_map,
            self.num_experts,
            self.hidden_size,
            self.moe_intermediate_size,
            zeros,
            part,
            first_expert,
        )
        biases = prepare_biases(
            biases or {}, slot_map, gate_proj.shape[0], self.hidden_size, self.moe_intermediate_size
        )
        if not part:
            self._start_load()
        if self._unpacked is not None:  # GPU experts stay out of CPU memory
            slot_map = torch.where(self._unpacked, -1, slot_map)
        # Quantized (or checked) for the whole I first, then sliced: any threadpool_count runs the
        # same weights. One subpool at a time, so only one slice's copy exists besides the whole.
        self._scale_groups = {name: self._format.scale_group(v, s) for name, (v, s, _) in canonical.items()}
        self._zero_points |= any(zeros is not None for _, _, zeros in canonical.values())
        for sp in self._subpools:
            tensors, zeros = subpool_slice(
                self._format, canonical, sp.start, sp.stop, self.moe_intermediate_size
            )
            sp.engine.load(*tensors, slot_map, **zeros)
        if any(b is not None for b in biases.values()):
            # Each part's slots hold their experts' biases, the others zeros: a load in parts (and an
            # expert the mask hands back later) adds its slots to the table.
            table = self._bias_table if part and self._bias_table is not None else {}
            for name, bias in biases.items():
                if bias is not None:
                    table[name] = bias if name not in table else table[name] + bias
            self._bias_table = table
            gate, up, down = (table.get(name) for name in ("gate_bias", "up_bias", "down_bias"))
            for index, sp in enumerate(self._subpools):  # gate/up biases sliced; down's added once
                sliced = [None if b is None else b[:, sp.start : sp.stop].contiguous() for b in (gate, up)]
                sp.engine.set_biases(*sliced, down if index == 0 else None)

    def load_weights(self, physical_to_logical_map_cpu: torch.Tensor | None = None) -> None:
        """Load layer ``layer_idx`` from the checkpoint directory or GGUF model ``weight_path``.

        A directory written by ``kt-kernel convert`` (it holds kt_manifest.json) in the method's
        format; a GGUF model (a .gguf file, a split set or a directory of them: method GGUF for its
        quantized experts, BF16 for float ones); otherwise a Hugging Face model directory as it ships
        (BF16, FP8, compressed-tensors or GPTQ INT4) or, for MXFP4, the DeepSeek-V4-Flash or gpt-oss
        layout (with its expert biases; see kt_kernel.checkpoint).
        Experts 0..E-1 of the layer, or as many as physical_to_logical_map_cpu refers to, read and
        packed in LOAD_PARTS parts: the memory it needs beyond the packed layer is about one part.
        Where a part fails, the layer is left unloaded.
        """
        if self.weight_path is None:
            raise ValueError("load_weights needs weight_path (a checkpoint directory or GGUF model)")
        if not os.path.exists(self.weight_path):
            raise FileNotFoundError(errno.ENOENT, "weight_path does not exist", str(self.weight_path))
        sources = self.num_experts
        if physical_to_logical_map_cpu is not None:
            sources = int(torch.as_tensor(physical_to_logical_map_cpu).max()) + 1
        slot_map = check_slot_map(physical_to_logical_map_cpu, sources, self.num_experts)
        with self._lock:
            self._require_idle("load weights")
            self._start_load()
            # A part at a time: only its tensors exist besides the engines' packed copy.
            reader = checkpoint.LayerReader(
                self.weight_path,
                self.layer_idx,
                self.weight_format,
                (self.hidden_size, self.moe_intermediate_size),
            )
            per_part = max(1, sources // LOAD_PARTS)
            for first in range(0, sources, per_part):
                experts = range(first, min(sources, first + per_part))
                in_part = (slot_map >= experts.start) & (slot_map < experts.stop)
                if self._unpacked is not None:
                    in_part &= ~self._unpacked
                if not in_part.any():
                    continue
                tensors = reader.read(experts)
                self._load_part(
                    tensors.pop("gate"),
                    tensors.pop("up"),
                    tensors.pop("down"),
                    torch.where(in_part, slot_map - experts.start, -1),
                    {name: tensors.get(name) for name in ("gate_scale", "up_scale", "down_scale")},
                    {name: tensors.get(name) for name in ("gate_zeros", "up_zeros", "down_zeros")},
                    {name: tensors.get(name) for name in ("gate_bias", "up_bias", "down_bias")},
                    part=True,
                    first_expert=experts.start,
                )
            self._source_of_slot = slot_map
            self._loaded = True

    def _load_experts_the_mask_hands_back(self) -> None:
        """skip_gpu_expert_cpu_copy: pack the experts gpu_experts_mask now gives the CPU that were
        left out of CPU memory, read from weight_path (a RuntimeError where the weights came from
        tensors). Called with self._lock held, before a forward."""
        need = self._unpacked & ~self._gpu_experts_mask
        if not bool(need.any()):
            return
        slots = torch.nonzero(need).flatten().tolist()
        if self._source_of_slot is None:
            raise RuntimeError(
                f"experts {slots} are not in CPU memory (skip_gpu_expert_cpu_copy) and the weights came from "
                "tensors: load them again, or mark these experts GPU-resident again"
            )
        self._require_idle("load the experts gpu_experts_mask hands to the CPU", deferred_too=False)
        reader = checkpoint.LayerReader(self.weight_path, self.layer_idx, self.weight_format)
        for slot in slots:
            source = int(self._source_of_slot[slot])
            tensors = reader.read(range(source, source + 1))
            self._unpacked[slot] = False  # _load_part packs only slots not marked unpacked
            try:
                self._load_part(
                    tensors.pop("gate"),
                    tensors.pop("up"),
                    tensors.pop("down"),
                    torch.where(torch.arange(self.num_experts) == slot, 0, -1),
                    {name: tensors.get(name) for name in ("gate_scale", "up_scale", "down_scale")},
                    {name: tensors.get(name) for name in ("gate_zeros", "up_zeros", "down_zeros")},
                    {name: tensors.get(name) for name in ("gate_bias", "up_bias", "down_bias")},
                    part=True,
                    first_expert=source,
                )
            except BaseException:
                self._unpacked[slot] = True
                raise

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

    def _drop_orphaned_call(self, adds: torch.Tensor | deferred.DeferredExperts | None = None) -> None:
        """Wait for the engines' call and for the deferred experts it took (`adds`), and drop both."""
        try:
            if self._layer.pending:
                self._layer.sync()
            if isinstance(adds, deferred.DeferredExperts):
                adds.collect()  # frees that layer for its next call
        except (RuntimeError, ValueError):
            pass  # the call's own error: it is dropped with it

    def _drop_in_flight(self) -> None:
        """Wait for a direct-path call in flight and forget it (its output, and the deferred experts
        it took, are lost: the caller has given up on the call)."""
        with self._lock:
            out = self._in_flight
            if not isinstance(out, torch.Tensor):
                return  # none, or on a stream (its host functions finish it)
            adds, self._in_flight, self._adds = self._adds, None, None
            if self._layer is not None:
                self._drop_orphaned_call(adds)

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
            if not self._loaded:
                raise RuntimeError(
                    "this wrapper is closed"
                    if self._layer is None
                    else "weights are not loaded: call load_weights_from_tensors first"
                )
            if self._gpu_experts_mask.data_ptr() != self._gpu_mask_address:
                self._follow_gpu_mask()
            if self._unpacked is not None:
                self._load_experts_the_mask_hands_back()
            if stream is not None:
                self._require_idle("submit a forward", deferred_too=False, stream_too=False)
                self._submit_on_stream(stream, hidden_states, topk_ids, topk_weights)
                return
            self._require_idle("submit a forward", deferred_too=False)
            if self._interrupted:  # a call an interrupt may have left behind mid-way: finish it, drop it
                self._interrupted = False
                self._drop_orphaned_call()
            x, ids, weights = check_call_inputs(
                hidden_states, topk_ids, topk_weights, self.hidden_size, self.num_experts_per_tok
            )
            tokens = x.shape[0]
            out = self._spare_out if self._spare_tokens == tokens else None
            if out is None:
                out = torch.empty_like(x)
            self._spare_out = None
            deferred_ids, own = None, self._deferred
            if own is not None and tokens > 0:
                # Refused before anything starts: a call that fails half-way (its deferred part) would
                # leave the engines writing memory nobody holds.
                if own.out is not None and deferred.pending() is not own:
                    taker = own.taker
                    if taker is not None and taker._adds is own:
                        raise RuntimeError(
                            f"layer {self.layer_idx}'s deferred experts of its last call are being added by "
                            f"layer {taker.layer_idx}'s call, which has not been synced: sync it before "
                            "calling this layer again"
                        )
                    own.collect()  # the call that took them was dropped (interrupted): drop them
                require_expert_ids(ids, self.num_experts)
                ids, deferred_ids = self.select_deferred_experts(
                    ids, weights, self.num_experts_per_tok - own.per_token
                )
            # Once the engines write `out`, whatever is raised (a refused pass, or a KeyboardInterrupt
            # the moment the submit returns), the call is waited for before `out` can be freed.
            try:
                if tokens > 0:
                    # check_call_inputs made them contiguous with the engine's dtypes and shapes. The
                    # engines compare the mask with the one they hold (a memcmp) and update on change.
                    self._layer.submit_addresses(
                        x.data_ptr(), tokens, ids.data_ptr(), weights.data_ptr(), out.data_ptr(),
                        self._gpu_mask_address,
                    )  # fmt: skip
                if 0 < tokens <= _SPARE_OUTPUT_MAX_TOKENS:
                    self._spare_out, self._spare_tokens = torch.empty_like(x), tokens
                # Taken once this call is on its way, so a refused call leaves them for the next one.
                self._adds = deferred.take_pending(self, own, tokens)
                if deferred_ids is not None:  # queued behind the call above: runs while the caller goes on
                    with deferred.LOCK:
                        own.out = torch.empty_like(x)  # held before the engines write it
                        try:
                            own.layer.submit_addresses(
                                x.data_ptr(), x.shape[0], deferred_ids.data_ptr(), weights.data_ptr(),
                                own.out.data_ptr(),
                            )  # fmt: skip
                        except BaseException:
                            if not own.layer.pending:
                                own.out = None
                            raise
                        deferred.set_pending(own)
                self._in_flight = out  # the engines write it until sync
            except BaseException:
                if self._in_flight is not out:
                    self._interrupted = True
                    adds, self._adds = self._adds, None
                    self._drop_orphaned_call(adds)
                raise

    def _submit_on_stream(
        self, stream: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> None:
        device = hidden_states.device if isinstance(hidden_states, torch.Tensor) else torch.device("cpu")
        # Conversions and the deferred split are torch operations: queued on the stream. Entering it
        # costs tens of microseconds, so calls that need neither (SGLang's) skip it.
        own = self._deferred
        plain = own is None and stream_path.as_engine_reads(hidden_states, topk_ids, topk_weights)
        with contextlib.nullcontext() if plain else stream_path.on_stream(stream, device):
            x, ids, weights = check_call_inputs(
                hidden_states,
                topk_ids,
                topk_weights,
                self.hidden_size,
                self.num_experts_per_tok,
                on_device=True,
            )
            deferred_ids = None
            if own is not None and x.shape[0] > 0:
                ids, deferred_ids = self.select_deferred_experts(
                    ids.to(torch.int64), weights, self.num_experts_per_tok - own.per_token
                )
        if x.shape[0] == 0:
            self._in_flight = stream_path.StreamCall(stream, 0, 0, x.device, None, None, False)
            return
        if self._stream is None:
            self._stream = stream_path.StreamForward(
                self._layer, own and own.layer, self.num_experts, self.hidden_size,
                self.num_experts_per_tok, self.layer_idx % 2,
            )  # fmt: skip
        pending = deferred.take_pending(self, own, x.shape[0], on_stream=True)
        adds = None if pending is None else pending.stream_call
        call = self._stream.submit(
            stream,
            x,
            ids,
            weights,
            deferred_ids,
            adds,
            KTMoEWrapper._capture_batch_sizes,
            self._gpu_mask_address,
        )
        with deferred.LOCK:  # taken once this call is on its way, as on the direct path
            if pending is not None:
                pending.stream_call = None
                if deferred.pending() is pending:
                    deferred.set_pending(None)
            if deferred_ids is not None:
                own.stream_call = call
                deferred.set_pending(own)
        self._in_flight = call

    def sync_forward(
        self, hidden_states: torch.Tensor | None = None, cuda_stream: object | None = None
    ) -> torch.Tensor:
        """Wait for the forward started by ``submit_forward`` and return its [T, H] bf16 output.

        Direct path: waits, and returns a new tensor. Stream path: queues the wait and the copy of
        the output on the stream and returns at once; the tensor returned (on the inputs' device) is
        a buffer kept per (stream, batch size, layer parity): it holds this output once the stream
        has reached this point and until the sync of the same batch size two layers later. An error
        of the CPU task (a bad expert id, say) is raised by this or a later sync_forward of this
        layer, and that call's output is NaN."""
        with self._lock:
            out = self._in_flight
            if out is None:
                raise RuntimeError("sync_forward called without a submit_forward")
            if isinstance(out, stream_path.StreamCall):
                given = None if cuda_stream is None else stream_path.stream_handle(cuda_stream, None)
                if given is not None and given != out.stream:
                    raise ValueError(
                        f"sync_forward's cuda_stream ({given}) is not the one submit_forward used "
                        f"({out.stream})"
                    )
                self._in_flight = None
                if out.tokens == 0:
                    return torch.empty((0, self.hidden_size), dtype=torch.bfloat16, device=out.device)
                return self._stream.sync(out)
            synced = out.shape[0] == 0
            try:
                if not synced:
                    self._layer.sync()  # with subpools: also sums their partial outputs into out
                    synced = True
                adds = self._adds
                if isinstance(adds, deferred.DeferredExperts):
                    adds = adds.collect()
                if adds is not None:  # the deferred experts of the call before
                    out = (out.float() + adds.float()).to(torch.bfloat16)
            finally:
                # Interrupted before the engines were waited for, the call stays in flight (and
                # `out` held) for a later sync_forward, or for forward() to drop.
                if synced or not self._layer.pending:
                    self._in_flight, self._adds = None, None
            return out

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
            if not self._loaded:
                raise RuntimeError("weights are not loaded: call load_weights_from_tensors first")
            if self._zero_points or self._bias_table is not None:
                what = "zero points (asymmetric INT4)" if self._zero_points else "expert biases"
                raise NotImplementedError(
                    f"weights loaded with {what} have no GPU buffer layout: the buffers hold values and "
                    "scales only"
                )
            fmt, H, inter = self._format, self.hidden_size, self.moe_intermediate_size
            tp = require_int("gpu_tp_count", gpu_tp_count, 1)
            down_group = self._scale_groups["down"]
            if inter % tp or (inter // tp) % max(down_group, 1):
                keep = f" into whole blocks of {down_group} inputs per down scale" if down_group else ""
                raise ValueError(f"gpu_tp_count={tp} must split moe_intermediate_size={inter} evenly{keep}")
            expert = require_int("expert_id", expert_id, 0)
            if expert >= self.num_experts:
                raise ValueError(f"expert_id must be in [0, {self.num_experts}), got {expert}")
            w13 = require_addresses("w13_weight_ptrs", w13_weight_ptrs, tp)
            w2 = require_addresses("w2_weight_ptrs", w2_weight_ptrs, tp)
            if fmt.scale_groups:
                s13 = require_addresses("w13_scale_ptrs", w13_scale_ptrs, tp)
                s2 = require_addresses("w2_scale_ptrs", w2_scale_ptrs, tp)
            else:
                for name, ptrs in (("w13_scale_ptrs", w13_scale_ptrs), ("w2_scale_ptrs", w2_scale_ptrs)):
                    if ptrs is not None and not isinstance(ptrs, (list, tuple)):
                        raise TypeError(f"{name} must be a list, empty or None for {fmt.name}")
                s13 = s2 = [0] * tp  # no scales
            gate_group = self._scale_groups["gate"]
            if gate_group != self._scale_groups["up"]:
                raise ValueError(
                    f"gate and up were loaded with different {fmt.name} group sizes: w13 scale rows cannot "
                    "hold both"
                )
            write_back.write_expert(
                fmt, write_back.layout_of(self.method), self._subpools, H, inter, self._scale_groups, expert,
                w13, s13, w2, s2,
            )  # fmt: skip

    def sync_write_weight_scale_to_buffer(self) -> None:
        """Kept for upstream's call sequence: submit_write_weight_scale_to_buffer finished the work."""

    def close(self) -> None:
        """Wait for a forward in flight, then free the weights and stop the worker threads.

        Later calls raise RuntimeError. Runs by itself when the wrapper is garbage-collected and,
        for every wrapper still alive, when the interpreter exits."""
        with self._lock:
            own = self._deferred
            try:
                if self._stream is not None:  # queued host functions of this layer do nothing from now on
                    self._stream.close(
                        self._in_flight if isinstance(self._in_flight, stream_path.StreamCall) else None
                    )
                    if own is not None and own.stream_call is not None:
                        stream_path.BUFFERS.retire(own.stream_call.slot)
                elif self._in_flight is not None and self._in_flight.shape[0] > 0:
                    self._layer.sync()
                with deferred.LOCK:
                    if own is not None:
                        own.stream_call = None
                        if deferred.pending() is own:  # nobody will add them now
                            deferred.set_pending(None)
                        if own.out is not None:  # a later call took them: it gets them still
                            own.closed_out = own.collect_locked()
            except RuntimeError:
                pass  # a forward lost to fork(): nothing of it runs any more
            finally:
                self._in_flight, self._adds = None, None
                self._loaded = False
                self._layer, self._subpools, self._pools, self._deferred = None, [], None, None
                self._spare_out = None

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
                "synchronize "
                "the stream first"
            )
        if deferred_too and own is not None and own.out is not None:
            raise RuntimeError(
                f"cannot {action} while this layer's deferred experts are in flight: sync the next layer "
                "or call KTMoEWrapper.flush_deferred() first"
            )

    # ---- upstream class-level buffer management ------------------------------------------------
    @classmethod
    def set_capture_batch_sizes(cls, batch_sizes: Sequence[int]) -> None:
        """Record the batch sizes a CUDA-graph runner captures (kept for upstream compatibility)."""
        cls._capture_batch_sizes = [require_int("batch size", int(b), 1) for b in batch_sizes]

    @classmethod
    def get_capture_batch_sizes(cls) -> list[int]:
        return list(cls._capture_batch_sizes)

    @classmethod
    def clear_buffer_cache(cls) -> None:
        """Free the per-call scratch buffers of every idle wrapper (they grow back on demand), and
        the stream path's host and device buffers when no call on a stream is queued (CUDA graphs
        captured before refer to them: capture again). A wrapper busy on another thread keeps its
        buffers."""
        busy_streams = False
        for wrapper in list(cls._instances):
            if not wrapper._lock.acquire(blocking=False):
                busy_streams |= wrapper._stream is not None
                continue
            try:
                stream = wrapper._stream
                busy_streams |= stream is not None and (
                    wrapper._in_flight is not None
                    or wrapper._deferred is not None
                    and wrapper._deferred.stream_call is not None
                    or stream.layer.outstanding > 0
                )
                if wrapper._in_flight is None and wrapper._layer is not None:
                    wrapper._layer.release_scratch()
                    wrapper._spare_out, wrapper._spare_tokens = None, -1
                    own = wrapper._deferred
                    with deferred.LOCK:
                        if own is not None and own.out is None:
                            own.layer.release_scratch()
            finally:
                wrapper._lock.release()
        if not busy_streams:
            stream_path.BUFFERS.clear()

    @classmethod
    def _close_all(cls) -> None:
        for wrapper in list(cls._instances):
            wrapper.close()

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
