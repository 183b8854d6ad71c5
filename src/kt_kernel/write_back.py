"""Writing one expert into a serving stack's host buffers (``submit_write_weight_scale_to_buffer``),
in the bytes upstream kt-kernel writes for the same method: SGLang repacks them for its GPU kernels.

Part r of ``tp`` covers intermediate rows [r * I/tp, (r + 1) * I/tp): w13 = those gate rows, then
those up rows ([2 * I/tp, H]); w2 = those columns of every down row ([H, I/tp]). Values and scales
are the canonical layout (kt_kernel.formats) except where a method's entry in UPSTREAM_LAYOUTS says
otherwise; methods upstream cannot write back (AMXINT4/AMXINT8, GPTQ_INT4: its code raises) get the
canonical layout.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import formats
from .arguments import require_addresses, require_int
from .formats import FP8_BLOCK, WeightFormat

if TYPE_CHECKING:
    from .loading import LayerWeights

#: Canonical scales [rows, scales per row] (their dtype), their scale group -> the caller's bytes.
ScaleConverter = Callable[[torch.Tensor, int], torch.Tensor]


def _e8m0_to_bf16(scales: torch.Tensor, group: int) -> torch.Tensor:
    # bf16 bits e << 7 = 2^(e - 127) (0 for e = 0), as upstream's loader converts E8M0.
    return (scales.to(torch.int16) << 7).view(torch.bfloat16)


def _to_bf16(scales: torch.Tensor, group: int) -> torch.Tensor:
    return scales.to(torch.bfloat16)  # round to nearest even; exact for scales loaded as bf16


def _fp8_blocks(scales: torch.Tensor, group: int) -> torch.Tensor:
    """Per-row scales of 128-input groups -> one per 128 x 128 block (DeepSeek's, upstream's FP8)."""
    rows = scales.shape[0]
    first = scales[::FP8_BLOCK]
    if not torch.equal(first.repeat_interleave(FP8_BLOCK, dim=0)[:rows], scales):
        raise ValueError(
            f"upstream's FP8 buffers hold one scale per {FP8_BLOCK} x {FP8_BLOCK} block, and these weights "
            "have different scales within a block (quantized here per row): load them as FP8_PERCHANNEL or "
            "from block-scaled checkpoints"
        )
    return first


def _nvfp4_scales(pairs: torch.Tensor, group: int) -> torch.Tensor:
    """GGUF's (scale / 2, 0) pairs of method NVFP4 (formats.nvfp4_as_gguf) -> the fp32 scales it was
    loaded with (nvfp4_to_fp8's), exactly."""
    return (pairs[:, 0::2] * 2).contiguous()


#: Method NVFP4's values held as GGUF (twice the E2M1 value, int8 as uint8) -> the E4M3 codes it was
#: loaded with (nvfp4_to_fp8's; -0 comes back as +0, the same weight).
_NVFP4_CODES = np.zeros(256, np.uint8)
for _value, _code in zip(formats._E2M1_SIGNED.tolist()[:8], formats._E2M1_AS_E4M3.tolist()[:8], strict=True):
    _NVFP4_CODES[np.int8(2 * _value).view(np.uint8)] = _code
    _NVFP4_CODES[np.int8(-2 * _value).view(np.uint8)] = _code | 0x80 if _value else _code


@dataclass(frozen=True)
class UpstreamLayout:
    """How a method's write-back differs from the canonical layout."""

    scales: ScaleConverter | None = None
    #: XOR-ed into every value byte: 0x88 turns two's-complement nibbles into upstream's q + 8.
    values_xor: int = 0
    #: The rows of one part must fill whole blocks of this many (the block scales of FP8).
    part_rows: int = 1
    #: The one scale group (inputs per scale; 0: one per row) upstream's buffers hold, or None: any.
    scale_group: int | None = None
    #: The converter may refuse the values of the scales: written only once every part is converted.
    refuses_data: bool = False
    #: Every value byte b written as values_map[b] (method NVFP4: its E4M3 codes), or None.
    values_map: np.ndarray | None = None


UPSTREAM_LAYOUTS: dict[str, UpstreamLayout] = {
    "MXFP4": UpstreamLayout(scales=_e8m0_to_bf16),  # codes as stored; scales bf16
    "RAWINT4": UpstreamLayout(scales=_to_bf16, values_xor=0x88),  # nibbles q + 8; scales bf16
    # codes as stored; fp32 block scales
    "FP8": UpstreamLayout(scales=_fp8_blocks, part_rows=FP8_BLOCK, scale_group=FP8_BLOCK, refuses_data=True),
    "FP8_PERCHANNEL": UpstreamLayout(scale_group=0),  # codes as stored; fp32 per row
    # held as GGUF (formats.nvfp4_as_gguf): written as loaded, nvfp4_to_fp8's E4M3 codes and fp32 scales
    "NVFP4": UpstreamLayout(scales=_nvfp4_scales, values_map=_NVFP4_CODES),
}
CANONICAL = UpstreamLayout()


def layout_of(method: str, fmt: WeightFormat | None = None) -> UpstreamLayout:
    """The layout of ``method`` for weights held in ``fmt`` (NVFP4's entry: where held as GGUF)."""
    if method.upper() == formats.NVFP4_METHOD and fmt is not formats.GGUF:
        return CANONICAL
    return UPSTREAM_LAYOUTS.get(method.upper(), CANONICAL)


def _host_bytes(address: int, count: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * count).from_address(address))


