"""``experts_implementation="kt_kernel"``: transformers MoE experts computed by KTMoEWrapper.

    import kt_kernel.integrations.transformers  # registers "kt_kernel" in transformers' ExpertsInterface
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="kt_kernel")

transformers calls ``experts_forward(module, hidden_states, top_k_index, top_k_weights)`` for every
experts module. At a module's first call its weights are packed into a KTMoEWrapper kept on the module
(``_kt_kernel_experts``), in the format ``configure`` set, and the module's expert parameters are
released (emptied) unless ``keep_weights``. Every module's wrapper runs on the same worker threads
(KTMoEWrapper shares them between wrappers of one configuration). A copy of a packed module
(copy.deepcopy, pickle) packs again at its first call, from the weights it kept; one whose weights
were released cannot be copied, nor run by another experts_implementation (a clear error says so).
"""

from __future__ import annotations

import copyreg
import itertools
import os
import threading
from dataclasses import dataclass

import torch

try:
    from transformers.integrations.moe import ExpertsInterface
except ImportError as error:  # transformers is an optional dependency
    raise ImportError(
        "kt_kernel.integrations.transformers needs transformers >= 5 (its ExpertsInterface): "
        "pip install 'kt-kernel[transformers]'"
    ) from error

from .. import formats
from ..arguments import require_int
from ..experts import THREADS_PER_CPU_LIMIT, KTMoEWrapper
from .hf_experts import expert_tensors, gate_function

#: The name models are given: ``experts_implementation=NAME``.
NAME = "kt_kernel"
#: The module attribute that holds its KTMoEWrapper once packed.
WRAPPER_ATTRIBUTE = "_kt_kernel_experts"
#: The expert parameters released after packing.
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
#: Tokens per engine call by default: longer calls are split, which bounds the engine's per-call buffers.
DEFAULT_CHUNKED_PREFILL_SIZE = 4096


@dataclass(frozen=True)
class Settings:
    """How experts modules are packed and run (``configure``)."""

    weight_format: str
    cpuinfer_threads: int
    threadpool_count: int
    keep_weights: bool
    chunked_prefill_size: int


_settings: Settings
_pack_lock = threading.Lock()
_layer_ids = itertools.count()


def configure(
    weight_format: str = "BF16",
    cpuinfer_threads: int | None = None,
    threadpool_count: int = 1,
    keep_weights: bool = False,
    chunked_prefill_size: int = DEFAULT_CHUNKED_PREFILL_SIZE,
) -> Settings:
    """Set how experts modules packed from now on are held and run; returns the settings.

    ``weight_format``: a format of kt_kernel.formats.FORMATS (or an alias), the float weights are
    quantized to it at packing. ``cpuinfer_threads`` (default: the CPUs this process may use) and
    ``threadpool_count``: KTMoEWrapper's. ``keep_weights``: keep the module's expert parameters after
    packing (by default they are emptied, so the model holds its experts once). Calls of more tokens
    than ``chunked_prefill_size`` run in chunks of that many. Bad values raise TypeError/ValueError and
    change nothing. A module already packed keeps the settings it was packed with.
    """
    global _settings
    if not isinstance(weight_format, str):
        raise TypeError(f"weight_format must be a str, got {type(weight_format).__name__}")
    if weight_format.upper() not in formats.METHODS:
        raise ValueError(
            f"weight_format must be one of {', '.join(formats.FORMATS)} (or an alias: "
            f"{', '.join(m for m in formats.METHODS if m not in formats.FORMATS)}), got {weight_format!r}"
        )
    usable_cpus = len(os.sched_getaffinity(0))
    threads = (
        usable_cpus if cpuinfer_threads is None else require_int("cpuinfer_threads", cpuinfer_threads, 1)
    )
    if threads > THREADS_PER_CPU_LIMIT * usable_cpus:
        raise ValueError(
            f"cpuinfer_threads={threads} is more than {THREADS_PER_CPU_LIMIT} x the {usable_cpus} CPUs this "
            "process may run on"
        )
    count = require_int("threadpool_count", threadpool_count, 1)
    if count > threads:
        raise ValueError(f"threadpool_count ({count}) cannot exceed cpuinfer_threads ({threads})")
    if not isinstance(keep_weights, bool):
        raise TypeError(f"keep_weights must be a bool, got {type(keep_weights).__name__}")
    chunk = require_int("chunked_prefill_size", chunked_prefill_size, 1)
    _settings = Settings(formats.get(weight_format).name, threads, count, keep_weights, chunk)
    return _settings


def settings() -> Settings:
    """The settings modules are packed with now."""
    return _settings


