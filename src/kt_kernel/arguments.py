"""What callers hand KTMoEWrapper, checked: its constructor's options, ints, the GPU mask, a call's
inputs, expert ids, buffer addresses. Each check raises the TypeError or ValueError that names the
argument."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .expert_weights import FLOAT_DTYPES, require_cpu_tensor, require_tensor
from .formats import require_shape


def require_int(name: str, value: object, minimum: int) -> int:
    if value is None:
        raise TypeError(f"{name} is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def optional_non_negative(name: str, value: object) -> float | None:
    """None, or a finite float >= 0 (0 and None both mean off)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0 (or None), got {value}")
    return float(value)


def require_expert_ids(ids: torch.Tensor, num_experts: int) -> None:
    """ValueError naming the first id outside [-1, num_experts), as the engine words it."""
    bad = (ids < -1) | (ids >= num_experts)
    if bool(bad.any()):
        t, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"topk_ids[{t}, {k}] = {int(ids[t, k])} is outside [-1, {num_experts})")


def _lowest_mappable_address() -> int:
    """No buffer a caller hands over lies below this: /proc/sys/vm/mmap_min_addr, and at least
    64 KiB (Linux's usual setting; a process's own memory starts far above it)."""
    try:
        with open("/proc/sys/vm/mmap_min_addr") as f:
            return max(65536, int(f.read()))
    except (OSError, ValueError):
        return 65536


_MIN_ADDRESS = _lowest_mappable_address()


