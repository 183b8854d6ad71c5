"""Bad input gets a clear exception naming the argument: never a crash, never silent garbage."""

from __future__ import annotations

import pytest
import torch

from kt_kernel import KTMoEWrapper

from moe_reference import moe_wrapper

E, K, H, I = 8, 2, 64, 48
MXI = 32  # MXFP4 needs multiples of 32


def wrapper(**overrides) -> KTMoEWrapper:
    return moe_wrapper(E, K, H, I, **overrides)


def weights(experts: int = E, dtype=torch.bfloat16):
    return (
        torch.randn(experts, I, H, dtype=dtype),
        torch.randn(experts, I, H, dtype=dtype),
        torch.randn(experts, H, I, dtype=dtype),
    )


@pytest.fixture
def loaded() -> KTMoEWrapper:
    moe = wrapper()
    moe.load_weights_from_tensors(*weights())
    return moe


def inputs(tokens: int = 3):
    return (
        torch.randn(tokens, H).to(torch.bfloat16),
        torch.tensor([[0, 1]] * tokens),
        torch.full((tokens, K), 0.5),
    )


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        ({"method": "NF4"}, ValueError, "unknown method 'NF4'.*BF16.*FP8_PERCHANNEL"),
        ({"method": None}, ValueError, "unknown method"),
        ({"num_experts_per_tok": 9}, ValueError, "num_experts_per_tok \\(9\\) cannot exceed num_experts"),
        ({"cpuinfer_threads": 0}, ValueError, "cpuinfer_threads must be >= 1"),
        ({"cpuinfer_threads": 1.5}, TypeError, "cpuinfer_threads must be an int"),
        ({"threadpool_count": 0}, ValueError, "threadpool_count must be >= 1"),
        ({"hidden_size": 0}, ValueError, "hidden_size must be >= 1"),
        ({"num_experts": True}, TypeError, "num_experts must be an int"),
        ({"layer_idx": -1}, ValueError, "layer_idx"),
        ({"chunked_prefill_size": 0}, ValueError, "chunked_prefill_size"),
        (
            {"gpu_experts_mask": torch.zeros(7, dtype=torch.bool)},
            ValueError,
            "gpu_experts_mask must have shape",
        ),
        ({"gpu_experts_mask": torch.zeros(8)}, TypeError, "gpu_experts_mask must be a bool tensor"),
        ({"max_deferred_experts_per_token": 2}, ValueError, "must be less than num_experts_per_tok"),
        ({"threadpool_count": 3}, ValueError, r"threadpool_count \(3\) cannot exceed cpuinfer_threads"),
        ({"threadpool_count": 2, "numa_nodes": [0, 4099]}, ValueError, "NUMA node 4099"),
        (
            {"method": "AMXINT4"},
            ValueError,
            "INT4 needs hidden_size and moe_intermediate_size to be multiples of 32",
        ),
        (
            {"method": "mxfp4"},
            ValueError,
            "MXFP4 needs hidden_size and moe_intermediate_size to be multiples of 32",
        ),
        (
            {"method": "INT8", "hidden_size": 65537},
            ValueError,
            "INT8 needs hidden_size and moe_intermediate_size <= 65536",
        ),
    ],
)
def test_bad_construction(overrides, error, match):
    with pytest.raises(error, match=match):
        wrapper(**overrides)


def test_accepted_upstream_arguments():
    moe = wrapper(cpu_save=True, numa_nodes=[0], max_deferred_experts_per_token=0, method="bf16")
    assert moe.method == "bf16" and moe.weight_format == "BF16" and moe.numa_nodes == [0]


