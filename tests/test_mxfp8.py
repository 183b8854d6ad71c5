"""MXFP8 (E4M3 codes, one E8M0 scale per 32 inputs of a row) runs as FP8 with blocks of 32, its
scales taken exactly as the floats 2^(s - 127): from tensors, and from a checkpoint as MiniMax-M3 ships
it (block_sparse_moe.experts.{e}.w1/w3/w2 with weight_scale_inv), with its clamped SwiGLU. Within 0.5 %
of fp64 on the stored weights, outlier activations included. (The kernels' FP8 blocks of 32 run under
every build in test_accuracy.py's odd shape, whose K is not a multiple of 128.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from test_accuracy import BOUND, activations, reference, relative_error, routing

from kt_kernel import formats
from kt_kernel.safetensors_io import CheckpointError

from moe_reference import moe_wrapper

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 256, 96
LIMIT, ALPHA = 7.0, 1.702


def mxfp8(rows: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random normal E4M3 codes [rows, k] and E8M0 scales [rows, k/32] (about 2^-6)."""
    codes = torch.randint(0, 256, (rows, k), generator=g, dtype=torch.uint8)
    codes = torch.where((codes & 0x78) == 0, codes | 0x40, codes)  # normal codes, no NaN (0x7F)
    codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes)
    return codes, torch.randint(117, 122, (rows, k // 32), generator=g, dtype=torch.uint8)


def decoded(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).double() * torch.exp2(scales.double() - 127).repeat_interleave(
        32, -1
    )


def expert_weights(seed: int = 0) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w1": (INTER, HIDDEN), "w3": (INTER, HIDDEN), "w2": (HIDDEN, INTER)}
    return {name: [mxfp8(*shape, g) for _ in range(EXPERTS)] for name, shape in shapes.items()}


def exact(weights) -> list[torch.Tensor]:
    return [torch.stack([decoded(*pair) for pair in weights[name]]) for name in ("w1", "w3", "w2")]


@pytest.mark.parametrize("scale_dtype", [torch.uint8, torch.float8_e8m0fnu])
@pytest.mark.parametrize("tokens", [1, 40])
def test_mxfp8_from_tensors(scale_dtype, tokens):
    weights = expert_weights()
    codes = [torch.stack([c for c, _ in weights[n]]) for n in ("w1", "w3", "w2")]
    scales = [torch.stack([s for _, s in weights[n]]).view(scale_dtype) for n in ("w1", "w3", "w2")]
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="MXFP8")
    moe.load_weights_from_tensors(
        *codes, **dict(zip(("gate_scale", "up_scale", "down_scale"), scales, strict=True))
    )
    assert moe.weight_format == "FP8"
    x = activations(tokens, HIDDEN, 100)
    ids, topk_weights = routing(tokens, EXPERTS, TOP_K, hot=True)
    error = relative_error(moe.forward(x, ids, topk_weights), reference(exact(weights), x, ids, topk_weights))
    assert error < BOUND, f"relative error {error:.4%}"


def write_minimax_m3(directory, weights, layer: int = 0) -> None:
    tensors = {"model.embed_tokens.weight": torch.zeros(4, HIDDEN, dtype=torch.bfloat16)}
    for name, pairs in weights.items():
        for expert, (codes, scales) in enumerate(pairs):
            key = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{name}.weight"
            tensors[key] = codes.view(torch.float8_e4m3fn)
            tensors[key + "_scale_inv"] = scales
    save_file(tensors, str(directory / "model.safetensors"))


def test_mxfp8_checkpoint_as_minimax_m3_ships_it(tmp_path):
    weights = expert_weights(1)
    write_minimax_m3(tmp_path, weights)
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="MXFP8", weight_path=str(tmp_path),
                      swiglu_limit=LIMIT, swiglu_alpha=ALPHA)  # fmt: skip
    moe.load_weights()
    x = activations(33, HIDDEN, 100) * 4  # past the clamp
    ids, topk_weights = routing(33, EXPERTS, TOP_K, hot=True)
    ref = reference(exact(weights), x, ids, topk_weights, LIMIT, ALPHA)
    error = relative_error(moe.forward(x, ids, topk_weights), ref)
    assert error < BOUND, f"relative error {error:.4%}"


def test_e8m0_scales_in_another_shape_or_nan_are_refused(tmp_path):
    codes, scales = mxfp8(INTER, HIDDEN, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match=r"E8M0 scales .* MXFP8's, shaped \[96, 8\]"):
        formats.FP8.stored("w", codes, "s", scales[:, :4])
    scales[3, 2] = 0xFF
    with pytest.raises(ValueError, match="s"):
        formats.FP8.stored("w", codes, "s", scales)
    weights = expert_weights(3)
    weights["w2"][5] = (weights["w2"][5][0], weights["w2"][5][1][:, :2].contiguous())
    write_minimax_m3(tmp_path, weights)
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="FP8", weight_path=str(tmp_path))
    with pytest.raises(CheckpointError, match=r"experts\.5\.w2\.weight_scale_inv"):
        moe.load_weights()
