"""Weight formats: quantize float weights into a method's canonical layout, and back.

MXFP4 (OCP Microscaling, as DeepSeek-V4-Flash ships its experts), for a weight ``[..., N, K]``:

- codes ``[..., N, K/2]`` uint8: two E2M1 values per byte, the LOW nibble holds the even k.
  Codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
- scales ``[..., N, K/32]`` uint8 E8M0: block b of row n is multiplied by 2^(scale - 127);
  0xFF is NaN in the spec and is rejected by the loaders.
- ``quantize`` picks, per block of 32, the smallest power of two that keeps the block's largest
  magnitude within 6, then rounds every value to the nearest E2M1 value (ties to even).

INT8, for a weight ``[..., N, K]``: values ``[..., N, K]`` int8 (symmetric, -127..127 when
quantized here; -128 is accepted when loaded), scales ``[..., N]`` float32, one per output row;
w = q * s.

INT4: values ``[..., N, K/2]`` uint8, two signed 4-bit values per byte (two's complement, -8..7),
the LOW nibble holds the even k; scales ``[..., N, K/G]`` float32, G = K / scales.shape[-1] in
{32, 64, 128}; w = q * s[k // G]. ``quantize`` uses -7..7 (symmetric) and G = 128 unless told.

BF16 is the weight itself in bfloat16 (no scales).
"""

from __future__ import annotations

import torch

#: Method names accepted, upstream aliases included, mapped to the weight format they mean.
METHOD_FORMATS: dict[str, str] = {
    "BF16": "BF16",
    "INT8": "INT8",
    "AMXINT8": "INT8",
    "MOE_INT8": "INT8",
    "INT4": "INT4",
    "AMXINT4": "INT4",
    "MOE_INT4": "INT4",
    "MXFP4": "MXFP4",
}

INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 128
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
_E2M1_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in zip(E2M1_VALUES[:-1], E2M1_VALUES[1:], strict=True)])
_E2M1_SIGNED = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES])


def weight_format(method: str) -> str:
    """The weight format a method name means ("AMXINT4" -> "INT4"); ValueError for unknown names."""
    if not isinstance(method, str) or method.upper() not in METHOD_FORMATS:
        raise ValueError(f"unknown method {method!r}; known methods: {', '.join(METHOD_FORMATS)}")
    return METHOD_FORMATS[method.upper()]


def int4_group_size(k: int) -> int:
    """The group size quantize-on-load uses for INT4 with k inputs: the largest of 128, 64, 32 dividing k."""
    for group in sorted(INT4_GROUP_SIZES, reverse=True):
        if k % group == 0:
            return group
    raise ValueError(f"INT4 needs the input dimension to be a multiple of 32, got {k}")


def quantize(
    method: str, weight: torch.Tensor, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float weight ``[..., N, K]`` -> (values, scales) in the method's canonical layout.

    ``group_size`` is for INT4 only (default: ``int4_group_size(K)``, 128 where K allows).
    ValueError for a weight holding NaN or Inf: no format can represent it faithfully.
    """
    fmt = weight_format(method)
    if not weight.dtype.is_floating_point:
        raise TypeError(f"quantize expects a floating-point weight, got {weight.dtype}")
    if not torch.isfinite(weight).all():
        where = (~torch.isfinite(weight)).nonzero()[0].tolist()
        value = weight[tuple(where)].item()
        raise ValueError(f"the weight holds {value} at index {where}: NaN and Inf cannot be quantized")
    if group_size is not None and fmt != "INT4":
        raise ValueError(f"group_size applies to INT4 only, not {fmt}")
    if fmt == "BF16":
        return weight.to(torch.bfloat16).contiguous(), None
    if fmt == "MXFP4":
        return _quantize_mxfp4(weight)
    if fmt == "INT8":
        return _quantize_int8(weight)
    return _quantize_int4(weight, int4_group_size(weight.shape[-1]) if group_size is None else group_size)


def dequantize(method: str, values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Canonical (values, scales) -> float32 weight ``[..., N, K]``."""
    fmt = weight_format(method)
    if fmt == "BF16":
        return values.float()
    if fmt == "MXFP4":
        if scales is None:
            raise ValueError("MXFP4 needs scales")
        return _dequantize_mxfp4(values, scales)
    if scales is None:
        raise ValueError(f"{fmt} needs scales")
    if fmt == "INT8":
        return values.float() * scales.float()[..., None]
    return _dequantize_int4(values, scales)


def _quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    scale = w.abs().amax(dim=-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def _quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = weight.shape[-1]
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"INT4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        raise ValueError(f"INT4 needs the input dimension ({k}) to be a multiple of group_size {group_size}")
    groups = weight.float().reshape(*weight.shape[:-1], k // group_size, group_size)
    scale = groups.abs().amax(dim=-1) / 7
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(groups / safe[..., None]).clamp(-7, 7).to(torch.int8).reshape(weight.shape)
    nibbles = (q & 0x0F).to(torch.uint8)
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).contiguous(), scale.contiguous()


def _dequantize_int4(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    values = values.view(torch.uint8)
    nibbles = torch.stack([values & 0x0F, values >> 4], dim=-1).reshape(
        *values.shape[:-1], values.shape[-1] * 2
    )
    q = nibbles.to(torch.int16) - 16 * (nibbles >= 8).to(torch.int16)  # two's complement
    k = q.shape[-1]
    if k % scales.shape[-1]:
        raise ValueError(f"INT4 scales {list(scales.shape)} do not divide the input dimension {k}")
    group = k // scales.shape[-1]
    return (q.float().reshape(*scales.shape, group) * scales.float()[..., None]).reshape(q.shape)


def _quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = weight.shape[-1]
    if k % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of 32, got {k}")
    blocks = weight.float().reshape(*weight.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK)
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
    code = code.reshape(*weight.shape)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), (exponent + E8M0_BIAS).to(torch.uint8).contiguous()


def _dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes, scales = codes.view(torch.uint8), scales.view(torch.uint8)
    nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    values = _E2M1_SIGNED[nibbles.long()]
    factor = torch.exp2(scales.float() - E8M0_BIAS)
    factor = torch.where(scales == E8M0_NAN, torch.full_like(factor, float("nan")), factor)
    blocks = values.reshape(*scales.shape, MXFP4_BLOCK) * factor[..., None]
    return blocks.reshape(values.shape)
