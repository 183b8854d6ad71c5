"""FP8 weights as checkpoints ship them: DeepSeek's scales per 128 x 128 block, per-channel scales
(FP8_PERCHANNEL), codes as uint8 or float8_e4m3fn; bad input refused with the tensor named."""

from __future__ import annotations

import pytest
import torch

from kt_kernel import formats

from moe_reference import make_problem, moe_wrapper

E, K, H, I = 4, 2, 256, 384


def fp8_codes(experts: int, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, n, k, generator=g) * 40).to(torch.float8_e4m3fn)


def reference(p, weights) -> torch.Tensor:
    """fp64 MoE of the decoded weights (gate, up [E, I, H], down [E, H, I])."""
    gate, up, down = weights
    x = p.hidden.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(p.ids.shape[1]):
            e = int(p.ids[t, k])
            act = torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t])
            out[t] += float(p.weights[t, k]) * (down[e] @ act)
    return out


def block_scales(experts: int, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(experts, -(-n // 128), k // 128, generator=g) * 1e-3 + 1e-4


def expand(scales: torch.Tensor, n: int) -> torch.Tensor:
    """[E, N/128, K/128] -> [E, N, K] by repeating each scale over its block."""
    return scales.repeat_interleave(128, dim=1)[:, :n].repeat_interleave(128, dim=2).double()


@pytest.mark.parametrize("method", ["FP8", "FP8_PERCHANNEL"])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("as_uint8", [False, True])
def test_forward_on_stored_codes_and_scales(method, per_channel, as_uint8):
    p = make_problem(E, K, H, I, tokens=9, seed=3)
    codes = [fp8_codes(E, I, H, 1), fp8_codes(E, I, H, 2), fp8_codes(E, H, I, 3)]
    if per_channel:
        scales = [torch.rand(c.shape[:2]) * 1e-3 + 1e-4 for c in codes]  # [E, N]
        full = [c.double() * s.double()[..., None] for c, s in zip(codes, scales, strict=True)]
    else:
        scales = [block_scales(E, c.shape[1], c.shape[2], i) for i, c in enumerate(codes)]
        full = [c.double() * expand(s, c.shape[1]) for c, s in zip(codes, scales, strict=True)]
    given = [c.view(torch.uint8) if as_uint8 else c for c in codes]
    moe = moe_wrapper(E, K, H, I, method=method)
    moe.load_weights_from_tensors(*given, gate_scale=scales[0], up_scale=scales[1], down_scale=scales[2])
    out = moe.forward(p.hidden, p.ids, p.weights)
    ref = reference(p, full)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.005


def test_quantize_round_trips_through_the_codes():
    w = torch.randn(256, 384) * 0.02
    codes, scales = formats.FP8.quantize(w)
    assert codes.dtype == torch.uint8 and scales.shape == (256, 3)
    back = formats.FP8.dequantize(codes, scales)
    assert ((back - w).norm() / w.norm()).item() < 0.05  # E4M3 keeps 3 mantissa bits
    assert torch.equal(formats.FP8.quantize(back)[0], codes)  # decoded values quantize to themselves


@pytest.mark.parametrize(
    "where,code,match",
    [((0, 0, 5), 0x7F, r"gate_proj holds an FP8 NaN code.*\[0, 0, 5\]"), ((1, 2, 3), 0xFF, "FP8 NaN code")],
)
def test_nan_codes_are_refused(where, code, match):
    codes = [fp8_codes(E, I, H, 1).view(torch.uint8).clone(), fp8_codes(E, I, H, 2), fp8_codes(E, H, I, 3)]
    codes[0][where] = code
    moe = moe_wrapper(E, K, H, I, method="FP8")
    scales = {
        f"{n}_scale": torch.ones(c.shape[:2]) for n, c in zip(("gate", "up", "down"), codes, strict=True)
    }
    with pytest.raises(ValueError, match=match):
        moe.load_weights_from_tensors(*codes, **scales)


@pytest.mark.parametrize(
    "scale,match",
    [
        (torch.ones(E, I, 3), r"gate_scale must have shape \[4, 384\] \(per channel\)"),
        (torch.full((E, 3, 2), float("nan")), "gate_scale holds a non-finite scale"),
        (torch.ones(E, 3, 2, dtype=torch.float64), "gate_scale must be float32 or bfloat16"),
    ],
)
def test_bad_scales_are_refused(scale, match):
    codes = [fp8_codes(E, I, H, 1), fp8_codes(E, I, H, 2), fp8_codes(E, H, I, 3)]
    moe = moe_wrapper(E, K, H, I, method="FP8")
    with pytest.raises((ValueError, TypeError), match=match):
        moe.load_weights_from_tensors(
            *codes, gate_scale=scale, up_scale=torch.ones(E, I), down_scale=torch.ones(E, H)
        )


# ---- Hugging Face model directories as they ship -----------------------------------------------
def write_model_dir(directory, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """safetensors files of ``tensors``, with a model.safetensors.index.json when sharded."""
    import json

    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = {name: tensors[name].contiguous() for name in names[shard::shards]}
        save_file(part, str(directory / file))
        weight_map |= dict.fromkeys(part, file)
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def expert_tensors(prefix: str, layer: int, per_channel: bool, seed: int) -> tuple[dict, list]:
    """One layer's FP8 experts in DeepSeek's naming (or compressed-tensors' per-channel scales),
    and the fp64 weights they hold."""
    tensors, full = {}, [[], [], []]
    for e in range(E):
        for p, (name, n, k) in enumerate((("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I))):
            codes = fp8_codes(1, n, k, seed + 10 * e + p)[0]
            key = f"{prefix}layers.{layer}.mlp.experts.{e}.{name}.weight"
            tensors[key] = codes
            if per_channel:
                scale = torch.rand(n, 1) * 1e-3 + 1e-4
                tensors[key + "_scale"] = scale
                full[p].append(codes.double() * scale.double())
            else:
                scale = block_scales(1, n, k, seed + e + p)[0]
                tensors[key + "_scale_inv"] = scale
                full[p].append(codes.double() * expand(scale[None], n)[0])
    return tensors, [torch.stack(f) for f in full]


@pytest.mark.parametrize(
    "prefix,shards,per_channel", [("model.", 1, False), ("", 3, True), ("language_model.model.", 2, False)]
)
def test_load_weights_from_a_model_directory(tmp_path, prefix, shards, per_channel):
    tensors, full = expert_tensors(prefix, 1, per_channel, seed=5)
    other, _ = expert_tensors(prefix, 0, per_channel, seed=50)  # another layer, not read
    write_model_dir(tmp_path / "model", tensors | other, shards)
    method = "FP8_PERCHANNEL" if per_channel else "FP8"
    moe = moe_wrapper(E, K, H, I, method=method, layer_idx=1, weight_path=str(tmp_path / "model"))
    moe.load_weights()
    p = make_problem(E, K, H, I, tokens=5, seed=6)
    ref = reference(p, full)
    out = moe.forward(p.hidden, p.ids, p.weights)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.005


def test_a_bf16_model_directory_loads_as_bf16_and_not_as_fp8(tmp_path):
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for e in range(E):
        for name, n, k in (("w1", I, H), ("w3", I, H), ("w2", H, I)):
            tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{name}.weight"] = (
                torch.randn(n, k, generator=g) / k**0.5
            ).to(torch.bfloat16)
    write_model_dir(tmp_path / "model", tensors)
    p = make_problem(E, K, H, I, tokens=3, seed=8)
    bf16 = moe_wrapper(E, K, H, I, method="BF16", weight_path=str(tmp_path / "model"))
    bf16.load_weights()
    full = [
        torch.stack(
            [tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{n}.weight"].double() for e in range(E)]
        )
        for n in ("w1", "w3", "w2")
    ]
    ref = reference(p, full)
    out = bf16.forward(p.hidden, p.ids, p.weights)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.005
    fp8 = moe_wrapper(E, K, H, I, method="FP8", weight_path=str(tmp_path / "model"))
    with pytest.raises(ValueError, match="holds BF16 experts .*not FP8"):
        fp8.load_weights()