def check_layout(
    fmt: WeightFormat, layout: UpstreamLayout, inter: int, tp: int, groups: dict[str, int]
) -> None:
    """ValueError, before anything is written, where the loaded weights cannot be written in the layout."""
    part = inter // tp
    if part % layout.part_rows:
        raise ValueError(
            f"gpu_tp_count={tp} leaves {part} intermediate rows per part; upstream's layout for this method "
            f"needs a multiple of {layout.part_rows}"
        )
    if layout.scale_group is None or not fmt.scale_groups:
        return
    for name, group in groups.items():
        if group != layout.scale_group:
            want = "one per row" if layout.scale_group == 0 else f"one per {layout.scale_group} inputs"
            have = "one per row" if group == 0 else f"one per {group} inputs"
            raise ValueError(
                f"upstream's {fmt.name} buffers for this method hold {want} scale, and {name} was loaded "
                f"with {have}: load a checkpoint with the method's own scales"
            )


def _scale_bytes(fmt: WeightFormat, layout: UpstreamLayout, rows: int, inputs: int, group: int) -> int:
    """Bytes of the scales of [rows, inputs] values in the layout (converted from canonical zeros)."""
    canonical = torch.zeros(rows, fmt.canonical_scale_bytes(inputs, group), dtype=torch.uint8)
    if layout.scales is None:
        return canonical.numel()
    converted = layout.scales(canonical.view(fmt.canonical_scale_dtype), group)
    return converted.numel() * converted.element_size()


def buffer_nbytes(
    fmt: WeightFormat, layout: UpstreamLayout, tp: int, hidden: int, inter: int, groups: dict[str, int]
) -> dict[str, int]:
    """The bytes each of the four buffers of one part needs: ``w13_weight``, ``w13_scale``,
    ``w2_weight``, ``w2_scale`` (scales 0 for formats without scales)."""
    check_layout(fmt, layout, inter, tp, groups)
    part, H = inter // tp, hidden
    scaled = bool(fmt.scale_groups)
    return {
        "w13_weight": 2 * part * fmt.canonical_bytes(H),
        "w13_scale": 2 * _scale_bytes(fmt, layout, part, H, groups["gate"]) if scaled else 0,
        "w2_weight": H * fmt.canonical_bytes(part),
        "w2_scale": _scale_bytes(fmt, layout, H, part, groups["down"]) if scaled else 0,
    }


