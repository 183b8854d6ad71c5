"""Expert weights as the engines take them: checked, in their format's canonical layout (quantized
on load where given as floats), mapped to slots and sliced per subpool."""

from __future__ import annotations

import torch

from .formats import ShapeOf, WeightFormat, require_shape

#: Float dtypes accepted for weights quantized on load, and for hidden states.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Per projection: (values, scales or None, zero points or None), scales and zero points
#: [E, N, scales per row], as the engines take them.
Canonical = dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


def require_tensor(name: str, value: object, device: torch.device | None = None) -> torch.Tensor:
    """A dense tensor (on ``device`` if given) whose memory holds its values (a negative view is
    resolved)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on {device} (where hidden_states is), got device {value.device}")
    if value.is_neg():  # torch._neg_view: the engine reads memory, which holds the values unnegated
        value = value.resolve_neg()
    return value


def require_cpu_tensor(name: str, value: object) -> torch.Tensor:
    """A dense CPU tensor whose memory holds its values (a negative view is resolved)."""
    if isinstance(value, torch.Tensor) and not value.is_cpu:
        raise ValueError(f"{name} must be on the CPU, got device {value.device}")
    return require_tensor(name, value)


def prepare(
    fmt: WeightFormat,
    weights: dict[str, torch.Tensor],
    scales: dict[str, torch.Tensor | None],
    slot_map: torch.Tensor | None,
    num_experts: int,
    hidden: int,
    intermediate: int,
    zeros: dict[str, torch.Tensor | None] | None = None,
    part: bool = False,
    first_expert: int = 0,
) -> tuple[Canonical, torch.Tensor]:
    """The canonical gate/up/down of ``weights`` (gate_proj, up_proj, down_proj), ``scales``
    (gate_scale, ...; all None: float weights, quantized on load) and ``zeros`` (gate_zeros, ...;
    each optional, where the format has zero points), and the checked slot map (with ``part``,
    -1 is a slot another part of the load fills). Errors count the experts from ``first_expert``
    (the tensors hold a part of a layer)."""
    zeros = zeros or {}
    given_zeros = [name for name, zero in zeros.items() if zero is not None]
    given = [name for name, scale in scales.items() if scale is not None]
    if given_zeros and not given:
        raise ValueError(f"zero points ({', '.join(given_zeros)}) go with scales; pass gate_scale, ... too")
    if given and not fmt.scale_groups:
        raise ValueError(f"{fmt.name} weights take no scales, got {', '.join(given)}")
    if given and len(given) != 3:
        raise ValueError("pass all of gate_scale, up_scale and down_scale, or none of them")
    for name, tensor in weights.items():
        weights[name] = tensor = require_cpu_tensor(name, tensor)
        if tensor.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {list(tensor.shape)}")
    sources = weights["gate_proj"].shape[0]
    slot_map = check_slot_map(slot_map, sources, num_experts, part)

    size = {"hidden_size": hidden, "moe_intermediate_size": intermediate}

    def shape_of(name: str) -> ShapeOf:
        """Projection ``name``'s shape for a last (input) dimension of K / d, and its text."""
        rows, k = size if name.startswith("down") else reversed(size)
        return lambda d: ((sources, size[rows], size[k] // d), f"[E, {rows}, {k}{'' if d == 1 else f'/{d}'}]")

    projections = [name.removesuffix("_proj") for name in weights]
    if given:
        canonical = {}
        for projection, (name, values), (scale_name, scale) in zip(
            projections, weights.items(), scales.items(), strict=True
        ):
            values, scale = fmt.check_canonical(
                name, values, scale_name, require_cpu_tensor(scale_name, scale), shape_of(name), first_expert
            )
            zero_name = f"{projection}_zeros"
            zero = zeros.get(zero_name)
            if zero is not None:
                zero = fmt.checked_zeros(zero_name, require_cpu_tensor(zero_name, zero), scale)
            canonical[projection] = (values, scale, zero)
        return canonical, slot_map
    for name, tensor in weights.items():  # every tensor checked before any is quantized
        if tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be bf16, fp16 or fp32, got {tensor.dtype}")
        require_shape(name, tensor, *shape_of(name)(1))
    canonical = {
        p: (*fmt.from_float(name, t, first_expert), None)
        for p, (name, t) in zip(projections, weights.items(), strict=True)
    }
    return canonical, slot_map


def check_slot_map(
    slot_map: torch.Tensor | None, sources: int, num_experts: int, part: bool = False
) -> torch.Tensor:
    """int64 [num_experts]: the expert (of ``sources``) whose weights each physical slot holds
    (with ``part``: or -1, a slot another part of a load fills)."""
    if slot_map is None:
        if sources != num_experts:
            raise ValueError(
                f"the weight tensors hold {sources} experts but num_experts is {num_experts}; "
                "pass physical_to_logical_map_cpu to map slots to experts"
            )
        return torch.arange(num_experts, dtype=torch.int64)
    slot_map = require_cpu_tensor("physical_to_logical_map_cpu", slot_map)
    if slot_map.dtype.is_floating_point or slot_map.dtype.is_complex or slot_map.dtype == torch.bool:
        raise TypeError(f"physical_to_logical_map_cpu must be an integer tensor, got {slot_map.dtype}")
    require_shape("physical_to_logical_map_cpu", slot_map, (num_experts,), "[num_experts]")
    slot_map = slot_map.to(torch.int64).contiguous()
    if slot_map.numel() and (slot_map.min() < (-1 if part else 0) or slot_map.max() >= sources):
        raise ValueError(f"physical_to_logical_map_cpu values must lie in [0, {sources})")
    return slot_map


def subpool_slice(
    fmt: WeightFormat, canonical: Canonical, start: int, stop: int, intermediate: int
) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
    """gate, gate_scale, up, up_scale, down, down_scale of intermediate rows [start, stop), as
    engine.load takes them: gate/up rows with their scales, and those inputs of every down row;
    and the zero points there are, as its keyword arguments (gate_zeros, ...)."""
    gate, up, down = canonical["gate"], canonical["up"], canonical["down"]
    if (start, stop) != (0, intermediate):
        gate, up = (
            [None if t is None else t[:, start:stop].contiguous() for t in triple] for triple in (gate, up)
        )
        down = fmt.slice_inputs(*down, start, stop)
    projections = {"gate": gate, "up": up, "down": down}
    zeros = {f"{p}_zeros": t[2] for p, t in projections.items() if t[2] is not None}
    return [*gate[:2], *up[:2], *down[:2]], zeros


def prepare_biases(
    biases: dict[str, torch.Tensor | None],
    slot_map: torch.Tensor,
    sources: int,
    hidden: int,
    intermediate: int,
) -> dict[str, torch.Tensor | None]:
    """Expert biases (gate_bias, up_bias [E, I]; down_bias [E, H]; each optional, any float dtype)
    as float32 per slot, as the engines take them: slot s holds source expert slot_map[s]'s (zeros
    where slot_map is -1). None where none is given."""
    rows = {"gate_bias": intermediate, "up_bias": intermediate, "down_bias": hidden}
    names = {
        "gate_bias": "moe_intermediate_size",
        "up_bias": "moe_intermediate_size",
        "down_bias": "hidden_size",
    }
    per_slot: dict[str, torch.Tensor | None] = {}
    for name, bias in biases.items():
        if bias is None:
            per_slot[name] = None
            continue
        bias = require_cpu_tensor(name, bias)
        if bias.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be bf16, fp16 or fp32, got {bias.dtype}")
        require_shape(name, bias, (sources, rows[name]), f"[E, {names[name]}]")
        bias = bias.float()
        if not bool(torch.isfinite(bias).all()):
            raise ValueError(f"{name} holds a value that is not finite")
        slots = bias[slot_map.clamp(min=0)]
        slots[slot_map < 0] = 0.0
        per_slot[name] = slots.contiguous()
    return per_slot
