"""NVFP4 (NVIDIA ModelOpt: E2M1 values, an E4M3 scale per 16 inputs, an fp32 scale per tensor) runs
exactly as FP8 with blocks of 16: every E2M1 value is an E4M3 code, and the two scales' product is one
fp32 product, never rounded to bf16. From tensors (formats.nvfp4_to_fp8) and from a ModelOpt checkpoint;
within 0.5 % of fp64 on the stored weights, outlier activations included. Run under every build by
test_variants.py; the amx build's tiles, which take 32 inputs a step, leave blocks of 16 to its AVX512
kernel (checked on emulated tiles)."""

from __future__ import annotations

import importlib

import pytest
import torch
from safetensors.torch import save_file
from test_accuracy import BOUND, activations, reference, relative_error, routing

from kt_kernel import formats, held_bytes

from conftest import skip_unless_cpu_runs
from moe_reference import moe_wrapper

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 256, 96
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
GLOBAL = 1 / 3  # not a bf16 number: a product rounded to bf16 would show


def nvfp4(rows: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E2M1 pairs [rows, k/2] and E4M3 block scales [rows, k/16] (0.05 to 1.5, as uint8)."""
    values = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
    scales = (torch.rand(rows, k // 16, generator=g) * 1.45 + 0.05).to(torch.float8_e4m3fn)
    return values, scales.view(torch.uint8)


def decoded(values: torch.Tensor, scales: torch.Tensor, global_scale: float = GLOBAL) -> torch.Tensor:
    """fp64 weights as NVFP4 defines them: E2M1 (low nibble first) x E4M3 block scale x global."""
    codes = torch.stack([values & 0x0F, values >> 4], dim=-1).reshape(*values.shape[:-1], -1).long()
    block = scales.view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=-1)
    return E2M1.double()[codes] * block * global_scale


def expert_weights(seed: int = 0) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}
    return {name: [nvfp4(*shape, g) for _ in range(EXPERTS)] for name, shape in shapes.items()}


def exact(weights) -> list[torch.Tensor]:
    return [torch.stack([decoded(*pair) for pair in pairs]) for pairs in weights.values()]


def test_the_scales_are_one_fp32_product():
    values, scales = nvfp4(4, 64, torch.Generator().manual_seed(1))
    codes, fp8_scales = formats.nvfp4_to_fp8(values, scales, GLOBAL)
    product = scales.view(torch.float8_e4m3fn).float() * torch.tensor(GLOBAL, dtype=torch.float32)
    assert torch.equal(fp8_scales, product) and not torch.equal(fp8_scales, product.bfloat16().float())
    weights = formats.FP8.dequantize(codes, fp8_scales).double()  # E2M1 x one fp32 product
    assert torch.allclose(weights, decoded(values, scales), rtol=2**-22, atol=0)


@pytest.mark.parametrize("tokens", [1, 40])
def test_nvfp4_from_tensors(tokens):
    weights = expert_weights()
    stacked = [(torch.stack([v for v, _ in p]), torch.stack([s for _, s in p])) for p in weights.values()]
    converted = [formats.nvfp4_to_fp8(values, scales, GLOBAL) for values, scales in stacked]
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="NVFP4")
    scales = dict(zip(("gate_scale", "up_scale", "down_scale"), (s for _, s in converted), strict=True))
    moe.load_weights_from_tensors(*(c for c, _ in converted), **scales)
    x = activations(tokens, HIDDEN, 100)
    ids, topk_weights = routing(tokens, EXPERTS, TOP_K, hot=True)
    error = relative_error(moe.forward(x, ids, topk_weights), reference(exact(weights), x, ids, topk_weights))
    assert error < BOUND, f"relative error {error:.4%}"


def write_modelopt(directory, weights, layer: int = 0, global_scales: list[float] | None = None) -> None:
    tensors = {"model.embed_tokens.weight": torch.zeros(4, HIDDEN, dtype=torch.bfloat16)}
    for name, pairs in weights.items():
        for expert, (values, scales) in enumerate(pairs):
            key = f"model.layers.{layer}.mlp.experts.{expert}.{name}.weight"
            tensors[key] = values
            tensors[key + "_scale"] = scales.view(torch.float8_e4m3fn)
            global_scale = GLOBAL if global_scales is None else global_scales[expert]
            tensors[key + "_scale_2"] = torch.tensor(global_scale, dtype=torch.float32)
            tensors[key.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)  # ignored
    save_file(tensors, str(directory / "model.safetensors"))


def test_nvfp4_checkpoint_as_modelopt_writes_it(tmp_path):
    weights = expert_weights(2)
    write_modelopt(tmp_path, weights)
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="NVFP4", weight_path=str(tmp_path))
    moe.load_weights()
    x = activations(33, HIDDEN, 100)
    ids, topk_weights = routing(33, EXPERTS, TOP_K, hot=True)
    error = relative_error(moe.forward(x, ids, topk_weights), reference(exact(weights), x, ids, topk_weights))
    assert error < BOUND, f"relative error {error:.4%}"


def test_a_bad_nvfp4_scale_is_an_error_naming_it(tmp_path):
    from kt_kernel.safetensors_io import CheckpointError

    weights = expert_weights(3)
    weights["up_proj"][4] = (weights["up_proj"][4][0], weights["up_proj"][4][1][:, :3].contiguous())
    write_modelopt(tmp_path, weights)
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="NVFP4", weight_path=str(tmp_path))
    with pytest.raises(CheckpointError, match=r"experts\.4\.up_proj\.weight_scale"):
        moe.load_weights()


def test_amx_tiles_leave_blocks_of_16_to_the_avx512_kernel():
    skip_unless_cpu_runs("avx512")
    try:
        emulated = importlib.import_module("kt_kernel._kt_kernel_amx_emulated")
    except ModuleNotFoundError:
        pytest.skip("built without -C cmake.define.KT_KERNEL_AMX_EMULATION=ON (see ci/run_tests.sh)")
    values, scales = nvfp4(48, 256, torch.Generator().manual_seed(4))
    codes, fp8_scales = formats.nvfp4_to_fp8(values, scales, GLOBAL)
    x = activations(32, 256, 100)
    ref = x.double() @ decoded(values, scales).T
    for group, tiled in ((16, False), (32, True)):
        s = fp8_scales if group == 16 else fp8_scales.reshape(48, -1, 2)[..., 0].contiguous()
        weight = formats.FP8.dequantize(codes, s).double()
        y = torch.empty(32, 48)
        before = emulated.kernel_info()["emulated_tile_products"]
        emulated.linear("FP8", x.view(torch.int16), codes, s, y)
        assert (emulated.kernel_info()["emulated_tile_products"] > before) == tiled
        expected = ref if group == 16 else x.double() @ weight.T
        assert relative_error(y, expected) < 1e-5, group


@pytest.mark.parametrize(
    "corrupt,words",
    [
        (
            "global scale 0",
            r"experts\.3\.down_proj\.weight_scale_2' holds 0\.0: scales must be finite and positive",
        ),
        ("negative global scale", r"experts\.3\.down_proj\.weight_scale_2' holds -0\.5"),
        (
            "negative block scale",
            r"experts\.3\.down_proj\.weight_scale' holds the block scale -.* at index \[2, 1\]",
        ),
        ("block scale -0", r"experts\.3\.down_proj\.weight_scale' holds the block scale -0\.0 \(code 0x80\)"),
        ("block scale NaN", r"experts\.3\.down_proj\.weight_scale' holds the block scale nan \(code 0x7F\)"),
        (
            "no global scale",
            r"NVFP4 weight '.*experts\.3\.down_proj\.weight' .* lacks its F32 scale '.*_scale_2'",
        ),
    ],
)
def test_corrupt_nvfp4_scales_are_errors_naming_file_key_and_expert(tmp_path, corrupt, words):
    """FP8 and MXFP8 refuse a scale that is not finite and positive: NVFP4's per-tensor scale too, and
    block scales with E4M3's sign bit or NaN code (they loaded silently, 93-158 % off)."""
    from safetensors.torch import load_file

    from kt_kernel.safetensors_io import CheckpointError

    write_modelopt(tmp_path, expert_weights(5))
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    key = "model.layers.0.mlp.experts.3.down_proj.weight"
    block = tensors[key + "_scale"].view(torch.uint8)
    if corrupt == "global scale 0":
        tensors[key + "_scale_2"] = torch.tensor(0.0)
    elif corrupt == "negative global scale":
        tensors[key + "_scale_2"] = torch.tensor(-0.5)
    elif corrupt == "no global scale":
        del tensors[key + "_scale_2"]
    else:
        block[2, 1] = {"negative block scale": block[2, 1] | 0x80, "block scale -0": 0x80}.get(corrupt, 0x7F)
    save_file(tensors, str(file))
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="NVFP4", weight_path=str(tmp_path))
    with pytest.raises(CheckpointError, match=rf"{file}: .*{words}"):
        moe.load_weights()


