"""A transformers experts module read into KTMoEWrapper's terms: its gate function, its weights and biases.

transformers' ``@use_experts_implementation`` declares how a module holds its experts
(``has_gate``, ``is_concatenated``, ``is_transposed``, ``has_bias``, ``has_post_expert_norm``) and its
backends (integrations/moe.py: batched_mm, grouped_mm) compute ``down(_apply_gate(gate_up(x)))``;
this reads them the same way. Needs only torch: transformers is imported by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Module attributes a clamped SwiGLU's _apply_gate reads (gpt-oss: limit/alpha; DeepSeek-V4: limit;
# MiniMax-M3, GLM-5, HY-V4: swiglu_limit/swiglu_alpha).
_LIMIT_ATTRIBUTES = ("limit", "swiglu_limit")
_ALPHA_ATTRIBUTES = ("alpha", "swiglu_alpha")
#: Rows of gate_up values a module's _apply_gate is checked on.
_PROBE_ROWS = 8


@dataclass(frozen=True)
class GateFunction:
    """The kernels' gate: silu(gate) * up, with ``limit`` > 0 first clamping gate <= limit and up to
    [-limit, limit], and with ``alpha`` > 0 gate * sigmoid(alpha * gate) * (up + 1) instead."""

    limit: float = 0.0
    alpha: float = 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit > 0:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        if self.alpha > 0:
            return gate * torch.sigmoid(self.alpha * gate) * (up + 1)
        return F.silu(gate) * up


@dataclass
class ExpertTensors:
    """One module's experts in KTMoEWrapper's layout: gate/up [E, I, H], down [E, H, I]; biases (or
    None) gate/up [E, I], down [E, H]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None

    def biases(self) -> dict[str, torch.Tensor]:
        """load_weights_from_tensors' bias arguments: none for experts without biases."""
        if self.gate_bias is None:
            return {}
        return {"gate_bias": self.gate_bias, "up_bias": self.up_bias, "down_bias": self.down_bias}


