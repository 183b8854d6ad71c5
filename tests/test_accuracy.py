"""Exact by default: every format stays within 0.5 % (relative norm) of an fp64 reference computed
from the weights as stored and the activations as given, also when a few activation channels are
100x the rest. Run under every build and path by test_variants.py; the amx build's tiles by
test_amx_emulation.py through accuracy_case below.

Also here: the clamped SwiGLU forms, and inputs as callers hand them (fp16/fp32, leading dims)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from kt_kernel import formats, quant

from moe_reference import moe_wrapper, random_routing

BOUND = 0.005
FORMATS = list(formats.FORMATS)  # every registered format
OUTLIER_CHANNELS = [7, 300, 1001, 1900]
# (experts, top_k, hidden, intermediate): the qwen3-30b expert shape, and an odd one.
QWEN3 = (8, 2, 2048, 768)
ODD = (5, 3, 352, 224)


@functools.cache  # the same weights serve many cases; nothing mutates them
def stored_weights(method: str, experts: int, hidden: int, inter: int, seed: int = 0):
    """(tensors to load, the fp64 weights they hold): gate, up [E, I, H], down [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    floats = [
        torch.randn(experts, inter, hidden, generator=g) / hidden**0.5,
        torch.randn(experts, inter, hidden, generator=g) / hidden**0.5,
        torch.randn(experts, hidden, inter, generator=g) / inter**0.5,
    ]
    if method == "BF16":
        bf16 = [w.to(torch.bfloat16) for w in floats]
        return {"tensors": bf16, "scales": {}}, [w.double() for w in bf16]
    pairs = [[quant.quantize(method, expert) for expert in w] for w in floats]
    values = [torch.stack([v for v, _ in p]) for p in pairs]
    scales = [torch.stack([s for _, s in p]) for p in pairs]
    exact = [
        torch.stack([quant.dequantize(method, v, s) for v, s in zip(vs, ss, strict=True)]).double()
        for vs, ss in zip(values, scales, strict=True)
    ]
    names = ("gate_scale", "up_scale", "down_scale")
    return {"tensors": values, "scales": dict(zip(names, scales, strict=True))}, exact


def activations(tokens: int, hidden: int, outliers: float, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    if outliers:
        x[:, [c % hidden for c in OUTLIER_CHANNELS]] *= outliers
    return x.to(torch.bfloat16)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None, alpha: float | None = None):
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    if alpha:
        return gate * torch.sigmoid(alpha * gate) * (up + 1)
    return F.silu(gate) * up


def reference(weights, x, ids, topk_weights, limit=None, alpha=None) -> torch.Tensor:
    """fp64 throughout, the intermediate activation included."""
    gate, up, down = weights
    x = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for expert in ids.unique().tolist():
        token, k = (ids == expert).nonzero(as_tuple=True)
        act = swiglu(x[token] @ gate[expert].T, x[token] @ up[expert].T, limit, alpha)
        out.index_add_(0, token, topk_weights[token, k].double()[:, None] * (act @ down[expert].T))
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def routing(tokens: int, experts: int, top_k: int, hot: bool, seed: int = 2):
    ids, topk_weights = random_routing(tokens, experts, top_k, torch.Generator().manual_seed(seed))
    if hot:  # every token also goes to expert 0
        ids[:, 0] = torch.where((ids[:, 1:] == 0).any(dim=1), ids[:, 0], 0)
    return ids, topk_weights


def accuracy_case(forward, method, shape, tokens, outliers, hot=False) -> float:
    """forward(load, x, ids, topk_weights) -> bf16 output; returns the relative error."""
    experts, top_k, hidden, inter = shape
    load, exact = stored_weights(method, experts, hidden, inter)
    x = activations(tokens, hidden, outliers)
    ids, topk_weights = routing(tokens, experts, top_k, hot)
    return relative_error(forward(load, x, ids, topk_weights), reference(exact, x, ids, topk_weights))


def wrapper_forward(method, shape, **options):
    def forward(load, x, ids, topk_weights):
        moe = moe_wrapper(*shape, method=method, **options)
        moe.load_weights_from_tensors(*load["tensors"], **load["scales"])
        return moe.forward(x, ids, topk_weights)

    return forward


@pytest.mark.parametrize("method", FORMATS)
@pytest.mark.parametrize(
    "shape,tokens,outliers,hot",
    [
        (QWEN3, 16, 0, False),
        (QWEN3, 16, 20, False),
        (QWEN3, 16, 100, False),
        (QWEN3, 1, 100, False),
        (QWEN3, 600, 100, True),
        (ODD, 37, 100, True),
    ],
    ids=["gaussian", "x20", "x100", "x100-T1", "x100-T600-hot", "odd-x100-hot"],
)
def test_within_half_a_percent_of_fp64_on_the_stored_weights(method, shape, tokens, outliers, hot):
    error = accuracy_case(wrapper_forward(method, shape), method, shape, tokens, outliers, hot)
    assert error < BOUND, f"{method}: relative error {error:.4%}"


@pytest.mark.parametrize("method", ["MXFP4", "INT8", "INT4"])
def test_int8_activations_are_the_opt_in_lossy_mode(method):
    """The fast mode rounds each activation row to int8: fine on Gaussian rows, not with outliers."""
    shape = (8, 2, 512, 256)
    lossy = wrapper_forward(method, shape, int8_activations=True)
    assert accuracy_case(lossy, method, shape, 16, 0) < 0.05
    assert accuracy_case(lossy, method, shape, 16, 100) > BOUND


@pytest.mark.parametrize("method", ["BF16", "INT4"])
@pytest.mark.parametrize(
    "limit,alpha", [(0.5, None), (0.5, 1.702), (None, 1.702)], ids=["v4", "oai", "oai-nolimit"]
)
def test_clamped_swiglu_matches_the_formula(method, limit, alpha):
    shape = (4, 2, 256, 128)
    experts, top_k, hidden, inter = shape
    load, exact = stored_weights(method, experts, hidden, inter)
    x = activations(24, hidden, 0) * 4  # gate/up values well past the limit on both sides
    ids, topk_weights = routing(24, experts, top_k, hot=False)
    gate_values = x.double() @ exact[0][0].T
    assert (gate_values > 0.5).any() and (gate_values < -0.5).any()
    moe = moe_wrapper(*shape, method=method, swiglu_limit=limit, swiglu_alpha=alpha)
    moe.load_weights_from_tensors(*load["tensors"], **load["scales"])
    ref = reference(exact, x, ids, topk_weights, limit, alpha)
    assert relative_error(moe.forward(x, ids, topk_weights), ref) < BOUND
    assert relative_error(moe.forward(x, ids, topk_weights), reference(exact, x, ids, topk_weights)) > 0.05


@pytest.mark.parametrize("name,value", [("swiglu_limit", -1.0), ("swiglu_alpha", float("nan"))])
def test_bad_swiglu_parameters(name, value):
    with pytest.raises(ValueError, match=name):
        moe_wrapper(4, 2, 64, 64, **{name: value})


def test_fp16_fp32_and_leading_dims_give_the_bf16_2d_result():
    shape = (6, 2, 128, 64)
    load, _ = stored_weights("INT4", 6, 128, 64)
    moe = moe_wrapper(*shape, method="INT4")
    moe.load_weights_from_tensors(*load["tensors"], **load["scales"])
    x = activations(12, 128, 0)
    ids, topk_weights = routing(12, 6, 2, hot=False)
    expected = moe.forward(x, ids, topk_weights)
    for dtype in (torch.float16, torch.float32):
        assert torch.equal(moe.forward(x.to(dtype), ids, topk_weights), expected)
    for dtype in (torch.bfloat16, torch.float16):
        rounded = topk_weights.to(dtype)
        assert torch.equal(moe.forward(x, ids, rounded), moe.forward(x, ids, rounded.float()))
    out = moe.forward(x.view(3, 4, 128), ids.view(3, 4, 2), topk_weights.view(3, 4, 2))
    assert out.shape == (12, 128) and torch.equal(out, expected)
    out = moe.forward(x.view(3, 4, 128), ids.int(), topk_weights)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("tokens", [8, 64])
def test_clear_buffer_cache_keeps_quantized_results(int8_activations, tokens):
    """The freed buffers grow back with the engine's layout (one or two quantized rows per row)."""
    from kt_kernel import KTMoEWrapper

    experts, top_k, hidden, inter = QWEN3
    load, _ = stored_weights("INT8", experts, hidden, inter)
    x = activations(tokens, hidden, 0)
    ids, topk_weights = routing(tokens, experts, top_k, hot=False)
    moe = moe_wrapper(*QWEN3, method="INT8", int8_activations=int8_activations)
    moe.load_weights_from_tensors(*load["tensors"], **load["scales"])
    before = moe.forward(x, ids, topk_weights)
    KTMoEWrapper.clear_buffer_cache()
    assert torch.equal(moe.forward(x, ids, topk_weights), before)