@pytest.mark.parametrize(
    "index,bad,error,match",
    [
        (0, torch.randn(E, I, H + 1), ValueError, "gate_proj must have shape"),
        (1, torch.randn(E, I + 1, H), ValueError, "up_proj must have shape"),
        (2, torch.randn(E, I, H), ValueError, "down_proj must have shape"),
        (2, torch.randn(E - 1, H, I), ValueError, "down_proj must have shape"),
        (0, torch.randint(0, 3, (E, I, H)), TypeError, "gate_proj must be bf16, fp16 or fp32"),
        (1, torch.randn(I, H), ValueError, "up_proj must be 3-D"),
        (0, [[1.0]], TypeError, "gate_proj must be a torch.Tensor"),
        (0, torch.randn(E, I, H, device="meta"), ValueError, "gate_proj must be on the CPU"),
    ],
)
def test_bad_weights(index, bad, error, match):
    tensors = list(weights())
    tensors[index] = bad
    with pytest.raises(error, match=match):
        wrapper().load_weights_from_tensors(*tensors)


def test_weights_for_a_different_expert_count_need_a_map():
    with pytest.raises(ValueError, match="hold 6 experts but num_experts is 8"):
        wrapper().load_weights_from_tensors(*weights(6))


@pytest.mark.parametrize(
    "slot_map,error,match",
    [
        (torch.arange(7), ValueError, "physical_to_logical_map_cpu must have shape"),
        (torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]), ValueError, "values must lie in \\[0, 8\\)"),
        (torch.tensor([0, 1, 2, 3, 4, 5, 6, -1]), ValueError, "values must lie in"),
        (torch.zeros(8), TypeError, "must be an integer tensor"),
    ],
)
def test_bad_slot_map(slot_map, error, match):
    with pytest.raises(error, match=match):
        wrapper().load_weights_from_tensors(*weights(), physical_to_logical_map_cpu=slot_map)


def test_forward_before_load():
    with pytest.raises(RuntimeError, match="weights are not loaded"):
        wrapper().forward(*inputs())


def test_sync_without_submit(loaded):
    with pytest.raises(RuntimeError, match="sync_forward called without a submit_forward"):
        loaded.sync_forward()


def test_double_submit(loaded):
    loaded.submit_forward(*inputs())
    with pytest.raises(RuntimeError, match="call sync_forward first"):
        loaded.submit_forward(*inputs())
    with pytest.raises(RuntimeError, match="call sync_forward first"):
        loaded.load_weights_from_tensors(*weights())
    assert loaded.sync_forward().shape == (3, H)


@pytest.mark.parametrize(
    "index,bad,error,match",
    [
        (
            0,
            torch.randn(3, H, dtype=torch.float64),
            TypeError,
            "hidden_states must be bfloat16, float16 or float32",
        ),
        (0, torch.randn(3, H + 1).to(torch.bfloat16), ValueError, "hidden_states must have shape"),
        (0, torch.randn(H).to(torch.bfloat16), ValueError, "hidden_states must have shape"),
        (0, torch.randn(2, 1, H).to(torch.bfloat16), ValueError, "topk_ids must have shape"),
        (0, "x", TypeError, "hidden_states must be a torch.Tensor"),
        (
            0,
            torch.randn(3, H, device="meta").to(torch.bfloat16),
            ValueError,
            "hidden_states must be on the CPU",
        ),
        (1, torch.tensor([[0, 1]] * 3, dtype=torch.float32), TypeError, "topk_ids must be int64 or int32"),
        (1, torch.tensor([[0, 1, 2]] * 3), ValueError, "topk_ids must have shape"),
        (1, torch.tensor([[0, 1]] * 2), ValueError, "topk_ids must have shape"),
        (2, torch.full((3, 3), 0.5), ValueError, "topk_weights must have shape"),
        (2, torch.ones(3, K, dtype=torch.int64), TypeError, "topk_weights must be a floating-point"),
        (
            1,
            torch.tensor([[0, 1], [0, 8], [2, 3]]),
            ValueError,
            "topk_ids\\[1, 1\\] = 8 is outside \\[-1, 8\\)",
        ),
        (1, torch.tensor([[0, 1], [0, 1], [-2, 3]]), ValueError, "topk_ids\\[2, 0\\] = -2 is outside"),
    ],
)
def test_bad_forward_inputs(loaded, index, bad, error, match):
    args = list(inputs())
    args[index] = bad
    with pytest.raises(error, match=match):
        loaded.forward(*args)
    # The wrapper is still usable afterwards.
    assert loaded.forward(*inputs()).shape == (3, H)