def require_addresses(name: str, value: object, count: int) -> list[int]:
    """``count`` memory addresses (a caller's data_ptr()s) given as a list or tuple: none below the
    lowest address Linux maps (an int passed where a data_ptr() belongs), none past 2^64."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of data_ptr() addresses, got {type(value).__name__}")
    if len(value) != count:
        raise ValueError(f"{name} must hold gpu_tp_count = {count} addresses, got {len(value)}")
    for index, address in enumerate(value):
        if isinstance(address, bool) or not isinstance(address, int):
            raise TypeError(f"{name}[{index}] must be an int address, got {type(address).__name__}")
        if not _MIN_ADDRESS <= address < 2**64:
            raise ValueError(f"{name}[{index}] = {address} is not a valid address (a tensor's data_ptr())")
    return list(value)


def initial_gpu_mask(
    mask: torch.Tensor | Sequence[bool] | int | None, count: int | None, num_experts: int
) -> torch.Tensor:
    """The wrapper's gpu_experts_mask from its two ways of saying it (upstream's num_gpu_experts=n:
    experts 0..n-1)."""
    if isinstance(mask, int) and not isinstance(mask, bool):
        # Upstream's older signature had num_gpu_experts in gpu_experts_mask's place.
        if count is not None and count != mask:
            raise ValueError(f"num_gpu_experts is given twice: {mask} and {count}")
        mask, count = None, mask
    if count is not None:
        require_int("num_gpu_experts", count, 0)
        if count > num_experts:
            raise ValueError(f"num_gpu_experts ({count}) cannot exceed num_experts ({num_experts})")
    if mask is None:
        # Upstream's num_gpu_experts = n puts experts 0..n-1 on the GPU.
        checked = torch.zeros(num_experts, dtype=torch.bool)
        checked[: count or 0] = True
        return checked
    checked = check_gpu_mask(mask, num_experts)
    if count is not None and int(checked.sum()) != count:
        raise ValueError(
            f"num_gpu_experts={count} disagrees with gpu_experts_mask, "
            f"which marks {int(checked.sum())} experts"
        )
    return checked


def check_gpu_mask(mask: torch.Tensor | Sequence[bool] | None, num_experts: int) -> torch.Tensor:
    """A new contiguous CPU bool [num_experts] copy of a mask given as a tensor or list."""
    if mask is None:
        return torch.zeros(num_experts, dtype=torch.bool)
    if isinstance(mask, torch.Tensor):
        if mask.layout != torch.strided:
            raise TypeError(f"gpu_experts_mask must be a dense tensor, got layout {mask.layout}")
        if mask.is_meta:
            raise ValueError("gpu_experts_mask is a meta tensor: it holds no values")
    elif not isinstance(mask, (list, tuple)):
        raise TypeError(
            f"gpu_experts_mask must be a bool tensor or a list of bools, got {type(mask).__name__}"
        )
    try:
        mask = torch.as_tensor(mask)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"gpu_experts_mask must be a bool tensor or a list of bools: {error}") from error
    if mask.device.type != "cpu":
        mask = mask.cpu()  # a mask is tiny; a GPU-side one is welcome
    if mask.dtype != torch.bool:
        raise TypeError(f"gpu_experts_mask must be a bool tensor, got {mask.dtype}")
    require_shape("gpu_experts_mask", mask, (num_experts,), "[num_experts]")
    return mask.clone(memory_format=torch.contiguous_format)  # the engines read its memory


def follow_gpu_mask(mask: torch.Tensor, num_experts: int) -> int:
    """The address the engines read the mask at, where the caller gave the wrapper's mask tensor new
    storage (``mask.data = m``, ``mask.set_(m)``, ``share_memory_()``): the new storage, or an error
    for a mask that is no longer a CPU bool [num_experts] tensor. Never the old address."""
    if not (mask.is_cpu and mask.layout == torch.strided and mask.is_contiguous()):
        raise ValueError(
            f"gpu_experts_mask must stay a dense contiguous CPU tensor, got device {mask.device}, "
            f"layout {mask.layout}: assign a new mask with wrapper.gpu_experts_mask = m"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"gpu_experts_mask must stay a bool tensor, got {mask.dtype}")
    require_shape("gpu_experts_mask", mask, (num_experts,), "[num_experts]")
    return mask.data_ptr()


def check_call_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    hidden_size: int,
    top_k: int,
    on_device: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs as the engine reads them: bf16 x, int64 ids, float32 weights, contiguous.
    on_device (the stream path): on any one device, and int32 ids are kept (widened on the host)."""
    # Each torch attribute is read once: with the caches cold from the call before, a read costs
    # about a microsecond before a decode call starts.
    if on_device:
        x = require_tensor("hidden_states", hidden_states)
        topk_ids = require_tensor("topk_ids", topk_ids, x.device)
        topk_weights = require_tensor("topk_weights", topk_weights, x.device)
    else:
        x = require_cpu_tensor("hidden_states", hidden_states)
    x_dtype, x_shape = x.dtype, x.shape
    if x_dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden_states must be bfloat16, float16 or float32, got {x_dtype}")
    if len(x_shape) < 2 or x_shape[-1] != hidden_size:
        raise ValueError(
            f"hidden_states must have shape [..., tokens, hidden_size={hidden_size}], got {list(x_shape)}"
        )
    tokens = x_shape[0]
    if len(x_shape) > 2:  # [B, T, H] -> [B*T, H], as upstream
        x = x.reshape(-1, hidden_size)
        tokens = x.shape[0]
    if x_dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)  # the engine reads bf16 tokens: converted once, here
    ids = topk_ids if on_device else require_cpu_tensor("topk_ids", topk_ids)
    ids_dtype, ids_shape = ids.dtype, ids.shape
    if ids_dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_ids must be int64 or int32, got {ids_dtype}")
    weights = topk_weights if on_device else require_cpu_tensor("topk_weights", topk_weights)
    weights_dtype, weights_shape = weights.dtype, weights.shape
    if not weights_dtype.is_floating_point:
        raise TypeError(f"topk_weights must be a floating-point tensor, got {weights_dtype}")
    if len(ids_shape) > 2:
        ids = ids.reshape(-1, ids_shape[-1])
        ids_shape = ids.shape
    if len(weights_shape) > 2:
        weights = weights.reshape(-1, weights_shape[-1])
        weights_shape = weights.shape
    if tokens * top_k >= 2**31:
        raise ValueError(f"hidden_states has too many tokens ({tokens}) for one call")
    expected = (tokens, top_k)
    require_shape("topk_ids", ids_shape, expected, "[tokens, num_experts_per_tok]")
    require_shape("topk_weights", weights_shape, expected, "[tokens, num_experts_per_tok]")
    # Expert ids are range-checked by the engine while it buckets them (ValueError).
    # (.to() costs about 1 us even when the dtype already matches: a tiny call is about 20 us)
    if ids_dtype != torch.int64 and not (on_device and ids_dtype == torch.int32):
        ids = ids.to(torch.int64)
    if weights_dtype != torch.float32:
        weights = weights.to(torch.float32)
    return x.contiguous(), ids.contiguous(), weights.contiguous()


