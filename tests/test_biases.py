"""Expert biases (gpt-oss): gate_bias and up_bias added before the activation, down_bias before the
routing weight, in fp32; as exact as the rest (within 0.5 % of fp64 on the stored weights, outlier
activations included), with subpools, slot maps and deferred experts. Run under every build and path by
test_variants.py."""

from __future__ import annotations

import pytest
import torch
from test_accuracy import BOUND, FORMATS, activations, relative_error, routing, stored_weights, swiglu

from kt_kernel import KTMoEWrapper

from moe_reference import moe_wrapper

SHAPE = (8, 2, 512, 256)
ODD = (5, 3, 352, 224)
GPT_OSS_GATE = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def random_biases(experts: int, hidden: int, inter: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """Biases as large as the projections' outputs, so that a missing or doubled one shows."""
    g = torch.Generator().manual_seed(seed)
    return {
        "gate_bias": torch.randn(experts, inter, generator=g),
        "up_bias": torch.randn(experts, inter, generator=g),
        "down_bias": torch.randn(experts, hidden, generator=g),
    }


def reference(weights, biases, x, ids, topk_weights, limit=None, alpha=None, slot_map=None) -> torch.Tensor:
    """fp64 throughout; slot s holds expert slot_map[s]."""
    gate, up, down = weights
    b = {name: t.double() for name, t in biases.items()}
    x = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for slot in ids.unique().tolist():
        e = int(slot_map[slot]) if slot_map is not None else slot
        token, k = (ids == slot).nonzero(as_tuple=True)
        g = x[token] @ gate[e].T + b["gate_bias"][e]
        u = x[token] @ up[e].T + b["up_bias"][e]
        y = swiglu(g, u, limit, alpha) @ down[e].T + b["down_bias"][e]
        out.index_add_(0, token, topk_weights[token, k].double()[:, None] * y)
    return out


def loaded(method: str, shape, biases: dict | None, **options) -> KTMoEWrapper:
    experts, _, hidden, inter = shape
    load, _ = stored_weights(method, experts, hidden, inter)
    moe = moe_wrapper(*shape, method=method, **options)
    moe.load_weights_from_tensors(*load["tensors"], **load["scales"], **(biases or {}))
    return moe


@pytest.mark.parametrize("method", FORMATS)
@pytest.mark.parametrize(
    "shape,tokens,gate",
    [(SHAPE, 1, {}), (SHAPE, 37, {}), (ODD, 40, {}), (SHAPE, 37, GPT_OSS_GATE)],
    ids=["T1", "T37", "odd-T40", "gpt-oss-gate-T37"],
)
def test_biases_within_half_a_percent_of_fp64(method, shape, tokens, gate):
    experts, top_k, hidden, inter = shape
    biases = random_biases(experts, hidden, inter)
    moe = loaded(method, shape, biases, **gate)
    _, exact = stored_weights(method, experts, hidden, inter)
    x = activations(tokens, hidden, 100)
    ids, topk_weights = routing(tokens, experts, top_k, hot=True)
    limit, alpha = gate.get("swiglu_limit"), gate.get("swiglu_alpha")
    ref = reference(exact, biases, x, ids, topk_weights, limit, alpha)
    error = relative_error(moe.forward(x, ids, topk_weights), ref)
    assert error < BOUND, f"{method}: relative error {error:.4%}"
    zero = {name: torch.zeros_like(t) for name, t in biases.items()}
    assert (
        relative_error(
            moe.forward(x, ids, topk_weights), reference(exact, zero, x, ids, topk_weights, limit, alpha)
        )
        > 0.05
    )


@pytest.mark.parametrize("method", ["BF16", "INT4"])
def test_subpools_add_the_down_bias_once(method):
    experts, top_k, hidden, inter = SHAPE
    biases = random_biases(experts, hidden, inter)
    x = activations(20, hidden, 100)
    ids, topk_weights = routing(20, experts, top_k, hot=False)
    _, exact = stored_weights(method, experts, hidden, inter)
    ref = reference(exact, biases, x, ids, topk_weights)
    split = loaded(method, SHAPE, biases, threadpool_count=2)
    assert relative_error(split.forward(x, ids, topk_weights), ref) < BOUND


def test_each_slot_gets_its_experts_biases():
    experts, top_k, hidden, inter = SHAPE
    biases = random_biases(experts, hidden, inter)
    slot_map = torch.tensor([3, 1, 4, 0, 7, 5, 2, 6])
    load, exact = stored_weights("BF16", experts, hidden, inter)
    moe = moe_wrapper(*SHAPE)
    moe.load_weights_from_tensors(*load["tensors"], physical_to_logical_map_cpu=slot_map, **biases)
    x = activations(12, hidden, 0)
    ids, topk_weights = routing(12, experts, top_k, hot=False)
    ref = reference(exact, biases, x, ids, topk_weights, slot_map=slot_map)
    assert relative_error(moe.forward(x, ids, topk_weights), ref) < BOUND


def bf16_case(tokens: int):
    """Biases, inputs and the stored weights of a BF16 case of SHAPE."""
    experts, top_k, hidden, inter = SHAPE
    x = activations(tokens, hidden, 0)
    ids, topk_weights = routing(tokens, experts, top_k, hot=False)
    _, exact = stored_weights("BF16", experts, hidden, inter)
    return random_biases(experts, hidden, inter), x, ids, topk_weights, exact


def test_only_some_biases_and_a_reload_without_them():
    biases, x, ids, topk_weights, exact = bf16_case(9)
    zero = {name: torch.zeros_like(t) for name, t in biases.items()}
    moe = loaded("BF16", SHAPE, {"down_bias": biases["down_bias"]})
    only_down = zero | {"down_bias": biases["down_bias"]}
    assert (
        relative_error(moe.forward(x, ids, topk_weights), reference(exact, only_down, x, ids, topk_weights))
        < BOUND
    )
    experts, _, hidden, inter = SHAPE
    load, _ = stored_weights("BF16", experts, hidden, inter)
    moe.load_weights_from_tensors(*load["tensors"])  # no biases: the earlier ones are gone
    assert (
        relative_error(moe.forward(x, ids, topk_weights), reference(exact, zero, x, ids, topk_weights))
        < BOUND
    )


def test_deferred_experts_carry_their_biases():
    biases, x, ids, topk_weights, exact = bf16_case(6)
    moe = loaded("BF16", SHAPE, biases, max_deferred_experts_per_token=1)
    out = moe.forward(x, ids, topk_weights).double() + KTMoEWrapper.flush_deferred().double()
    assert relative_error(out, reference(exact, biases, x, ids, topk_weights)) < BOUND


@pytest.mark.parametrize(
    "name,value,error,match",
    [
        (
            "gate_bias",
            torch.zeros(8, 255),
            ValueError,
            r"gate_bias must have shape \[E, moe_intermediate_size\]",
        ),
        ("down_bias", torch.zeros(8, 256), ValueError, "down_bias"),
        ("up_bias", torch.zeros(8, 256, dtype=torch.int32), TypeError, "up_bias must be bf16, fp16 or fp32"),
        (
            "down_bias",
            torch.full((8, 512), float("nan")),
            ValueError,
            "down_bias holds a value that is not finite",
        ),
        ("gate_bias", [0.0] * 256, TypeError, "gate_bias must be a torch.Tensor"),
    ],
)
def test_bad_biases_are_refused(name, value, error, match):
    experts, _, hidden, inter = SHAPE
    load, _ = stored_weights("BF16", experts, hidden, inter)
    moe = moe_wrapper(*SHAPE)
    with pytest.raises(error, match=match):
        moe.load_weights_from_tensors(*load["tensors"], **{name: value})


def test_write_back_refuses_biases_it_has_no_buffer_for():
    experts, _, hidden, inter = SHAPE
    moe = loaded("INT8", SHAPE, random_biases(experts, hidden, inter))
    buffers = [torch.empty(4 * inter * hidden, dtype=torch.uint8) for _ in range(4)]
    with pytest.raises(NotImplementedError, match="expert biases"):
        moe.submit_write_weight_scale_to_buffer(1, 0, *([b.data_ptr()] for b in buffers))