def mxfp4_tensors(experts: int = E) -> dict[str, torch.Tensor]:
    return {
        "gate_proj": torch.zeros(experts, MXI, H // 2, dtype=torch.uint8),
        "up_proj": torch.zeros(experts, MXI, H // 2, dtype=torch.uint8),
        "down_proj": torch.zeros(experts, H, MXI // 2, dtype=torch.uint8),
        "gate_scale": torch.full((experts, MXI, H // 32), 127, dtype=torch.uint8),
        "up_scale": torch.full((experts, MXI, H // 32), 127, dtype=torch.uint8),
        "down_scale": torch.full((experts, H, MXI // 32), 127, dtype=torch.uint8),
    }


def test_mxfp4_canonical_tensors_load():
    wrapper(method="MXFP4", moe_intermediate_size=MXI).load_weights_from_tensors(**mxfp4_tensors())


@pytest.mark.parametrize(
    "name,bad,error,match",
    [
        (
            "gate_proj",
            torch.zeros(E, MXI, H // 2),
            TypeError,
            "gate_proj must hold MXFP4 codes as uint8 or int8",
        ),
        ("up_proj", torch.zeros(E, MXI, H, dtype=torch.uint8), ValueError, "up_proj must have shape"),
        (
            "down_proj",
            torch.zeros(E, H, MXI // 2 + 1, dtype=torch.uint8),
            ValueError,
            "down_proj must have shape",
        ),
        (
            "gate_scale",
            torch.zeros(E, MXI, H // 32, dtype=torch.int32),
            TypeError,
            "gate_scale must be uint8 or",
        ),
        ("up_scale", torch.zeros(E, MXI, H // 16, dtype=torch.uint8), ValueError, "up_scale must have shape"),
        ("down_scale", None, ValueError, "pass all of gate_scale, up_scale and down_scale"),
    ],
)
def test_bad_mxfp4_tensors(name, bad, error, match):
    tensors = mxfp4_tensors()
    tensors[name] = bad
    with pytest.raises(error, match=match):
        wrapper(method="MXFP4", moe_intermediate_size=MXI).load_weights_from_tensors(**tensors)


def test_nan_scale_names_the_tensor():
    tensors = mxfp4_tensors()
    tensors["up_scale"][3, 5, 1] = 0xFF
    with pytest.raises(
        ValueError, match="up_scale holds the E8M0 NaN code 0xFF \\(first at index \\[3, 5, 1\\]\\)"
    ):
        wrapper(method="MXFP4", moe_intermediate_size=MXI).load_weights_from_tensors(**tensors)


def test_scales_with_bf16_are_rejected():
    tensors = mxfp4_tensors()
    with pytest.raises(ValueError, match="BF16 weights take no scales"):
        wrapper().load_weights_from_tensors(*weights(), gate_scale=tensors["gate_scale"])


def test_mxfp4_from_integer_floats_rejected():
    with pytest.raises(TypeError, match="gate_proj must be bf16, fp16 or fp32"):
        wrapper(method="MXFP4", moe_intermediate_size=MXI).load_weights_from_tensors(
            torch.zeros(E, MXI, H, dtype=torch.int32), *weights()[1:]
        )


def test_submit_addresses_refuses_no_tokens_and_null(loaded):
    # The wrapper's fast path into the engine takes data_ptr()s; what it can still check, it does.
    x, ids, w = inputs()
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="tokens >= 1 and non-null"):
        loaded._layer.submit_addresses(x.data_ptr(), 0, ids.data_ptr(), w.data_ptr(), out.data_ptr())
    with pytest.raises(ValueError, match="tokens >= 1 and non-null"):
        loaded._layer.submit_addresses(x.data_ptr(), 3, 0, w.data_ptr(), out.data_ptr())
    assert loaded.forward(x, ids, w).shape == (3, H)
