"""Weight formats: quantize float weights into a method's canonical layout, and back.

MXFP4 (OCP Microscaling, as DeepSeek-V4-Flash ships its experts), for a weight ``[..., N, K]``:

- codes ``[..., N, K/2]`` uint8: two E2M1 values per byte, the LOW nibble holds the even k.
  Codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
- scales ``[..., N, K/32]`` uint8 E8M0: block b of row n is multiplied by 2^(scale - 127);
  0xFF is NaN in the spec and is rejected by the loaders.
- ``quantize`` picks, per block of 32, the smallest power of two that keeps the block's largest
  magnitude within 6, then rounds every value to the nearest E2M1 value (ties to even).

BF16 is the weight itself in bfloat16 (no scales).
"""

from __future__ import annotations

import torch

#: Method names accepted, upstream aliases included, mapped to the weight format they mean.
METHOD_FORMATS: dict[str, str] = {
    "BF16": "BF16",
    "INT8": "INT8",
    "AMXINT8": "INT8",
    "INT4": "INT4",
    "AMXINT4": "INT4",
    "MXFP4": "MXFP4",
}

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


def quantize(method: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float weight ``[..., N, K]`` -> (values, scales) in the method's canonical layout."""
    fmt = weight_format(method)
    if not weight.dtype.is_floating_point:
        raise TypeError(f"quantize expects a floating-point weight, got {weight.dtype}")
    if fmt == "BF16":
        return weight.to(torch.bfloat16).contiguous(), None
    if fmt == "MXFP4":
        return _quantize_mxfp4(weight)
    raise NotImplementedError(f"{fmt} quantization is not implemented yet")


def dequantize(method: str, values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Canonical (values, scales) -> float32 weight ``[..., N, K]``."""
    fmt = weight_format(method)
    if fmt == "BF16":
        return values.float()
    if fmt == "MXFP4":
        if scales is None:
            raise ValueError("MXFP4 needs scales")
        return _dequantize_mxfp4(values, scales)
    raise NotImplementedError(f"{fmt} dequantization is not implemented yet")


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
    magnitude = scaled.abs().clamp(max=6.0)
    code = torch.bucketize(magnitude, _E2M1_MIDPOINTS)  # a tie goes to the lower code ...
    tie = magnitude == _E2M1_MIDPOINTS[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    code = code + (tie & (code % 2 == 1)).to(code.dtype)  # ... unless that code is odd: ties to even
    code = code | ((scaled < 0) & (code != 0)).to(code.dtype) << 3
    code = code.reshape(*weight.shape).to(torch.uint8)
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
