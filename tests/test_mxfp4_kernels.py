"""MXFP4 kernels vs an fp64 reference decoded from the SAME canonical bytes, on the build this
process loaded (tests/test_variants.py re-runs this file under every build and AVX512 path).

The kernels quantize the activations to int8 per row and multiply in integers (twice an E2M1 value
is an integer): exact for activations the quantization maps exactly, else within half an activation
quantization step per input."""

from __future__ import annotations

import pytest
import torch
from mxfp4_reference import decode_mxfp4

from kt_kernel import KTMoEWrapper, quant
from kt_kernel._native import ext

from moe_reference import make_problem, moe_wrapper, reference_forward


def assert_forward_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """~1-2 % from the int8 activations (hidden and intermediate) on these problems."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.03


def kernel_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], codes.shape[0])
    ext.linear("MXFP4", x.view(torch.int16), codes, scales, y)
    return y


def random_codes(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)


def blocks_index(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.meshgrid(torch.arange(n), torch.arange(k // 32), indexing="ij")


# name -> (codes, scales) for an [n, k] weight
PATTERNS = {
    "uniform_scale": lambda n, k, g: (
        random_codes(n, k, g),
        torch.full((n, k // 32), 127, dtype=torch.uint8),
    ),
    "alternating_scales": lambda n, k, g: (
        random_codes(n, k, g),
        torch.where(sum(blocks_index(n, k)) % 2 == 0, 100, 150).to(torch.uint8),
    ),
    "scale_ramp_across_k": lambda n, k, g: (
        random_codes(n, k, g),
        (100 + blocks_index(n, k)[1] * 50 // max(k // 32 - 1, 1)).to(torch.uint8),
    ),
    "random_bytes": lambda n, k, g: (
        random_codes(n, k, g),
        torch.randint(90, 170, (n, k // 32), dtype=torch.uint8, generator=g),
    ),
    "extreme_codes": lambda n, k, g: (
        torch.tensor([0x00, 0x88, 0x77, 0xFF, 0x70, 0x0F, 0x87, 0xF8], dtype=torch.uint8)[
            torch.randint(0, 8, (n, k // 2), generator=g)
        ],
        torch.full((n, k // 32), 127, dtype=torch.uint8),
    ),
    "tiny_to_huge_scales": lambda n, k, g: (
        random_codes(n, k, g),
        torch.tensor([0, 1, 2, 40, 127, 180, 200], dtype=torch.uint8)[
            torch.randint(0, 7, (n, k // 32), generator=g)
        ],
    ),
}

# (tokens, n, k): n tails (not a multiple of 16), k = 32 and 7168, tokens 1 to 600
SHAPES = [(1, 16, 32), (1, 1, 32), (5, 17, 64), (3, 33, 7168), (600, 40, 96), (13, 31, 224), (64, 48, 512)]


def flushable(x, weight):
    """What the weights below 2^-124 in magnitude (E8M0 scales 0 and 1) contribute, plus 1e-44: the
    amx build's tiles take bf16 weights, which cannot hold them, and read them as zero."""
    tiny = weight.double().abs() * (weight.double().abs() < 2.0**-124)
    return x.double().abs() @ tiny.T + 1e-44


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("tokens,n,k", SHAPES)
def test_linear_matches_reference(pattern, tokens, n, k):
    g = torch.Generator().manual_seed(tokens * 1000 + n + k)
    codes, scales = PATTERNS[pattern](n, k, g)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    weight = decode_mxfp4(codes, scales)
    ref = x.double() @ weight.T
    # Half an activation step (max |x| / 127 per row) per input, plus fp32 rounding.
    bound = x.double().abs().amax(1, keepdim=True) / 254 * weight.abs().sum(1) * 1.0001
    bound += 1e-5 * (x.double().abs() @ weight.abs().T) + flushable(x, weight)
    err = (kernel_linear(x, codes, scales).double() - ref).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("tokens,n,k", SHAPES)
def test_linear_is_exact_for_small_integer_activations(tokens, n, k):
    """Integers with max |x| = 127 are their own int8 quantization: the integer sums are exact."""
    g = torch.Generator().manual_seed(tokens + n + k)
    codes, scales = PATTERNS["tiny_to_huge_scales"](n, k, g)
    x = torch.randint(-127, 128, (tokens, k), generator=g).float()
    x[:, 0] = 127.0
    weight = decode_mxfp4(codes, scales)
    ref = x.double() @ weight.T
    err = (kernel_linear(x.to(torch.bfloat16), codes, scales).double() - ref).abs()
    assert torch.all(err <= 1e-6 * (x.double().abs() @ weight.abs().T) + flushable(x, weight))