def split_gate_up(module: torch.nn.Module, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up out of the last dimension of ``gate_up``: its halves (concatenated) or its even and
    odd entries (interleaved, gpt-oss)."""
    if getattr(module, "is_concatenated", True):
        return gate_up.chunk(2, dim=-1)
    return gate_up[..., 0::2], gate_up[..., 1::2]


def intermediate_size(module: torch.nn.Module) -> int:
    """I: half of gate_up_proj's 2I, its second dimension ([E, 2I, H]) or its last (transposed)."""
    gate_up = _checked_weight(module, "gate_up_proj")
    return gate_up.shape[2 if getattr(module, "is_transposed", False) else 1] // 2


def activation_name(module: torch.nn.Module) -> str:
    """How a message names the module's activation: hidden_act (else act_fn's class), and the class's
    own _apply_gate where it has one."""
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    act = f"hidden_act {act!r}" if act else f"act_fn {type(getattr(module, 'act_fn', None)).__name__}"
    # The decorator gives classes without one transformers' _default_apply_gate: act_fn(gate) * up.
    own_gate = getattr(getattr(type(module), "_apply_gate", None), "__name__", "") != "_default_apply_gate"
    return f"{type(module).__name__}._apply_gate, {act}" if own_gate else act


def _positive_attributes(module: torch.nn.Module, names: tuple[str, ...]) -> list[float]:
    """The finite positive numbers among the module's (and its config's) attributes ``names``."""
    owners = (module, getattr(module, "config", None))
    values = [getattr(owner, name, None) for owner in owners for name in names]
    numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return list(dict.fromkeys(v for v in numbers if math.isfinite(v) and v > 0))


def gate_function(module: torch.nn.Module) -> GateFunction:
    """The kernels' gate function that the module's own gate computes, or a ValueError naming the
    module's class and activation. The candidates come from the module's clamp attributes (and plain
    SwiGLU); the one taken must give what ``module._apply_gate`` gives on a probe that crosses every
    clamp, in the layout the module declares, so nothing the kernels do not compute passes."""
    name = type(module).__name__
    if not getattr(module, "has_gate", True):
        raise ValueError(
            f"{name}: experts without a gate (up_proj, {activation_name(module)}, down_proj) are not "
            "computed by kt_kernel, whose kernels compute gated (SwiGLU) experts"
        )
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(
            f"{name}: a norm after each expert (has_post_expert_norm) is not computed by kt_kernel"
        )
    intermediate = intermediate_size(module)
    limits = _positive_attributes(module, _LIMIT_ATTRIBUTES)
    alphas = _positive_attributes(module, _ALPHA_ATTRIBUTES)
    candidates = [GateFunction(limit, alpha) for limit in [*limits, 0.0] for alpha in [*alphas, 0.0]]
    # Magnitudes log-uniform from 0.01 to 4x the largest clamp (at least 256), either sign: every
    # clamp, even one read from elsewhere, is crossed, and silu is seen near 0 and in both tails.
    generator = torch.Generator().manual_seed(0)
    top = math.log10(4 * max([64.0, *limits]))
    magnitudes = 10 ** (torch.rand(_PROBE_ROWS, 2 * intermediate, generator=generator) * (top + 2) - 2)
    signs = torch.randint(0, 2, magnitudes.shape, generator=generator) * 2 - 1
    probe = magnitudes * signs
    try:
        with torch.no_grad():
            expected = module._apply_gate(probe.clone()).float()
    except Exception as error:  # an _apply_gate of another shape or signature: not ours either
        raise ValueError(
            f"{name}: its activation ({activation_name(module)}) is not computed by kt_kernel: "
            f"_apply_gate failed on a probe ({error})"
        ) from error
    for candidate in candidates:
        got = candidate(*split_gate_up(module, probe))
        if got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
            return candidate
    raise ValueError(
        f"{name}: its activation ({activation_name(module)}) is not computed by kt_kernel, whose kernels "
        "compute silu(gate) * up and the clamped SwiGLU of gpt-oss / DeepSeek-V4 (swiglu_limit, "
        "swiglu_alpha); use another experts_implementation for this model"
    )


def _checked_weight(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The module's tensor ``name``, refused unless it holds float weights."""
    tensor = getattr(module, name, None)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{type(module).__name__} has no {name} tensor for kt_kernel to read")
    if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"{type(module).__name__}.{name} is {tensor.dtype}: kt_kernel reads float expert weights "
            "(bf16, fp16, fp32); load a quantized checkpoint dequantized (docs/transformers.md)"
        )
    if tensor.is_meta:
        raise ValueError(
            f"{type(module).__name__}.{name} is on the meta device: it holds no weights to pack (load the "
            "model's weights onto the CPU first)"
        )
    if tensor.numel() == 0:
        raise ValueError(
            f"{type(module).__name__}.{name} is empty: its weights were released after packing "
            "(kt_kernel.integrations.transformers.configure(keep_weights=True) keeps them)"
        )
    return tensor.detach()


def expert_tensors(module: torch.nn.Module) -> ExpertTensors:
    """The module's experts as KTMoEWrapper takes them, read as batched_mm reads them: gate_up_proj
    [E, 2I, H] ([E, H, 2I] transposed) with gate and up concatenated or interleaved along 2I, down_proj
    [E, H, I] ([E, I, H] transposed), and with has_bias gate_up_proj_bias [E, 2I], down_proj_bias [E, H]."""
    transposed = getattr(module, "is_transposed", False)
    gate_up = _checked_weight(module, "gate_up_proj").cpu()
    down = _checked_weight(module, "down_proj").cpu()
    # Viewed as [E, H, 2I] so that split_gate_up splits the last dimension; then gate/up [E, I, H].
    gate, up = split_gate_up(module, gate_up if transposed else gate_up.transpose(1, 2))
    gate, up = gate.transpose(1, 2).contiguous(), up.transpose(1, 2).contiguous()
    down = (down.transpose(1, 2) if transposed else down).contiguous()
    gate_bias = up_bias = down_bias = None
    if getattr(module, "has_bias", False):
        gate_bias, up_bias = split_gate_up(module, _checked_weight(module, "gate_up_proj_bias").cpu().float())
        gate_bias, up_bias = gate_bias.contiguous(), up_bias.contiguous()
        down_bias = _checked_weight(module, "down_proj_bias").cpu().float().contiguous()
    return ExpertTensors(gate, up, down, gate_bias, up_bias, down_bias)