def write_expert(
    fmt: WeightFormat,
    layout: UpstreamLayout,
    subpools: Sequence[Any],
    hidden: int,
    inter: int,
    groups: dict[str, int],
    expert: int,
    w13: list[int],
    s13: list[int],
    w2: list[int],
    s2: list[int],
) -> None:
    """Write physical slot ``expert`` into the tp = len(w13) parts' buffers (addresses checked by the
    caller), on the engines' threads. ``subpools``: each with its ``engine`` and its slice
    [start, stop) of the intermediate rows; ``groups``: each projection's scale group. Where it
    raises a ValueError, nothing has been written."""
    tp, H = len(w13), hidden
    check_layout(fmt, layout, inter, tp, groups)
    part = inter // tp
    gate_group, down_group = groups["gate"], groups["down"]
    h_bytes, h_scale_bytes = fmt.canonical_bytes(H), fmt.canonical_scale_bytes(H, gate_group)
    part_bytes, part_scale_bytes = fmt.canonical_bytes(part), fmt.canonical_scale_bytes(part, down_group)
    convert = layout.scales is not None and bool(fmt.scale_groups)
    # Values go to the caller directly, or through scratch where a conversion may still refuse.
    staged = convert and layout.refuses_data
    writes: list[tuple[int, torch.Tensor]] = []  # (caller's address, bytes) once every part is converted
    for r in range(tp):
        # Scales go to the caller directly, or through canonical scratch rows to be converted.
        w13_scales = torch.empty(2 * part, h_scale_bytes, dtype=torch.uint8) if convert else None
        w2_scales = torch.empty(H, part_scale_bytes, dtype=torch.uint8) if convert else None
        w13_values = torch.empty(2 * part * h_bytes, dtype=torch.uint8) if staged else None
        w2_values = torch.empty(H * part_bytes, dtype=torch.uint8) if staged else None
        w13_at = w13_values.data_ptr() if staged else w13[r]
        w2_at = w2_values.data_ptr() if staged else w2[r]
        s13_at = w13_scales.data_ptr() if convert else s13[r]
        s2_at = w2_scales.data_ptr() if convert else s2[r]
        first, last = r * part, (r + 1) * part
        for sp in subpools:  # each holds rows [start, stop) of I
            lo, hi = max(first, sp.start), min(last, sp.stop)
            if lo >= hi:
                continue
            for name, row in (("gate", lo - first), ("up", part + lo - first)):
                sp.engine.unpack(
                    name, expert, lo - sp.start, hi - lo, 0, H,
                    w13_at + row * h_bytes, h_bytes, s13_at + row * h_scale_bytes, h_scale_bytes,
                )  # fmt: skip
            # A per-row down scale is the same in every part.
            column = fmt.canonical_bytes(lo - first)
            scale_column = fmt.canonical_scale_bytes(lo - first, down_group) if down_group else 0
            sp.engine.unpack(
                "down", expert, 0, H, lo - sp.start, hi - lo,
                w2_at + column, part_bytes, s2_at + scale_column, part_scale_bytes,
            )  # fmt: skip
        if staged:
            writes += [(w13[r], w13_values), (w2[r], w2_values)]
        if convert:
            scale_dtype = fmt.canonical_scale_dtype
            gate, up = w13_scales.view(scale_dtype).split(part)
            w13_converted = [layout.scales(gate, gate_group), layout.scales(up, gate_group)]
            writes.append((s13[r], torch.cat(w13_converted)))
            writes.append((s2[r], layout.scales(w2_scales.view(scale_dtype), down_group)))
    for address, converted in writes:
        data = converted.contiguous().view(torch.uint8)
        ctypes.memmove(address, data.data_ptr(), data.numel())
    if layout.values_xor:
        for r in range(tp):
            for address, count in ((w13[r], 2 * part * h_bytes), (w2[r], H * part_bytes)):
                values = _host_bytes(address, count)
                np.bitwise_xor(values, layout.values_xor, out=values)
    if layout.values_map is not None:
        for r in range(tp):
            for address, count in ((w13[r], 2 * part * h_bytes), (w2[r], H * part_bytes)):
                values = _host_bytes(address, count)
                np.take(layout.values_map, values, out=values)


def _parts(weights: LayerWeights, gpu_tp_count: object) -> int:
    tp, inter = require_int("gpu_tp_count", gpu_tp_count, 1), weights.inter
    down_group = weights.scale_groups["down"]
    if inter % tp or (inter // tp) % max(down_group, 1):
        keep = f" into whole blocks of {down_group} inputs per down scale" if down_group else ""
        raise ValueError(f"gpu_tp_count={tp} must split moe_intermediate_size={inter} evenly{keep}")
    return tp


def layer_buffer_nbytes(weights: LayerWeights, method: str, gpu_tp_count: object) -> dict[str, int]:
    """buffer_nbytes for a loaded layer (KTMoEWrapper.write_buffer_nbytes)."""
    tp = _parts(weights, gpu_tp_count)
    return buffer_nbytes(
        weights.format,
        layout_of(method, weights.format),
        tp,
        weights.hidden,
        weights.inter,
        weights.scale_groups,
    )


def write_layer_expert(
    weights: LayerWeights, method: str, gpu_tp_count: object, expert_id: object,
    w13_weight_ptrs: object, w13_scale_ptrs: object, w2_weight_ptrs: object, w2_scale_ptrs: object,
) -> None:  # fmt: skip
    """KTMoEWrapper.submit_write_weight_scale_to_buffer: its arguments checked, then the write."""
    if weights.zero_points or weights.bias_table is not None:
        what = "zero points (asymmetric INT4)" if weights.zero_points else "expert biases"
        raise NotImplementedError(
            f"weights loaded with {what} have no GPU buffer layout: the buffers hold values and scales only"
        )
    fmt = weights.format
    tp = _parts(weights, gpu_tp_count)
    expert = require_int("expert_id", expert_id, 0)
    if expert >= weights.num_experts:
        raise ValueError(f"expert_id must be in [0, {weights.num_experts}), got {expert}")
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
    groups = weights.scale_groups
    if groups["gate"] != groups["up"]:
        raise ValueError(
            f"gate and up were loaded with different {fmt.name} group sizes: w13 scale rows cannot hold both"
        )
    write_expert(
        fmt,
        layout_of(method, fmt),
        weights.subpools,
        weights.hidden,
        weights.inter,
        groups,
        expert,
        w13,
        s13,
        w2,
        s2,
    )
