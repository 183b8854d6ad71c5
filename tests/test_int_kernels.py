"""INT8 / INT4 kernels vs fp64 references decoded from the SAME canonical bytes, on the build this
process loaded (tests/test_variants.py re-runs this file under every build and AVX512 path).

The kernels quantize each activation row to int8 (scale = max |x| / 127) and sum integer products
exactly; so with activations the quantization maps exactly (integers with max |x| = 127) the result
is exact up to the final fp32 scaling, and otherwise the error is bounded by half a quantization
step per activation."""

from __future__ import annotations

import pytest
import torch

from kt_kernel import KTMoEWrapper, quant
from kt_kernel._native import ext

from moe_reference import make_problem, moe_wrapper, reference_forward


def decode_int4(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Independent INT4 decode: [..., N, K/2] bytes (low nibble = even k, two's complement) and
    scales [..., N, K/G] -> float64 [..., N, K]."""
    values = values.view(torch.uint8).long()
    nibbles = torch.stack([values % 16, values // 16], dim=-1).flatten(-2)
    signed = torch.where(nibbles > 7, nibbles - 16, nibbles).double()
    group = signed.shape[-1] // scales.shape[-1]
    return signed * scales.double().repeat_interleave(group, dim=-1)


def decode(method: str, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if method == "INT8":
        return values.double() * scales.double()[..., None]
    return decode_int4(values, scales)


def random_canonical(method: str, n: int, k: int, group: int, g: torch.Generator):
    """Random canonical bytes over the whole range (-128 / -8 included) and scales of mixed sign
    and magnitude."""
    if method == "INT8":
        values = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        scales = torch.rand(n, generator=g) * 0.1 - 0.02
    else:
        values = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        scales = torch.exp2(torch.randint(-12, 4, (n, k // group), generator=g).float()) * (
            torch.rand(n, k // group, generator=g) + 0.5
        )
    return values, scales


def kernel_linear(
    method: str,
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    y = torch.empty(x.shape[0], values.shape[0])
    scales = scales.reshape(values.shape[0], -1)
    ext.linear(method, x.view(torch.int16), values.view(torch.uint8), scales, y, zeros=zeros)
    return y


# (method, tokens, n, k, group): n tails, k not a multiple of 4 (INT8), every INT4 group size,
# tokens 1 to 600 (decode tiles and prefill tiles).
CASES = [
    ("INT8", 1, 16, 4, 0),
    ("INT8", 1, 1, 7, 0),
    ("INT8", 5, 17, 100, 0),
    ("INT8", 3, 33, 7168, 0),
    ("INT8", 600, 40, 96, 0),
    ("INT8", 13, 31, 226, 0),
    ("INT8", 64, 48, 512, 0),
    ("INT4", 1, 16, 32, 32),
    ("INT4", 1, 1, 64, 64),
    ("INT4", 5, 17, 256, 128),
    ("INT4", 3, 33, 7168, 128),
    ("INT4", 600, 40, 128, 32),
    ("INT4", 13, 31, 192, 64),
    ("INT4", 64, 48, 512, 32),
    ("INT8", 9, 24, 1002, 0),  # int16 activations: a run of 512 inputs, then a part run
]


@pytest.mark.parametrize("method,tokens,n,k,group", CASES)
def test_linear_is_exact_when_activations_quantize_exactly(method, tokens, n, k, group):
    g = torch.Generator().manual_seed(tokens * 1000 + n + k)
    values, scales = random_canonical(method, n, k, group, g)
    x = torch.randint(-127, 128, (tokens, k), generator=g).float()
    x[torch.arange(tokens), torch.randint(0, k, (tokens,), generator=g)] = 127.0  # max |x| = 127: scale 1
    weight = decode(method, values, scales)
    ref = x.double() @ weight.T
    # Exact integer sums; fp32 only in the scaling and the per-group accumulation (INT4).
    bound = 1e-6 * (x.double().abs() @ weight.abs().T) + 1e-30
    err = (kernel_linear(method, x.to(torch.bfloat16), values, scales).double() - ref).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("method,tokens,n,k,group", [case for case in CASES if case[0] == "INT4"])
def test_int4_zero_points_are_exact(method, tokens, n, k, group):
    """Asymmetric INT4 (GPTQ): w = (q - z) * s with a zero point z in -8..8 per row and group."""
    g = torch.Generator().manual_seed(tokens * 7 + n + k)
    values, scales = random_canonical(method, n, k, group, g)
    zeros = torch.randint(-8, 9, scales.shape, dtype=torch.int8, generator=g)
    zeros.view(-1)[0] = -8  # both ends of the range
    zeros.view(-1)[-1] = 8
    x = torch.randint(-127, 128, (tokens, k), generator=g).float()
    x[torch.arange(tokens), torch.randint(0, k, (tokens,), generator=g)] = 127.0
    weight = decode(method, values, scales) - (zeros.double() * scales.double()).repeat_interleave(
        group, dim=-1
    )
    ref = x.double() @ weight.T
    bound = 1e-6 * (x.double().abs() @ weight.abs().T) + 1e-30
    err = (kernel_linear(method, x.to(torch.bfloat16), values, scales, zeros).double() - ref).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("method,tokens,n,k,group", CASES[::2])
def test_linear_error_within_activation_quantization(method, tokens, n, k, group):
    g = torch.Generator().manual_seed(tokens + n + k)
    values, scales = random_canonical(method, n, k, group, g)
    x = (torch.randn(tokens, k, generator=g) * torch.rand(tokens, 1, generator=g) * 10).to(torch.bfloat16)
    weight = decode(method, values, scales)
    ref = x.double() @ weight.T
    step = x.double().abs().amax(dim=1, keepdim=True) / 127  # each row's activation scale
    bound = (step / 2) * (torch.ones_like(x, dtype=torch.float64) @ weight.abs().T) * 1.0001 + 1e-5 * (
        x.double().abs() @ weight.abs().T
    )
    err = (kernel_linear(method, x, values, scales).double() - ref).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3g}"


def test_zero_rows_and_zero_scales_give_zero():
    values = torch.full((16, 64), 100, dtype=torch.int8)
    y = kernel_linear("INT8", torch.zeros(3, 64, dtype=torch.bfloat16), values, torch.ones(16))
    assert torch.all(y == 0)
    y = kernel_linear("INT8", torch.ones(3, 64, dtype=torch.bfloat16), values, torch.zeros(16))
    assert torch.all(y == 0)


@pytest.mark.parametrize("tokens", [1, 5])
def test_int8_sums_at_their_largest(tokens):
    """Every weight -128 times every activation at its largest: over a row of 7,168 inputs the
    integer sum overflows int32; the kernels take it over runs of inputs short enough to be exact."""
    n, k = 32, 7168
    values = torch.full((n, k), -128, dtype=torch.int8)
    y = kernel_linear("INT8", torch.ones(tokens, k, dtype=torch.bfloat16), values, torch.full((n,), 0.5))
    assert torch.allclose(y.double(), torch.full_like(y.double(), -64.0 * k), rtol=1e-6, atol=0)


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("tokens", [1, 2, 5])
@pytest.mark.parametrize("method", ["INT4", "MXFP4"])
def test_four_bit_sums_at_their_largest(method, tokens, int8_activations):
    """Every weight at its largest (INT4 7, MXFP4 6) and every activation +-1, quantized to +-127:
    each partial integer sum a tile keeps reaches its largest (avx2 adds the products of 4 INT4
    lines in int16 lanes: 30,480 of 32,767) and the results stay exact."""
    n, k = 32, 7168
    codes = torch.full((n, k // 2), 0x77, dtype=torch.uint8)
    if method == "INT4":
        scale, value = torch.full((n, k // 128), 0.5), 3.5
    else:
        scale, value = torch.full((n, k // 32), 127, dtype=torch.uint8), 6.0  # E8M0 127: 1.0
    x = torch.ones(tokens, k, dtype=torch.bfloat16)
    x[1::2] = -1
    y = torch.empty(tokens, n)
    ext.linear(method, x.view(torch.int16), codes, scale, y, int8_activations=int8_activations)
    expected = value * k * x[:, :1].double().expand(tokens, n)
    assert torch.equal(y.double(), expected)


# ---- the MoE forward --------------------------------------------------------------------------
def canonical(p, method: str) -> dict[str, torch.Tensor]:
    """Canonical values/scales of the problem's weights; the problem's weights are replaced by their
    exact decoded values (for the reference)."""
    tensors = {}
    for name in ("gate", "up", "down"):
        values, scales = quant.quantize(method, getattr(p, name))
        tensors[name], tensors[f"{name}_scale"] = values, scales
        setattr(p, name, decode(method, values, scales).float())
    return tensors


def int_wrapper(p, method: str, threads: int = 2, gpu_experts_mask=None) -> KTMoEWrapper:
    return moe_wrapper(*p.shape, gpu_experts_mask=gpu_experts_mask, cpuinfer_threads=threads, method=method)


def load_canonical(moe: KTMoEWrapper, t: dict[str, torch.Tensor]) -> None:
    scales = {f"{name}_scale": t[f"{name}_scale"] for name in ("gate", "up", "down")}
    moe.load_weights_from_tensors(t["gate"], t["up"], t["down"], **scales)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# Per-row int8 activations (hidden and intermediate) cost ~1-2 % relative error on these problems.
ACTIVATION_QUANTIZATION_ERROR = 0.03


@pytest.mark.parametrize("method", ["INT8", "INT4"])
@pytest.mark.parametrize(
    "experts,top_k,hidden,inter,tokens",
    [(8, 2, 64, 32, 1), (16, 4, 128, 96, 8), (32, 8, 256, 160, 64), (12, 6, 96, 224, 301), (4, 4, 32, 32, 3)],
)
def test_forward_matches_reference(method, experts, top_k, hidden, inter, tokens):
    p = make_problem(experts, top_k, hidden, inter, tokens, seed=experts + tokens)
    tensors = canonical(p, method)
    moe = int_wrapper(p, method)
    load_canonical(moe, tensors)
    out = moe.forward(p.hidden, p.ids, p.weights)
    assert relative_error(out, reference_forward(p)) < ACTIVATION_QUANTIZATION_ERROR


def test_int8_odd_sizes_and_masks():
    p = make_problem(experts=8, top_k=2, hidden=70, inter=45, tokens=200, seed=4)
    p.ids[:, 0] = 5  # a hot expert
    p.ids[:, 1] = torch.where(p.ids[:, 1] == 5, torch.full_like(p.ids[:, 1], 2), p.ids[:, 1])
    p.ids[::7, 1] = -1
    mask = torch.zeros(8, dtype=torch.bool)
    mask[2] = True
    tensors = canonical(p, "INT8")
    moe = int_wrapper(p, "INT8", gpu_experts_mask=mask)
    load_canonical(moe, tensors)
    out = moe.forward(p.hidden, p.ids, p.weights)
    assert relative_error(out, reference_forward(p, skip=mask)) < ACTIVATION_QUANTIZATION_ERROR


@pytest.mark.parametrize("method,float_error", [("INT8", 0.05), ("INT4", 0.35)])
def test_quantize_on_load_equals_canonical_load_and_tracks_float_weights(method, float_error):
    p = make_problem(experts=8, top_k=2, hidden=256, inter=128, tokens=24, seed=5)
    float_ref = reference_forward(p)
    from_floats = int_wrapper(p, method)
    from_floats.load_weights_from_tensors(p.gate, p.up, p.down)
    out = from_floats.forward(p.hidden, p.ids, p.weights)
    tensors = canonical(p, method)  # the same quantization, done outside
    from_bytes = int_wrapper(p, method)
    load_canonical(from_bytes, tensors)
    assert torch.equal(out, from_bytes.forward(p.hidden, p.ids, p.weights))
    assert relative_error(out, float_ref) < float_error


def test_int4_group_sizes_and_bf16_scales():
    p = make_problem(experts=4, top_k=2, hidden=256, inter=128, tokens=10, seed=8)
    outs = []
    for group in (32, 64, 128):
        q = {n: quant.quantize("INT4", getattr(p, n), group_size=group) for n in ("gate", "up", "down")}
        moe = int_wrapper(p, "INT4")
        moe.load_weights_from_tensors(
            q["gate"][0], q["up"][0], q["down"][0],
            gate_scale=q["gate"][1].to(torch.bfloat16), up_scale=q["up"][1], down_scale=q["down"][1],
        )  # fmt: skip
        outs.append(moe.forward(p.hidden, p.ids, p.weights))
    ref = reference_forward(p)
    errors = [relative_error(o, ref) for o in outs]
    assert errors[0] < errors[2] < 0.35, errors  # finer groups, smaller error


def test_threads_and_async_agree():
    p = make_problem(experts=16, top_k=4, hidden=192, inter=96, tokens=33, seed=6)
    tensors = canonical(p, "INT4")
    outs = []
    for threads in (1, 2, 3):
        moe = int_wrapper(p, "INT4", threads=threads)
        load_canonical(moe, tensors)
        outs.append(moe.forward(p.hidden, p.ids, p.weights))
    moe.submit_forward(p.hidden, p.ids, p.weights)
    outs.append(moe.sync_forward())
    assert all(torch.equal(outs[0], o) for o in outs[1:])


# ---- bad input --------------------------------------------------------------------------------
def bad_load(method: str, **changes):
    p = make_problem(experts=4, top_k=2, hidden=64, inter=32, tokens=1)
    tensors = canonical(p, method)
    tensors.update(changes)
    load_canonical(int_wrapper(p, method), tensors)


def test_bad_integer_weights_name_the_tensor():
    with pytest.raises(TypeError, match="gate_proj"):
        bad_load("INT8", gate=torch.zeros(4, 32, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="up_proj"):
        bad_load("INT8", up=torch.zeros(4, 32, 63, dtype=torch.int8))
    with pytest.raises(ValueError, match="down_scale"):
        bad_load("INT8", down_scale=torch.ones(4, 64, 2))
    with pytest.raises(TypeError, match="gate_scale"):
        bad_load("INT8", gate_scale=torch.ones(4, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="up_scale.*non-finite"):
        bad_load("INT8", up_scale=torch.full((4, 32), float("nan")))
    with pytest.raises(ValueError, match="gate_scale.*group size 16"):
        bad_load("INT4", gate_scale=torch.ones(4, 32, 4))
    with pytest.raises(ValueError, match="down_proj"):
        bad_load("INT4", down=torch.zeros(4, 64, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiples of 32"):
        moe_wrapper(4, 2, 48, 32, method="INT4")