def test_scale_zero_means_two_to_minus_127():
    codes = torch.full((16, 16), 0x22, dtype=torch.uint8)  # every weight 1.0
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    y = kernel_linear(x, codes, torch.zeros(16, 1, dtype=torch.uint8))
    assert torch.allclose(y, torch.tensor(32 * 2.0**-127, dtype=torch.float32), rtol=1e-6, atol=0)


def mxfp4_wrapper(p, threads: int = 2, gpu_experts_mask=None) -> KTMoEWrapper:
    return moe_wrapper(*p.shape, gpu_experts_mask=gpu_experts_mask, cpuinfer_threads=threads, method="MXFP4")


def canonical(p):
    """MXFP4 codes/scales of the problem's weights, and the problem with its weights replaced by
    their exact decoded values (for the reference)."""
    tensors = {}
    for name in ("gate", "up", "down"):
        codes, scales = quant.quantize("MXFP4", getattr(p, name))
        tensors[name], tensors[f"{name}_scale"] = codes, scales
        setattr(p, name, decode_mxfp4(codes, scales).float())
    return tensors


def load_canonical(moe: KTMoEWrapper, t: dict[str, torch.Tensor]) -> None:
    moe.load_weights_from_tensors(
        t["gate"],
        t["up"],
        t["down"],
        gate_scale=t["gate_scale"],
        up_scale=t["up_scale"],
        down_scale=t["down_scale"],
    )


@pytest.mark.parametrize(
    "experts,top_k,hidden,inter,tokens",
    [(8, 2, 64, 32, 1), (16, 4, 128, 96, 8), (32, 8, 256, 160, 64), (12, 6, 96, 224, 301), (4, 4, 32, 32, 3)],
)
def test_forward_matches_reference(experts, top_k, hidden, inter, tokens):
    p = make_problem(experts, top_k, hidden, inter, tokens, seed=experts + tokens)
    tensors = canonical(p)
    moe = mxfp4_wrapper(p)
    load_canonical(moe, tensors)
    assert_forward_close(moe.forward(p.hidden, p.ids, p.weights), reference_forward(p))


def test_hot_expert_and_masks():
    p = make_problem(experts=8, top_k=2, hidden=128, inter=64, tokens=600, seed=4)
    p.ids[:, 0] = 5
    p.ids[:, 1] = torch.where(p.ids[:, 1] == 5, torch.full_like(p.ids[:, 1], 2), p.ids[:, 1])
    p.ids[::7, 1] = -1
    mask = torch.zeros(8, dtype=torch.bool)
    mask[2] = True
    tensors = canonical(p)
    moe = mxfp4_wrapper(p, gpu_experts_mask=mask)
    load_canonical(moe, tensors)
    assert_forward_close(moe.forward(p.hidden, p.ids, p.weights), reference_forward(p, skip=mask))


def test_quantize_on_load_equals_canonical_load_and_tracks_float_weights():
    p = make_problem(experts=8, top_k=2, hidden=256, inter=128, tokens=24, seed=5)
    float_ref = reference_forward(p)
    from_floats = mxfp4_wrapper(p)
    from_floats.load_weights_from_tensors(p.gate, p.up, p.down)
    out = from_floats.forward(p.hidden, p.ids, p.weights)
    tensors = canonical(p)  # the same quantization, done outside
    from_bytes = mxfp4_wrapper(p)
    load_canonical(from_bytes, tensors)
    assert torch.equal(out, from_bytes.forward(p.hidden, p.ids, p.weights))
    # Close to the float model within MXFP4's quantization error (~10% per weight).
    rel = ((out.double() - float_ref).norm() / float_ref.norm()).item()
    assert rel < 0.3, rel


def test_threads_and_async_agree():
    p = make_problem(experts=16, top_k=4, hidden=192, inter=96, tokens=33, seed=6)
    tensors = canonical(p)
    outs = []
    for threads in (1, 2, 3):
        moe = mxfp4_wrapper(p, threads=threads)
        load_canonical(moe, tensors)
        outs.append(moe.forward(p.hidden, p.ids, p.weights))
    moe.submit_forward(p.hidden, p.ids, p.weights)
    outs.append(moe.sync_forward())
    assert all(torch.equal(outs[0], o) for o in outs[1:])
