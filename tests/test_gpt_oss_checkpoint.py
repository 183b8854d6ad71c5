"""gpt-oss's experts read from its checkpoint by load_weights (method MXFP4): gate and up interleaved
in one fused tensor, E8M0-scaled E2M1 blocks held bit for bit, expert biases, the clamped SwiGLU with
(up + 1). Compared with an fp64 reference that decodes the stored blocks as gpt-oss defines them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from test_accuracy import BOUND, activations, relative_error, routing

from kt_kernel.safetensors_io import CheckpointError

from moe_reference import moe_wrapper

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
LIMIT, ALPHA = 7.0, 1.702
EXPERTS, TOP_K, HIDDEN, INTER = 32, 4, 96, 64


def random_fused(experts: int, rows: int, k: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "blocks": torch.randint(0, 256, (experts, rows, k // 32, 16), generator=g, dtype=torch.uint8),
        "scales": torch.randint(121, 125, (experts, rows, k // 32), generator=g, dtype=torch.uint8),
        "bias": torch.randn(experts, rows, generator=g).to(torch.bfloat16),
    }


def write_checkpoint(directory, layer: int = 1, prefix: str = "model.", seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "gate_up": random_fused(EXPERTS, 2 * INTER, HIDDEN, g),
        "down": random_fused(EXPERTS, HIDDEN, INTER, g),
    }
    flat = {
        f"{prefix}layers.{layer}.mlp.experts.{fused}_proj_{kind}": t
        for fused, parts in tensors.items()
        for kind, t in parts.items()
    }
    flat[f"{prefix}layers.{layer}.self_attn.q_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(flat, str(directory / "model.safetensors"))
    return tensors


def decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, N, K] fp64 as gpt-oss decodes its blocks: the low nibble first, times 2^(scale - 127)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:2], -1).long()
    values = E2M1.double()[codes]
    return values * torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=-1)


def reference(tensors: dict, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    gate_up = decode(tensors["gate_up"]["blocks"], tensors["gate_up"]["scales"])
    down = decode(tensors["down"]["blocks"], tensors["down"]["scales"])
    gate_up_bias, down_bias = tensors["gate_up"]["bias"].double(), tensors["down"]["bias"].double()
    x = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for expert in ids.unique().tolist():
        token, k = (ids == expert).nonzero(as_tuple=True)
        fused = x[token] @ gate_up[expert].T + gate_up_bias[expert]
        gate, up = fused[:, ::2].clamp(max=LIMIT), fused[:, 1::2].clamp(-LIMIT, LIMIT)
        h = (up + 1) * gate * torch.sigmoid(ALPHA * gate)
        out.index_add_(
            0, token, weights[token, k].double()[:, None] * (h @ down[expert].T + down_bias[expert])
        )
    return out


def gpt_oss_wrapper(path, **options):
    return moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="MXFP4", weight_path=str(path), layer_idx=1,
                       swiglu_limit=LIMIT, swiglu_alpha=ALPHA, **options)  # fmt: skip


@pytest.mark.parametrize("prefix", ["model.", ""])
@pytest.mark.parametrize("tokens", [1, 37])
def test_gpt_oss_checkpoint_within_half_a_percent_of_fp64(tmp_path, prefix, tokens):
    tensors = write_checkpoint(tmp_path, prefix=prefix)
    moe = gpt_oss_wrapper(tmp_path)
    moe.load_weights()  # 32 experts: read and packed in 16 parts of 2
    x = activations(tokens, HIDDEN, 100)
    ids, weights = routing(tokens, EXPERTS, TOP_K, hot=tokens > 1)
    error = relative_error(moe.forward(x, ids, weights), reference(tensors, x, ids, weights))
    assert error < BOUND, f"relative error {error:.4%}"


def test_slot_map_subpools_and_an_expert_the_mask_hands_back(tmp_path):
    tensors = write_checkpoint(tmp_path)
    slot_map = torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(EXPERTS, dtype=torch.bool)
    mask[slot_map == 3] = True  # the slot of expert 3 starts on the GPU, out of CPU memory
    moe = gpt_oss_wrapper(tmp_path, threadpool_count=2, gpu_experts_mask=mask, skip_gpu_expert_cpu_copy=True)
    moe.load_weights(slot_map)
    moe.gpu_experts_mask = torch.zeros(EXPERTS, dtype=torch.bool)  # read from the checkpoint at the next call
    x = activations(24, HIDDEN, 100)
    ids, weights = routing(24, EXPERTS, TOP_K, hot=False)
    ids[:, 0] = int(torch.nonzero(slot_map == 3))
    by_expert = slot_map[ids]  # the slots' experts, for the reference
    error = relative_error(moe.forward(x, ids, weights), reference(tensors, x, by_expert, weights))
    assert error < BOUND, f"relative error {error:.4%}"


def test_the_blocks_are_held_bit_for_bit(tmp_path):
    """Read back through unpack: the codes and scales as stored, gate the even rows, up the odd ones."""
    from kt_kernel import checkpoint

    tensors = write_checkpoint(tmp_path)
    read = checkpoint.read_layer(tmp_path, 1, range(2, 5), "MXFP4")
    blocks = tensors["gate_up"]["blocks"][2:5].reshape(3, 2 * INTER, -1)
    assert torch.equal(read["gate"], blocks[:, 0::2]) and torch.equal(read["up"], blocks[:, 1::2])
    assert torch.equal(read["up_scale"], tensors["gate_up"]["scales"][2:5, 1::2])
    assert torch.equal(read["down"], tensors["down"]["blocks"][2:5].reshape(3, HIDDEN, -1))
    assert torch.equal(read["gate_bias"], tensors["gate_up"]["bias"][2:5, 0::2].float())
    assert read["down_bias"].dtype == torch.float32 and read["down_bias"].shape == (3, HIDDEN)


def test_a_bad_tensor_is_an_error_naming_it(tmp_path):
    write_checkpoint(tmp_path)
    from safetensors.torch import load_file

    flat = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.1.mlp.experts.down_proj_scales"
    flat[key] = flat[key][:, :-1].contiguous()
    save_file(flat, str(tmp_path / "model.safetensors"))
    moe = gpt_oss_wrapper(tmp_path)
    with pytest.raises(CheckpointError, match=r"down_proj_scales.*expected U8"):
        moe.load_weights()