#: At most this many worker threads per CPU this process may run on (more only time-slice).
THREADS_PER_CPU_LIMIT = 4


@dataclass(frozen=True)
class LayerOptions:
    """KTMoEWrapper's constructor arguments, checked (each name as upstream's keyword)."""

    layer_idx: int
    num_experts: int
    num_experts_per_tok: int
    hidden_size: int
    moe_intermediate_size: int
    cpuinfer_threads: int
    threadpool_count: int
    chunked_prefill_size: int
    max_deferred_experts_per_token: int
    numa_nodes: list[int] | None
    swiglu_limit: float | None
    swiglu_alpha: float | None
    int8_activations: bool
    skip_gpu_expert_cpu_copy: bool


def check_layer_options(given: dict[str, object], max_dimension: int) -> LayerOptions:
    """KTMoEWrapper's constructor arguments ``given`` by name (its locals()), checked."""
    mode, top_k = given["mode"], given["num_experts_per_tok"]
    if mode == "sft":
        raise NotImplementedError("SFT mode is not supported: kt_kernel runs inference only")
    if mode != "inference":
        raise ValueError(f"mode must be 'inference' (upstream's 'sft' is not supported), got {mode!r}")
    layer_idx = require_int("layer_idx", given["layer_idx"], 0)
    num_experts = require_int("num_experts", given["num_experts"], 1)
    top_k = require_int("num_experts_per_tok", top_k, 1)
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) cannot exceed num_experts ({num_experts})")
    hidden = require_int("hidden_size", given["hidden_size"], 1)
    inter = require_int("moe_intermediate_size", given["moe_intermediate_size"], 1)
    for name, size in (("hidden_size", hidden), ("moe_intermediate_size", inter)):
        if size > max_dimension:
            raise ValueError(f"{name} must be <= {max_dimension}, got {size}")
    threads = require_int("cpuinfer_threads", given["cpuinfer_threads"], 1)
    usable_cpus = len(os.sched_getaffinity(0))
    if threads > THREADS_PER_CPU_LIMIT * usable_cpus:
        raise ValueError(
            f"cpuinfer_threads={threads} is more than {THREADS_PER_CPU_LIMIT} x the "
            f"{usable_cpus} CPUs this process may run on; extra threads would only take turns on them"
        )
    count = require_int("threadpool_count", given["threadpool_count"], 1)
    if count > threads:
        raise ValueError(
            f"threadpool_count ({count}) cannot exceed cpuinfer_threads ({threads}): each subpool needs "
            "a thread"
        )
    chunk = require_int("chunked_prefill_size", given["chunked_prefill_size"], 1)
    per_token = given["max_deferred_experts_per_token"]
    per_token = 0 if per_token is None else require_int("max_deferred_experts_per_token", per_token, 0)
    if per_token >= top_k:
        raise ValueError(
            f"max_deferred_experts_per_token ({per_token}) must be less than num_experts_per_tok ({top_k})"
        )
    for name in ("int8_activations", "skip_gpu_expert_cpu_copy"):
        if not isinstance(given[name], bool):
            raise TypeError(f"{name} must be a bool, got {type(given[name]).__name__}")
    numa_nodes = given["numa_nodes"]
    return LayerOptions(
        layer_idx, num_experts, top_k, hidden, inter, threads, count, chunk, per_token,
        None if numa_nodes is None else [int(n) for n in numa_nodes],
        optional_non_negative("swiglu_limit", given["swiglu_limit"]),
        optional_non_negative("swiglu_alpha", given["swiglu_alpha"]),
        given["int8_activations"], given["skip_gpu_expert_cpu_copy"],
    )  # fmt: skip
