"""An independent MXFP4 decode (its own E2M1 table) for tests: canonical bytes -> float64."""

from __future__ import annotations

import torch

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
TABLE = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)


def decode_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., N, K/2] (low nibble = even k), scales [..., N, K/32] -> float64 [..., N, K]."""
    codes = codes.view(torch.uint8).long()
    values = TABLE[torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)]
    power = torch.pow(2.0, scales.view(torch.uint8).double() - 127)
    return values * power.repeat_interleave(32, dim=-1)
