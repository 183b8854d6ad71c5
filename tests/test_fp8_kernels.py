"""FP8 (E4M3 "fn") kernels vs an fp64 reference decoded by torch from the SAME codes, on the build this
process loaded (tests/test_variants.py re-runs this file under every build and AVX512 path).

Every E4M3 value is exact in bf16 and the activations are bf16, so the only rounding is fp32
accumulation: the result must match the reference to fp32 precision."""

from __future__ import annotations

import pytest
import torch

from kt_kernel._native import ext

NAN_CODES = (0x7F, 0xFF)


def random_codes(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Every code but the NaNs, at random: subnormals, both zeros and the largest values included."""
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    return torch.where((codes == NAN_CODES[0]) | (codes == NAN_CODES[1]), torch.zeros_like(codes), codes)


def reference_weight(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    values = codes.view(torch.float8_e4m3fn).double()
    return values * scales.double().repeat_interleave(values.shape[1] // scales.shape[1], dim=1)


def kernel_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], codes.shape[0])
    ext.linear("FP8", x.view(torch.int16), codes, scales, y)
    return y


def assert_matches_fp64(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """The kernel's result equals the fp64 one up to fp32 accumulation."""
    weight = reference_weight(codes, scales)
    ref = x.double() @ weight.T
    bound = 1e-6 * (x.double().abs() @ weight.abs().T) + 1e-30
    err = (kernel_linear(x, codes, scales).double() - ref).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3g}"


# (tokens, n, k, per_block): n tails, odd k (per channel), an odd count of input pairs (the few-row
# tiles read two pairs at a time), 128-input blocks, tokens 1 to 600.
CASES = [
    (1, 16, 128, True),
    (1, 1, 7, False),
    (2, 17, 130, False),
    (4, 33, 6, False),
    (3, 33, 7168, True),
    (5, 17, 130, False),
    (13, 40, 384, True),
    (64, 48, 512, False),
    (600, 20, 256, True),
]


@pytest.mark.parametrize("tokens,n,k,per_block", CASES)
def test_linear_matches_fp64_on_the_stored_codes(tokens, n, k, per_block):
    g = torch.Generator().manual_seed(tokens * 1000 + n + k)
    codes = random_codes(n, k, g)
    scales = torch.rand(n, k // 128 if per_block else 1, generator=g) * 1e-3 + 1e-4
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    assert_matches_fp64(x, codes, scales)


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 32])  # codes decoded in registers / on the stack
@pytest.mark.parametrize("normal_only", [False, True])
def test_every_code_decodes_exactly(tokens, normal_only):
    """One row per code (a one-hot activation picks each input): all 254 finite codes, subnormals
    and -0, at every input position; or the normal ones alone (exponent field > 0: the avx2 build
    then takes its tiles for normal codes)."""
    small = [c for c in range(256) if c & 0x78 == 0]
    codes = [c for c in range(256) if c not in NAN_CODES and not (normal_only and c in small)]
    codes = torch.tensor(codes, dtype=torch.uint8)
    weight = codes[:, None].repeat(1, 32).contiguous()
    y = kernel_linear(torch.eye(32)[:tokens].to(torch.bfloat16), weight, torch.ones(len(codes), 1))
    expected = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(y, expected.expand(tokens, -1))


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 32])  # codes decoded in registers / on the stack
@pytest.mark.parametrize("per_block", [True, False])
def test_rare_small_codes_among_normal_ones(tokens, per_block):
    """Codes as real weights have them: nearly all normal, a few zeros and subnormals scattered (the
    decoders take a shortcut for normal codes, and the avx2 build finds the others from a bitmap
    made at load). The normal codes are the smallest ones, so a small code decoded as a normal one
    would be off by as much as a weight. k = 1022: an odd count of pairs past the last 64-pair word."""
    g = torch.Generator().manual_seed(tokens)
    n, k = 48, 1024 if per_block else 1022
    codes = torch.randint(0x08, 0x20, (n, k), dtype=torch.uint8, generator=g)  # exponent field 1-3
    codes |= torch.randint(0, 2, (n, k), dtype=torch.uint8, generator=g) << 7  # either sign
    small = torch.randperm(n * k, generator=g)[:40]
    zeros_and_subnormals = torch.tensor([0x00, 0x80, 0x01, 0x87, 0x05, 0x83, 0x07, 0x86], dtype=torch.uint8)
    codes.view(-1)[small] = zeros_and_subnormals.repeat(5)
    scales = torch.rand(n, k // 128 if per_block else 1, generator=g) + 0.5
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    assert_matches_fp64(x, codes, scales)


def test_scales_must_fit_the_format():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    codes = torch.zeros(16, 256, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scales per row"):
        kernel_linear(x, codes, torch.ones(16, 4))  # groups of 64: not a scale group of FP8
    with pytest.raises(ValueError, match="scales"):
        kernel_linear(x, codes, torch.ones(16, 2, dtype=torch.float64))  # 8-byte scales