def file_bytes(pairs) -> int:
    """A projection's bytes in a ModelOpt file: E2M1 pairs, E4M3 block scales, an fp32 per tensor."""
    return sum(values.numel() + scales.numel() + 4 for values, scales in pairs)


def test_nvfp4_is_held_in_at_most_the_files_bytes(tmp_path):
    """4-bit indices, the E4M3 block scales as the file's bytes and one fp32 per matrix (each expert's
    weight_scale_2 its own, none a bf16 number): held <= the file's bytes, per projection and per
    layer, from a checkpoint and from tensors; and still exact."""
    weights = expert_weights(6)
    global_scales = [float(torch.tensor(GLOBAL * (1 + e / 7), dtype=torch.float32)) for e in range(EXPERTS)]
    write_modelopt(tmp_path, weights, global_scales=global_scales)
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="NVFP4", weight_path=str(tmp_path))
    moe.load_weights()
    held = sum(sp.engine.packed_bytes() for sp in moe._subpools)
    told = 0
    for name, pairs in weights.items():
        rows, k = pairs[0][1].shape[0], 2 * pairs[0][0].shape[1]
        projection = held_bytes.nvfp4_bytes(EXPERTS, rows, k)
        assert projection <= file_bytes(pairs), name
        told += projection
    assert held == told <= sum(map(file_bytes, weights.values()))
    assert held <= EXPERTS * 3 * HIDDEN * INTER * (0.5 + 1 / 16) + EXPERTS * 3 * 4  # 0.5625 B/w
    exact_weights = [
        torch.stack([decoded(v, s, global_scales[e]) for e, (v, s) in enumerate(pairs)])
        for pairs in weights.values()
    ]
    x = activations(9, HIDDEN, 100)
    ids, topk_weights = routing(9, EXPERTS, TOP_K, hot=True)
    error = relative_error(moe.forward(x, ids, topk_weights), reference(exact_weights, x, ids, topk_weights))
    assert error < BOUND, f"relative error {error:.4%}"
    stacked = [(torch.stack([v for v, _ in p]), torch.stack([s for _, s in p])) for p in weights.values()]
    global_tensor = torch.tensor(global_scales, dtype=torch.float32)
    converted = [formats.nvfp4_to_fp8(values, scales, global_tensor) for values, scales in stacked]
    from_tensors = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="NVFP4")
    scales = dict(zip(("gate_scale", "up_scale", "down_scale"), (s for _, s in converted), strict=True))
    from_tensors.load_weights_from_tensors(*(c for c, _ in converted), **scales)
    assert sum(sp.engine.packed_bytes() for sp in from_tensors._subpools) == held
    assert torch.equal(from_tensors.forward(x, ids, topk_weights), moe.forward(x, ids, topk_weights))


