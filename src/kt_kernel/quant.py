"""Quantize float weights into a method's canonical layout, and back (the layouts: kt_kernel.formats)."""

from __future__ import annotations

import torch

from .formats import get


def weight_format(method: str) -> str:
    """The weight format a method name means ("AMXINT4" -> "INT4"); ValueError for unknown names."""
    return get(method).name


def quantize(
    method: str, weight: torch.Tensor, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float weight ``[..., N, K]`` -> (values, scales) in the method's canonical layout.

    ``group_size`` is for INT4 only (default: 128 where K allows, else 64, 32).
    ValueError for a weight holding NaN or Inf: no format can represent it faithfully.
    """
    return get(method).quantize(weight, group_size)


def dequantize(method: str, values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Canonical (values, scales) -> float32 weight ``[..., N, K]``."""
    return get(method).dequantize(values, scales)
