"""Which experts to keep on the GPU, from how often each was activated."""

from __future__ import annotations

import torch


def generate_gpu_experts_masks(activation_freq: torch.Tensor, num_gpu_experts: int) -> torch.Tensor:
    """The ``num_gpu_experts`` most activated (layer, expert) pairs over ALL layers, as upstream.

    ``activation_freq``: real tensor ``[num_layers, num_experts]`` (any device), higher = more
    often activated. Returns a CPU bool tensor of the same shape, True = on the GPU; a layer may get
    many GPU experts or none. Equal frequencies go to the lower layer, then the lower expert, so the
    result never depends on the sort. Row ``layer`` is the ``gpu_experts_mask`` of that layer's
    wrapper.
    """
    if not isinstance(activation_freq, torch.Tensor):
        raise TypeError(f"activation_freq must be a torch.Tensor, got {type(activation_freq).__name__}")
    if activation_freq.is_nested:  # its layout may read strided: it has no one shape to sort
        raise TypeError("activation_freq must be a dense tensor, got a nested tensor")
    if activation_freq.layout != torch.strided:
        raise TypeError(f"activation_freq must be a dense tensor, got layout {activation_freq.layout}")
    if activation_freq.is_meta:
        raise ValueError("activation_freq is a meta tensor: it holds no frequencies")
    if activation_freq.dim() != 2:
        raise ValueError(
            f"activation_freq must have shape [num_layers, num_experts], got {list(activation_freq.shape)}"
        )
    if activation_freq.is_complex():
        raise TypeError(f"activation_freq must be real, got {activation_freq.dtype}")
    freq = activation_freq.detach().to("cpu")
    if freq.dtype == torch.bool:
        freq = freq.to(torch.uint8)
    elif freq.is_floating_point() and freq.element_size() == 1:  # float8: no sort, no comparisons
        freq = freq.float()
    if freq.is_floating_point() and torch.isnan(freq).any():
        raise ValueError("activation_freq holds NaN")
    if isinstance(num_gpu_experts, bool) or not isinstance(num_gpu_experts, int):
        raise TypeError(f"num_gpu_experts must be an int, got {type(num_gpu_experts).__name__}")
    total = freq.numel()
    if not 0 <= num_gpu_experts <= total:
        raise ValueError(
            f"num_gpu_experts must be in [0, {total}] (num_layers x num_experts), got {num_gpu_experts}"
        )
    # A stable sort keeps equal values in flat (layer, expert) order.
    order = torch.sort(freq.reshape(-1), descending=True, stable=True).indices
    mask = torch.zeros(total, dtype=torch.bool)
    mask[order[:num_gpu_experts]] = True
    return mask.reshape(freq.shape)