def _pack(module: torch.nn.Module, top_k: int) -> KTMoEWrapper:
    """The module's experts packed into a new KTMoEWrapper (set on the module), its parameters released
    unless keep_weights."""
    with _pack_lock:  # two threads making a module's first call pack it once
        wrapper = module.__dict__.get(WRAPPER_ATTRIBUTE)
        if wrapper is not None:
            return wrapper
        config = _settings
        gate = gate_function(module)  # refused before anything is copied
        tensors = expert_tensors(module)
        experts, intermediate, hidden = tensors.gate.shape
        try:
            wrapper = KTMoEWrapper(
                layer_idx=next(_layer_ids), num_experts=experts, num_experts_per_tok=top_k,
                hidden_size=hidden, moe_intermediate_size=intermediate, gpu_experts_mask=None,
                cpuinfer_threads=config.cpuinfer_threads, threadpool_count=config.threadpool_count,
                weight_path=None, chunked_prefill_size=config.chunked_prefill_size,
                method=config.weight_format, swiglu_limit=gate.limit, swiglu_alpha=gate.alpha,
            )  # fmt: skip
        except ValueError as error:  # a format's dimension rule, say: name the module it refuses
            raise ValueError(
                f"{type(module).__name__} cannot be packed as {config.weight_format}: {error}"
            ) from error
        wrapper.load_weights_from_tensors(tensors.gate, tensors.up, tensors.down, **tensors.biases())
        del tensors
        wrapper._kt_module_weights_kept = config.keep_weights  # what a copy may pack again from
        if not config.keep_weights:
            for name in EXPERT_PARAMETERS:
                parameter = getattr(module, name, None)
                if isinstance(parameter, torch.Tensor):
                    # In place: the Parameter stays registered (state_dict, named_parameters), empty.
                    parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
            module.register_forward_pre_hook(_refuse_other_implementations)
        setattr(module, WRAPPER_ATTRIBUTE, wrapper)
        return wrapper


def _refuse_other_implementations(module: torch.nn.Module, args: tuple) -> None:
    """A forward pre-hook of a module whose weights were released: any experts_implementation but
    this one reads them (transformers' eager indexes them: an IndexError deep inside it)."""
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", NAME)
    if implementation != NAME:
        raise ValueError(
            f"{type(module).__name__}: experts_implementation={implementation!r} needs the expert weights, "
            f"which experts_implementation={NAME!r} released when it packed them (keep_weights=False, the "
            f"default); call kt_kernel.integrations.transformers.configure(keep_weights=True) before the "
            "first call to keep them, or reload the model"
        )


def _copy_wrapper(wrapper: KTMoEWrapper) -> tuple:
    """copy.deepcopy and pickle of a KTMoEWrapper (copyreg): its engines cannot be copied. One a
    module packed with its weights kept becomes None in the copy, which packs again at its first
    call; any other is a TypeError saying why."""
    kept = getattr(wrapper, "_kt_module_weights_kept", None)
    if kept:
        return type(None), ()
    if kept is None:
        raise TypeError("a KTMoEWrapper cannot be copied or pickled (its engines hold the packed weights)")
    raise TypeError(
        f"a module packed by experts_implementation={NAME!r} with keep_weights=False (the default) cannot "
        "be copied or pickled: its expert weights were released at packing; call "
        "kt_kernel.integrations.transformers.configure(keep_weights=True) before the first call to keep them"
    )


def experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts module's output for hidden_states [T, H] routed to top_k_index / top_k_weights [T, K],
    in hidden_states' dtype, as transformers' experts implementations return it."""
    if hidden_states.device.type != "cpu":
        raise ValueError(
            f"{type(module).__name__}: experts_implementation='kt_kernel' computes experts on the CPU; "
            f"hidden_states are on {hidden_states.device}"
        )
    if torch.is_grad_enabled():
        # Trainable experts would get no .grad, silently, as inputs would: both refused.
        trainable = [
            name for name in EXPERT_PARAMETERS if getattr(getattr(module, name, None), "requires_grad", False)
        ]
        if hidden_states.requires_grad or trainable:
            needs = (
                f"its parameters {', '.join(trainable)} require grad"
                if trainable
                else "its input requires grad"
            )
            raise NotImplementedError(
                f"{type(module).__name__}: experts_implementation='kt_kernel' has no backward, and {needs}: "
                "run the model under torch.no_grad() or torch.inference_mode() (generate does), or freeze "
                "the experts (requires_grad_(False))"
            )
    wrapper = module.__dict__.get(WRAPPER_ATTRIBUTE)
    if wrapper is None:
        wrapper = _pack(module, top_k_index.shape[-1])
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    tokens = x.shape[0]
    ids, weights = top_k_index.reshape(tokens, -1), top_k_weights.reshape(tokens, -1)
    step = wrapper.chunked_prefill_size
    if tokens <= step:
        return wrapper.forward(x, ids, weights).to(hidden_states.dtype).reshape(shape)
    out = torch.empty_like(x)
    for start in range(0, tokens, step):
        part = slice(start, start + step)
        out[part] = wrapper.forward(x[part], ids[part], weights[part])
    return out.reshape(shape)


configure()  # the defaults
ExpertsInterface.register(NAME, experts_forward)
copyreg.pickle(KTMoEWrapper, _copy_wrapper)
