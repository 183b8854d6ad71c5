"""Weight formats: one registry entry per format holds everything Python knows about it.

A format stores a weight ``[..., N, K]`` (N outputs, K inputs) as values of ``value_bits`` each,
packed along K, and, except BF16, scales of ``scale_bytes`` each: one per output row
(``scale_groups == (0,)``) or one per group of G inputs along K (G in ``scale_groups``). These
rules, the multiple K must be of and its bound come from the compiled module's FORMATS, so that
Python and the engine cannot disagree; an entry adds what only Python does: its method aliases,
the dtypes a caller may hand its tensors in, the dtypes a Hugging Face checkpoint ships it in,
quantize and dequantize.

The formats are the entries of FORMATS (at the end of this module, in the engine's order); each
one's canonical layout is the docstring of its class, and its scale groups are ``scale_groups``.

A new format is a WeightFormat subclass with its ``_encode`` and ``_decode`` (and, with scales,
``_checked_scales``), and one instance of it in FORMATS; the engine must list it in its own FORMATS.
Its ``source_dtypes`` let kt_kernel.sources take it from a Hugging Face directory, once that module
decodes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from ._native import ext

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
_E2M1_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in zip(E2M1_VALUES[:-1], E2M1_VALUES[1:], strict=True)])
_E2M1_SIGNED = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES])
_E2M1_AS_E4M3 = _E2M1_SIGNED.to(torch.float8_e4m3fn).view(torch.uint8)  # every E2M1 value is an E4M3 one
_FLOAT_SCALES = (torch.float32, torch.bfloat16)
_E8M0_SCALES = (torch.uint8, torch.float8_e8m0fnu)
FP8_MAX = 448.0  # the largest E4M3 "fn" value
FP8_BLOCK = ext.FP8_BLOCK  # DeepSeek's scale blocks: 128 x 128 weights (kernels.h's kFp8Block)
MX_BLOCK = 32  # OCP MX formats (MXFP8, MXFP4): one E8M0 scale per 32 inputs of a row
NVFP4_BLOCK = 16  # NVIDIA's NVFP4: one E4M3 scale per 16 inputs of a row, one fp32 scale per tensor

#: A projection's expected shape for a last dimension of K / d, and how a message writes it.
ShapeOf = Callable[[int], tuple[tuple[int, ...], str]]


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (uint8 or float8_e8m0fnu) as float32 2^(s - 127), exactly; NaN for 0xFF."""
    bits = scale.view(torch.uint8)
    factor = torch.exp2(bits.float() - E8M0_BIAS)
    return torch.where(bits == E8M0_NAN, torch.full_like(factor, float("nan")), factor)


def nvfp4_to_fp8(
    values: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 as ModelOpt stores it -> FP8 (codes uint8 [..., N, K], float32 scales [..., N, K/16]),
    exactly: E2M1 codes [..., N, K/2] (two per byte, the low nibble first) become the E4M3 codes of
    the same values, and each block's E4M3 scale [..., N, K/16] times the fp32 ``global_scale`` (a
    scalar, or one per leading index) is one fp32 product, never rounded to bf16. The codes take a
    byte per weight: twice NVFP4's memory."""
    values = values.contiguous().view(torch.uint8)
    codes = torch.empty((*values.shape[:-1], 2 * values.shape[-1]), dtype=torch.uint8)
    ext.expand_nibbles(values, _E2M1_AS_E4M3, codes)  # one pass: a table lookup per nibble
    scale = torch.as_tensor(global_scale, dtype=torch.float32)
    scale = scale.reshape(*scale.shape, *([1] * (block_scales.dim() - scale.dim())))
    return codes, (block_scales.view(torch.float8_e4m3fn).float() * scale).contiguous()


#: The method whose FP8-coded tensors (nvfp4_to_fp8's) the engine holds in the GGUF format (nvfp4_as_gguf).
NVFP4_METHOD = "NVFP4"
#: E4M3 code -> twice the E2M1 value it codes (gguf_blocks.E2M1_DOUBLED's levels); _NOT_E2M1 for the
#: codes of no E2M1 value.
_NOT_E2M1 = 127
_E2M1_CODE_DOUBLED = torch.full((256,), _NOT_E2M1, dtype=torch.int8)
_E2M1_CODE_DOUBLED[_E2M1_AS_E4M3.long()] = (2 * _E2M1_SIGNED).to(torch.int8)