def test_nvfp4_write_back_gives_the_loaded_tensors():
    """Held as GGUF, written back as loaded: nvfp4_to_fp8's E4M3 codes (-0 as +0, the same weight) and
    fp32 scales, bit for bit."""
    weights = expert_weights(7)
    stacked = [(torch.stack([v for v, _ in p]), torch.stack([s for _, s in p])) for p in weights.values()]
    converted = [formats.nvfp4_to_fp8(values, scales, GLOBAL) for values, scales in stacked]
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="NVFP4")
    scales = dict(zip(("gate_scale", "up_scale", "down_scale"), (s for _, s in converted), strict=True))
    moe.load_weights_from_tensors(*(c for c, _ in converted), **scales)
    assert moe.weight_format == "GGUF"
    sizes = moe.write_buffer_nbytes(1)
    buffers = {name: torch.zeros(size, dtype=torch.uint8) for name, size in sizes.items()}
    expert = 3
    moe.submit_write_weight_scale_to_buffer(
        1,
        expert,
        *([buffers[name].data_ptr()] for name in ("w13_weight", "w13_scale", "w2_weight", "w2_scale")),
    )
    moe.sync_write_weight_scale_to_buffer()
    (gate, gate_s), (up, up_s), (down, down_s) = ((c[expert], s[expert]) for c, s in converted)
    plus_zero = lambda codes: torch.where(codes == 0x80, 0, codes)  # noqa: E731
    assert torch.equal(buffers["w13_weight"], plus_zero(torch.cat([gate, up])).flatten())
    assert torch.equal(buffers["w2_weight"], plus_zero(down).flatten())
    assert torch.equal(buffers["w13_scale"].view(torch.float32), torch.cat([gate_s, up_s]).flatten())
    assert torch.equal(buffers["w2_scale"].view(torch.float32), down_s.flatten())