def nvfp4_held_as_gguf(method: str, hidden: int, intermediate: int) -> bool:
    """Whether the engine holds weights of ``method`` in the GGUF format: NVFP4 where its sizes are
    multiples of GGUF's (nvfp4_as_gguf; else as FP8, a byte per weight)."""
    return (
        method.upper() == NVFP4_METHOD
        and hidden % GGUF.k_multiple == 0
        and intermediate % GGUF.k_multiple == 0
    )


def nvfp4_as_gguf(
    name: str, codes: torch.Tensor, scale_name: str, scales: torch.Tensor, first_expert: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 as nvfp4_to_fp8 gives it, E4M3 codes of E2M1 values ``[..., N, K]`` and float32 scales
    ``[..., N, K/16]`` (checked as FP8's), -> the GGUF format's canonical tensors, exactly: each
    value doubled (int8, ggml's E2M1 levels) and the pairs (scale / 2, 0). The engine holds them as
    4-bit indices with, where every scale of a matrix is an E4M3 value times one fp32 (NVFP4's two
    scales), those E4M3 bytes and that fp32 (src/core/kernels.h): NVFP4's own bytes. ValueError
    naming the tensor for a code of no E2M1 value or scales not one per 16 inputs."""
    codes, scales = FP8.stored(name, codes, scale_name, scales, first_expert)
    k = codes.shape[-1]
    if tuple(scales.shape) != (*codes.shape[:-1], k // NVFP4_BLOCK) or k % NVFP4_BLOCK:
        raise ValueError(
            f"{scale_name} must hold one scale per {NVFP4_BLOCK} inputs for method NVFP4 "
            f"({list(codes.shape[:-1]) + [k // NVFP4_BLOCK]}), got {list(scales.shape)}"
        )
    values = torch.empty(codes.shape, dtype=torch.int8)
    ext.map_bytes(codes, _E2M1_CODE_DOUBLED.view(torch.uint8), values.view(torch.uint8))  # one pass
    where = first_byte_index(values.view(torch.uint8), 0xFF, _NOT_E2M1, first_expert)
    if where is not None:
        code = int(codes[tuple([where[0] - first_expert, *where[1:]])])
        raise ValueError(
            f"{name} holds the FP8 code 0x{code:02X} at index {where}: no E2M1 value (method NVFP4 takes "
            "nvfp4_to_fp8's codes)"
        )
    half = scales * 0.5  # exact: the levels are the values doubled
    pairs = torch.stack([half, torch.zeros_like(half)], dim=-1).reshape(*scales.shape[:-1], -1)
    return values, pairs.contiguous()


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., K] (uint8) -> [..., K/2] bytes, the even k in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> the 4-bit codes [..., K] (uint8)."""
    packed = packed.view(torch.uint8)
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def require_shape(name: str, tensor: torch.Tensor | torch.Size, shape: tuple[int, ...], meaning: str) -> None:
    """ValueError naming the tensor unless it (or its shape, given) has ``shape`` (``meaning``: the
    shape in words)."""
    given = tensor if isinstance(tensor, torch.Size) else tensor.shape
    if tuple(given) != shape:
        raise ValueError(f"{name} must have shape {meaning} = {list(shape)}, got {list(given)}")


def first_index(mask: torch.Tensor, first_expert: int = 0) -> list[int]:
    """The index of the first True of ``mask`` ``[E, ...]``, its expert counted from ``first_expert``
    (the tensor holds a part of a layer's experts)."""
    where = mask.nonzero()[0].tolist()
    where[0] += first_expert
    return where


def first_byte_index(data: torch.Tensor, mask: int, value: int, first_expert: int = 0) -> list[int] | None:
    """The index of the first byte b of the contiguous uint8 ``data`` ``[E, ...]`` with
    (b & mask) == value, counted as first_index counts it; None where there is none. One pass, no
    temporaries (a check of every weight of a layer)."""
    flat = ext.first_byte_match(data, mask, value)
    if flat < 0:
        return None
    where = []
    for size in reversed(data.shape):
        flat, index = divmod(flat, size)
        where.append(index)
    where.reverse()
    where[0] += first_expert
    return where


@dataclass(frozen=True)
class WeightFormat:
    """One weight format: its names, the dtypes its canonical tensors may be given in (and how a
    message names them), the dtypes a Hugging Face checkpoint ships it in, and the engine's rules
    for it."""

    name: str
    aliases: tuple[str, ...] = ()
    value_dtypes: tuple[torch.dtype, ...] = ()
    values_text: str = ""
    scale_dtypes: tuple[torch.dtype, ...] = ()
    scales_text: str = ""
    # The dtypes of a Hugging Face checkpoint's expert weights that kt_kernel.sources reads as this
    # format: safetensors dtypes, or "I4" for INT4 values packed in I32 words (compressed-tensors'
    # weight_packed, GPTQ's qweight). Empty: the format is read from converted checkpoints only.
    source_dtypes: tuple[str, ...] = ()
    # The engine's rules, read from ext.FORMATS[name] (see the module docstring).
    value_bits: int = field(init=False)
    scale_bytes: int = field(init=False)
    scale_groups: tuple[int, ...] = field(init=False)
    k_multiple: int = field(init=False)
    max_k: int = field(init=False)
    quantized_activations: bool = field(init=False)
    zero_points: bool = field(init=False)
    scales_per_group: int = field(init=False)  # 2: each group has a scale and a min (GGUF)

    def __post_init__(self) -> None:
        native = ext.FORMATS[self.name]
        for rule in fields(self):
            if not rule.init:
                object.__setattr__(self, rule.name, native[rule.name])

    @property
    def canonical_scale_dtype(self) -> torch.dtype:
        """The dtype canonical scales are read back in (the first a caller may give them in)."""
        return self.scale_dtypes[0]

    @property
    def group_scales(self) -> bool:
        """Scales may be per group of inputs along K: a cut along K must fall between groups."""
        return any(group > 0 for group in self.scale_groups)

    @property
    def group_choice(self) -> bool:
        """Quantizing may use any of several group sizes (``group_size``)."""
        return sum(group > 0 for group in self.scale_groups) > 1

    @property
    def tensor_kinds(self) -> tuple[str, ...]:
        """The tensors of one projection: its values ("weight") and, where it has them, its scales."""
        return ("weight", "scale") if self.scale_groups else ("weight",)

    def check_dimensions(self, sizes: dict[str, int]) -> None:
        """ValueError unless every size (the K of some weight, by name) is one the engine runs."""
        names, values = " and ".join(sizes), " and ".join(map(str, sizes.values()))
        if any(k % self.k_multiple for k in sizes.values()):
            multiples = "multiples" if len(sizes) > 1 else "a multiple"
            raise ValueError(
                f"{self.name} needs {names} to be {multiples} of {self.k_multiple}, got {values}"
            )
        if any(k > self.max_k for k in sizes.values()):
            raise ValueError(f"{self.name} needs {names} <= {self.max_k}, got {values}")

    def choose_group(
        self, k: int, group_size: int | None = None, dimension: str = "the input dimension"
    ) -> int:
        """The inputs per scale to quantize ``k`` inputs with: ``group_size`` where the format offers
        a choice, else the largest allowed group dividing k (0 for formats without groups)."""
        if group_size is None:
            self.check_dimensions({dimension: k})
            return max((group for group in self.scale_groups if group and k % group == 0), default=0)
        if not self.group_choice:
            raise ValueError(f"group_size applies to {' and '.join(GROUP_CHOICE)} only, not {self.name}")
        if group_size not in self.scale_groups:
            raise ValueError(f"{self.name} group_size must be one of {self.scale_groups}, got {group_size}")
        if group_size and k % group_size:  # 0: a scale per row, any k
            raise ValueError(
                f"{self.name} needs {dimension} ({k}) to be a multiple of group_size {group_size}"
            )
        return group_size

    def quantize(
        self, weight: torch.Tensor, group_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float weight ``[..., N, K]`` -> (values, scales) in the canonical layout.

        ``group_size`` only where the format offers a choice (INT4; default: ``choose_group(K)``).
        ValueError for a weight holding NaN or Inf: no format can represent it faithfully.
        """
        if not weight.dtype.is_floating_point:
            raise TypeError(f"quantize expects a floating-point weight, got {weight.dtype}")
        if not torch.isfinite(weight).all():
            where = (~torch.isfinite(weight)).nonzero()[0].tolist()
            value = weight[tuple(where)].item()
            raise ValueError(f"the weight holds {value} at index {where}: NaN and Inf cannot be quantized")
        return self._encode(weight, self.choose_group(weight.shape[-1], group_size))

    def dequantize(
        self, values: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Canonical (values, scales[, zero points]) -> float32 weight ``[..., N, K]``."""
        if self.scale_groups and scales is None:
            raise ValueError(f"{self.name} needs scales")
        if zeros is None:
            return self._decode(values, scales)
        zeros = self.checked_zeros("zeros", zeros, scales)
        return self._decode(values, scales) - self._decode_zeros(zeros, scales, self.inputs(values))

    def checked_zeros(self, name: str, zeros: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Zero points checked against the canonical ``scale`` they go with, as int8."""
        if not self.zero_points:
            raise ValueError(f"{self.name} takes no zero points, got {name}")
        if zeros.dtype.is_floating_point or zeros.dtype.is_complex or zeros.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {zeros.dtype}")
        require_shape(name, zeros, tuple(scale.shape), "the scales' shape")
        if zeros.numel() and (zeros.min() < -8 or zeros.max() > 8):
            raise ValueError(f"{name} must lie in -8..8 (INT4 zero points), got {zeros.min()}..{zeros.max()}")
        return zeros.to(torch.int8).contiguous()

    def _decode_zeros(self, zeros: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
        """z * s of every weight: what zero points take from the values' decode."""
        return (zeros.float() * scales.float()).repeat_interleave(k // scales.shape[-1], dim=-1)

    def from_float(
        self, name: str, weight: torch.Tensor, first_expert: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float weights ``[E, N, K]`` quantized on load, as the engine takes them (see check_canonical).
        One expert at a time, so that float32 temporaries stay the size of one expert; errors name
        the tensor and the expert (counted from ``first_expert``)."""
        parts = []
        for index, expert in enumerate(weight):
            try:
                parts.append(self.quantize(expert))
            except ValueError as error:
                raise ValueError(f"{name}[{first_expert + index}]: {error}") from None
        values = torch.stack([p[0] for p in parts])
        return values, self._per_row(values, torch.stack([p[1] for p in parts]))

    def check_canonical(
        self,
        name: str,
        values: torch.Tensor,
        scale_name: str,
        scale: torch.Tensor,
        shape_of: ShapeOf,
        first_expert: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Values and scales given in the canonical layout, checked, the scales as the engine takes
        them: ``[E, N, scales per row]`` of ``scale_bytes`` each. Errors count the experts from
        ``first_expert``."""
        self._check_dtypes_and_values(name, values, scale_name, scale, shape_of)
        if self.scale_groups == (0,):
            require_shape(scale_name, scale, tuple(values.shape[:2]), "[E, N]")
        else:
            group = self._given_group(scale_name, scale, self.inputs(values))
            require_shape(scale_name, scale, *shape_of(group // self.scales_per_group))
        scale = self._checked_scales(scale_name, scale, first_expert)
        return values.contiguous(), self._per_row(values, scale)

    def _check_dtypes_and_values(
        self, name: str, values: torch.Tensor, scale_name: str, scale: torch.Tensor, shape_of: ShapeOf
    ) -> None:
        """The dtypes of values and scales, and the values' shape."""
        if values.dtype not in self.value_dtypes:
            raise TypeError(f"{name} must hold {self.values_text}, got {values.dtype}")
        require_shape(name, values, *shape_of(8 // self.value_bits))
        if scale.dtype not in self.scale_dtypes:
            raise TypeError(f"{scale_name} must be {self.scales_text}, got {scale.dtype}")

    def _given_group(self, scale_name: str, scale: torch.Tensor, k: int) -> int:
        """The inputs per scale that given group scales imply, where the format allows several."""
        if not self.group_choice:
            return self.scale_groups[0]
        per_group = self.scales_per_group
        if scale.dim() != 3 or scale.shape[2] == 0 or (per_group * k) % scale.shape[2]:
            what = "K/G" if per_group == 1 else f"{per_group}K/G"
            raise ValueError(
                f"{scale_name} must have shape [E, N, {what}] with G in {self.scale_groups}, "
                f"got {list(scale.shape)} for K = {k}"
            )
        group = per_group * k // scale.shape[2]
        if group not in self.scale_groups:
            raise ValueError(
                f"{scale_name} implies group size {group}; {self.name} takes {self.scale_groups}"
            )
        return group

    @staticmethod
    def _per_row(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Scales of ``values`` [E, N, ...] as the engine takes them, [E, N, scales per row]."""
        return scale.reshape(*values.shape[:2], -1).contiguous()

    def _inputs_per_element(self, values: torch.Tensor) -> int:
        return 8 * values.element_size() // self.value_bits

    def inputs(self, values: torch.Tensor) -> int:
        """K of a canonical values tensor."""
        return values.shape[-1] * self._inputs_per_element(values)

    def scale_group(self, values: torch.Tensor, scale: torch.Tensor | None) -> int:
        """The inputs one scale of a canonical (values, scale) pair covers: 0 for one scale per row
        (or no scales), else its group size."""
        if scale is None or (0 in self.scale_groups and scale.shape[-1] == 1):
            return 0
        return self.scales_per_group * self.inputs(values) // scale.shape[-1]

    def slice_inputs(
        self,
        values: torch.Tensor,
        scale: torch.Tensor | None,
        zeros: torch.Tensor | None,
        start: int,
        stop: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Inputs [start, stop) of every row of canonical (values, scale, zero points): values by
        their packing, group scales and zero points by group; a per-row scale covers every slice and
        stays whole."""
        group = self.scale_group(values, scale)
        if group:
            per_group = self.scales_per_group
            scale = scale[..., per_group * start // group : per_group * stop // group].contiguous()
            if zeros is not None:
                zeros = zeros[..., start // group : stop // group].contiguous()
        per_element = self._inputs_per_element(values)
        return values[..., start // per_element : stop // per_element].contiguous(), scale, zeros

    def canonical_bytes(self, inputs: int) -> int:
        """Bytes of ``inputs`` canonical values of one row."""
        return inputs * self.value_bits // 8

    def canonical_scale_bytes(self, inputs: int, group: int) -> int:
        """Bytes of the canonical scales of ``inputs`` values of one row (group 0: the row's scale)."""
        return self.scale_bytes if group == 0 else self.scales_per_group * inputs // group * self.scale_bytes

    def random_values(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """Random canonical value bytes (uint8) that the format accepts: for benchmarks."""
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)

    def _encode(self, weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def _decode(self, values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def _checked_scales(self, name: str, scale: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
        """Given scales checked and in the engine's dtype."""
        raise NotImplementedError


class _Bf16(WeightFormat):
    """The weight itself in bfloat16, no scales."""

    def from_float(self, name: str, weight: torch.Tensor, first_expert: int = 0) -> tuple[torch.Tensor, None]:
        return self._encode(weight, 0)  # the weight itself, as given: nothing to refuse

    def _encode(self, weight: torch.Tensor, group: int) -> tuple[torch.Tensor, None]:
        return weight.to(torch.bfloat16).contiguous(), None

    def _decode(self, values: torch.Tensor, scales: None) -> torch.Tensor:
        return values.float()


class _Mxfp4(WeightFormat):
    """OCP Microscaling, as DeepSeek-V4-Flash ships its experts:

    - codes ``[..., N, K/2]`` uint8: two E2M1 values per byte, the LOW nibble holds the even k.
      Codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
    - scales ``[..., N, K/32]`` uint8 E8M0: block b of row n is multiplied by 2^(scale - 127);
      0xFF is NaN in the spec and is rejected by the loaders.
    - ``quantize`` picks, per block of 32, the smallest power of two that keeps the block's largest
      magnitude within 6, then rounds every value to the nearest E2M1 value (ties to even).
    """

    def _encode(self, weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = weight.float().reshape(*weight.shape[:-1], weight.shape[-1] // group, group)
        amax = blocks.abs().amax(dim=-1)
        # Smallest power of two X with amax / X <= 6 (frexp: amax / 6 = m * 2^e, m in [0.5, 1)).
        mantissa, exponent = torch.frexp(amax / 6)
        exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
        exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent)).clamp(-E8M0_BIAS, E8M0_BIAS)
        exponent = exponent + (amax / torch.exp2(exponent.float()) > 6).to(exponent.dtype)  # float rounding
        scaled = blocks / torch.exp2(exponent.float())[..., None]
        magnitude = scaled.abs()
        # The code = the midpoints below the magnitude, counted in uint8 (torch.bucketize was 7x slower).
        # Midpoint i lies between codes i and i + 1; a magnitude on it goes to the even one.
        code = torch.zeros(magnitude.shape, dtype=torch.uint8)
        for i, midpoint in enumerate(_E2M1_MIDPOINTS.tolist()):
            code += magnitude >= midpoint if i % 2 else magnitude > midpoint
        code |= ((scaled < 0) & (code != 0)).to(torch.uint8) << 3
        return _pack_nibbles(code.reshape(*weight.shape)), (exponent + E8M0_BIAS).to(torch.uint8).contiguous()

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        scales = scales.view(torch.uint8)
        values = _E2M1_SIGNED[_unpack_nibbles(codes).long()]
        factor = e8m0_to_float(scales)
        blocks = values.reshape(*scales.shape, self.scale_groups[0]) * factor[..., None]
        return blocks.reshape(values.shape)

    def _checked_scales(self, name: str, scale: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
        scale = scale.contiguous().view(torch.uint8)
        nan = scale == E8M0_NAN
        if nan.any():
            where = first_index(nan, first_expert)
            raise ValueError(f"{name} holds the E8M0 NaN code 0xFF (first at index {where})")
        return scale


class _FloatScaled(WeightFormat):
    """Values with finite float32 scales (bf16 accepted)."""

    def _checked_scales(self, name: str, scale: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
        if not torch.isfinite(scale).all():
            raise ValueError(f"{name} holds a non-finite scale")
        return scale.to(torch.float32)


class _Int8(_FloatScaled):
    """Values ``[..., N, K]`` int8 (symmetric, -127..127 when quantized here; -128 is accepted when
    loaded), scales ``[..., N]`` float32, one per output row; w = q * s."""

    def _encode(self, weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = weight.float()
        scale = w.abs().amax(dim=-1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / safe[..., None]).clamp(-127, 127).to(torch.int8)
        return q.contiguous(), scale.contiguous()

    def _decode(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return values.float() * scales.float()[..., None]


class _Int4(_FloatScaled):
    """Values ``[..., N, K/2]`` uint8, two signed 4-bit values per byte (two's complement, -8..7),
    the LOW nibble holds the even k; scales ``[..., N, K/G]`` float32, G = K / scales.shape[-1] one
    of ``scale_groups``; w = q * s[k // G]. ``quantize`` uses -7..7 (symmetric) and the largest G
    dividing K unless told. Optionally zero points (asymmetric checkpoints such as GPTQ's): ``[..., N, K/G]``
    int8 in -8..8, shaped like the scales; then w = (q - z[k // G]) * s[k // G]."""

    def _encode(self, weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        groups = weight.float().reshape(*weight.shape[:-1], weight.shape[-1] // group, group)
        scale = groups.abs().amax(dim=-1) / 7
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(groups / safe[..., None]).clamp(-7, 7).to(torch.int8).reshape(weight.shape)
        return _pack_nibbles((q & 0x0F).to(torch.uint8)), scale.contiguous()

    def _decode(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        nibbles = _unpack_nibbles(values)
        q = nibbles.to(torch.int16) - 16 * (nibbles >= 8).to(torch.int16)  # two's complement
        k = q.shape[-1]
        if k % scales.shape[-1]:
            raise ValueError(f"{self.name} scales {list(scales.shape)} do not divide the input dimension {k}")
        group = k // scales.shape[-1]
        return (q.float().reshape(*scales.shape, group) * scales.float()[..., None]).reshape(q.shape)


class _Gguf(_FloatScaled):
    """llama.cpp's integer block types as kt_kernel.gguf_blocks holds them (exactly): values
    ``[..., N, K]`` int8 and scales ``[..., N, 2K/G]`` float32, G one of ``scale_groups``: per group
    of G inputs a (scale, min) pair, interleaved; w = q * s[k // G] + m[k // G]. ``quantize`` uses
    -127..127, min 0 and the largest G dividing K."""

    def _encode(self, weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        groups = weight.float().reshape(*weight.shape[:-1], weight.shape[-1] // group, group)
        scale = groups.abs().amax(dim=-1) / 127
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(groups / safe[..., None]).clamp(-127, 127).to(torch.int8).reshape(weight.shape)
        pairs = torch.stack([scale, torch.zeros_like(scale)], dim=-1)
        return q.contiguous(), pairs.reshape(*scale.shape[:-1], -1).contiguous()

    def _decode(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        pairs = scales.float().reshape(*scales.shape[:-1], -1, 2)
        group = values.shape[-1] // pairs.shape[-2]
        blocks = values.float().reshape(*pairs.shape[:-1], group)
        return (blocks * pairs[..., :1] + pairs[..., 1:]).reshape(values.shape)


class _Fp8(_FloatScaled):
    """Codes ``[..., N, K]`` uint8, E4M3 ("fn"), one byte per weight; scales float32 (bf16
    accepted) ``[..., N]`` (one per output row) or ``[..., N, K/G]``, G one of ``scale_groups``
    (NVFP4's blocks of 16 widened to E4M3 by nvfp4_to_fp8, MXFP8's of 32 with their E8M0 scales
    taken as floats, exactly, blocks of FP8_BLOCK); w = code * s[k // G]. DeepSeek's scales per
    FP8_BLOCK x FP8_BLOCK block are expanded along the rows on load."""

    def _encode(self, weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = weight.float().reshape(*weight.shape[:-1], -1, group or weight.shape[-1])
        scale = blocks.abs().amax(dim=-1) / FP8_MAX
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (blocks / safe[..., None]).to(torch.float8_e4m3fn).reshape(weight.shape)
        return codes.view(torch.uint8).contiguous(), scale.contiguous()

    def _decode(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        w = values.view(torch.float8_e4m3fn).float()
        group = w.shape[-1] // scales.shape[-1]
        return (w.reshape(*scales.shape, group) * scales.float()[..., None]).reshape(w.shape)

    def check_canonical(
        self,
        name: str,
        values: torch.Tensor,
        scale_name: str,
        scale: torch.Tensor,
        shape_of: ShapeOf,
        first_expert: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_dtypes_and_values(name, values, scale_name, scale, shape_of)
        return self.stored(name, values, scale_name, scale, first_expert)

    def stored(
        self, name: str, codes: torch.Tensor, scale_name: str, scale: torch.Tensor, first_expert: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 codes ``[..., N, K]`` and their scales as a checkpoint stores them -> canonical
        (uint8 codes, float32 scales ``[..., N, scales per row]``): ``[..., N]`` or ``[..., N, 1]``
        per channel, ``[..., N/128, K/128]`` rounded up (DeepSeek's 128 x 128 blocks, expanded along
        N), ``[..., N, K/128]``, or ``[..., N, K/32]`` (MXFP8's blocks; its E8M0 scales as uint8 or
        float8_e8m0fnu). ValueError for a NaN code or a scale that fits none of these."""
        codes = codes.contiguous().view(torch.uint8)
        where = first_byte_index(codes, 0x7F, 0x7F, first_expert)
        if where is not None:
            raise ValueError(f"{name} holds an FP8 NaN code (0x7F or 0xFF; first at index {where})")
        *lead, n, k = codes.shape
        blocks = (*lead, -(-n // FP8_BLOCK), k // FP8_BLOCK)
        shape = tuple(scale.shape)
        mx_shape = (*lead, n, k // MX_BLOCK)
        if scale.dtype in _E8M0_SCALES:
            if k % MX_BLOCK or shape != mx_shape:
                raise ValueError(
                    f"{scale_name} holds E8M0 scales ({scale.dtype}): MXFP8's, shaped {list(mx_shape)} "
                    f"(one per {MX_BLOCK} inputs), got {list(shape)}"
                )
            scale = e8m0_to_float(scale)
        elif shape in ((*lead, n), (*lead, n, 1)):
            scale = scale.reshape(*lead, n, 1)
        elif k % FP8_BLOCK == 0 and shape == blocks:
            scale = scale.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :]
        elif any(g and k % g == 0 and shape == (*lead, n, k // g) for g in self.scale_groups):
            pass  # one scale per 16 (NVFP4's blocks), 32 (MXFP8's) or 128 inputs of a row
        else:
            raise ValueError(
                f"{scale_name} must have shape {[*lead, n]} (per channel), {list(blocks)} (scales per "
                f"{FP8_BLOCK} x {FP8_BLOCK} block) or [{', '.join(map(str, (*lead, n)))}, K/G] with G in "
                f"{[g for g in self.scale_groups if g]}, got {list(shape)}"
                + (
                    ""
                    if k % FP8_BLOCK == 0
                    else f" (block scales need K = {k} to be a multiple of {FP8_BLOCK})"
                )
            )
        return codes, self._checked_scales(scale_name, scale.contiguous())

    def random_values(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """Normal codes only, as real weights have nearly only them: uniform random bytes would put a
        zero or subnormal code (exponent field 0) in nearly every line, which the kernels decode by a
        slower path than the normal ones."""
        values = super().random_values(shape, generator)
        values = torch.where((values & 0x78) == 0, values | 0x40, values)
        return torch.where((values & 0x7F) == 0x7F, values ^ 0x01, values)


BF16 = _Bf16("BF16", source_dtypes=("BF16", "F16", "F32"))
MXFP4 = _Mxfp4(
    "MXFP4",
    value_dtypes=(torch.uint8, torch.int8),
    values_text="MXFP4 codes as uint8 or int8",
    scale_dtypes=_E8M0_SCALES,
    scales_text="uint8 or float8_e8m0fnu (E8M0)",
)
INT8 = _Int8(
    "INT8",
    aliases=("AMXINT8", "MOE_INT8"),
    value_dtypes=(torch.int8,),
    values_text="INT8 weights as int8",
    scale_dtypes=_FLOAT_SCALES,
    scales_text="float32 or bfloat16",
)
INT4 = _Int4(
    "INT4",
    aliases=("AMXINT4", "MOE_INT4", "RAWINT4", "GPTQ_INT4"),
    value_dtypes=(torch.uint8, torch.int8),
    values_text="INT4 weights as two 4-bit values per byte as uint8 or int8",
    scale_dtypes=_FLOAT_SCALES,
    scales_text="float32 or bfloat16",
    source_dtypes=("I4",),
)

FP8 = _Fp8(
    "FP8",
    aliases=("FP8_PERCHANNEL", "MXFP8", "NVFP4"),
    value_dtypes=(torch.uint8, torch.float8_e4m3fn),
    values_text="FP8 E4M3 codes as uint8 or float8_e4m3fn",
    scale_dtypes=(*_FLOAT_SCALES, *_E8M0_SCALES),
    scales_text="float32 or bfloat16 (MXFP8's E8M0: uint8 or float8_e8m0fnu)",
    source_dtypes=("F8_E4M3", "NVFP4"),  # NVFP4: U8 E2M1 pairs with E4M3 and fp32 scales (sources.py)
)

GGUF = _Gguf(
    "GGUF",
    aliases=("LLAMAFILE",),
    value_dtypes=(torch.int8,),
    values_text="GGUF values as int8",
    scale_dtypes=(torch.float32,),
    scales_text="float32 (scale, min) pairs",
)

#: Every format by name, in the order command-line choices list them.
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (BF16, MXFP4, INT8, INT4, FP8, GGUF)}
#: The formats that offer a choice of group size.
GROUP_CHOICE = tuple(name for name, f in FORMATS.items() if f.group_choice)
#: Method names accepted (upper case), upstream aliases included, and the format each means.
METHODS: dict[str, WeightFormat] = {m: f for f in FORMATS.values() for m in (f.name, *f.aliases)}


def get(method: object) -> WeightFormat:
    """The format a method name means, in any case ("AMXINT4" -> INT4); ValueError for unknown names."""
    if not isinstance(method, str) or method.upper() not in METHODS:
        raise ValueError(f"unknown method {method!r}; known methods: {', '.join(METHODS)}")
    return METHODS[method.upper()]
