"""INT4 checkpoints as they ship, read by load_weights() bit for bit as this package's INT4:
compressed-tensors "pack-quantized" (Kimi-K2-Thinking, method RAWINT4) and symmetric 4-bit GPTQ
(GPTQ_INT4); what cannot be INT4 (asymmetric GPTQ, act-order, other bit widths) refused."""

from __future__ import annotations

import json

import pytest
import torch
from test_fp8 import reference, write_model_dir

from kt_kernel import checkpoint

from moe_reference import make_problem, moe_wrapper

E, K, H, I = 4, 2, 256, 128


def random_int4(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q in -8..7 [N, K] and positive scales [N, K/G]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g)
    return q, torch.rand(n, k // group, generator=g) * 1e-2 + 1e-3


def weight(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.double() * scales.double().repeat_interleave(q.shape[1] // scales.shape[1], dim=1)


def pack_along_last(values: torch.Tensor) -> torch.Tensor:
    """Eight 4-bit values (0..15) per int32 along the last dimension, low bits first."""
    v = values.reshape(*values.shape[:-1], -1, 8).to(torch.int64)
    words = sum(v[..., j] << (4 * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_layer(directory, layout: str, group: int, zero: int = 8, offset: int = 1, act_order: bool = False):
    """One layer (0) of experts in `layout` ("packed" or "gptq"); returns the fp64 weights."""
    tensors, full = {}, [[], [], []]
    for e in range(E):
        for p, (name, n, k) in enumerate((("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I))):
            q, scales = random_int4(n, k, group, 10 * e + p)
            base = f"model.layers.0.mlp.experts.{e}.{name}."
            if layout == "packed":
                tensors[base + "weight_packed"] = pack_along_last(q + 8)
                tensors[base + "weight_scale"] = scales.to(torch.bfloat16)
                tensors[base + "weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
                scales = scales.to(torch.bfloat16)
            else:
                along_k = (q + zero).T.reshape(k // 8, 8, n).permute(0, 2, 1)  # [K/8, N, 8]
                tensors[base + "qweight"] = pack_along_last(along_k)[..., 0]
                zeros = torch.full((k // group, n), zero - offset)
                tensors[base + "qzeros"] = pack_along_last(zeros)
                tensors[base + "scales"] = scales.T.contiguous().to(torch.float16)
                g_idx = torch.arange(k, dtype=torch.int32) // group
                tensors[base + "g_idx"] = g_idx.flip(0) if act_order else g_idx
                scales = scales.to(torch.float16)
            full[p].append(weight(q, scales))
    write_model_dir(directory, tensors)
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True}}
    (directory / "config.json").write_text(json.dumps(config))
    return [torch.stack(f) for f in full]


@pytest.mark.parametrize(
    "layout,method,group", [("packed", "RAWINT4", 32), ("gptq", "GPTQ_INT4", 128), ("gptq", "INT4", 32)]
)
def test_int4_checkpoints_load_bit_for_bit(tmp_path, layout, method, group):
    full = write_layer(tmp_path / "model", layout, group)
    tensors = checkpoint.read_layer(tmp_path / "model", 0, E, method)
    for p, name in enumerate(("gate", "up", "down")):
        nibbles = torch.stack([tensors[name] & 0xF, tensors[name] >> 4], dim=-1).flatten(-2).long()
        q = torch.where(nibbles > 7, nibbles - 16, nibbles)
        group_of = q.shape[-1] // tensors[f"{name}_scale"].shape[-1]
        assert group_of == group
        decoded = q.double() * tensors[f"{name}_scale"].double().repeat_interleave(group, dim=-1)
        assert torch.equal(decoded, full[p])
    moe = moe_wrapper(E, K, H, I, method=method, weight_path=str(tmp_path / "model"))
    moe.load_weights()
    prob = make_problem(E, K, H, I, tokens=5, seed=1)
    ref = reference(prob, full)
    out = moe.forward(prob.hidden, prob.ids, prob.weights)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.005


def test_gptq_v2_zero_points_are_stored_as_they_are(tmp_path):
    full = write_layer(tmp_path / "model", "gptq", 64, offset=0)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    tensors = checkpoint.read_layer(tmp_path / "model", 0, E, "GPTQ_INT4")
    assert tensors["gate_scale"].shape == (E, I, H // 64)
    moe = moe_wrapper(E, K, H, I, method="GPTQ_INT4", weight_path=str(tmp_path / "model"))
    moe.load_weights()
    prob = make_problem(E, K, H, I, tokens=3, seed=2)
    ref = reference(prob, full)
    assert (
        (moe.forward(prob.hidden, prob.ids, prob.weights).double() - ref).norm() / ref.norm()
    ).item() < 0.005


def test_what_is_not_int4_is_refused(tmp_path):
    write_layer(tmp_path / "asym", "gptq", 32, zero=9)
    with pytest.raises(NotImplementedError, match="asymmetric GPTQ"):
        checkpoint.read_layer(tmp_path / "asym", 0, E, "GPTQ_INT4")
    write_layer(tmp_path / "bits", "gptq", 32)
    config = {"quantization_config": {"quant_method": "gptq", "bits": 8}}
    (tmp_path / "bits" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only 4-bit GPTQ"):
        checkpoint.read_layer(tmp_path / "bits", 0, E, "GPTQ_INT4")
    write_layer(tmp_path / "act", "gptq", 32, act_order=True)
    with pytest.raises(NotImplementedError, match="act-order"):
        checkpoint.read_layer(tmp_path / "act", 0, E, "GPTQ_INT4")
    write_layer(tmp_path / "packed", "packed", 32)
    with pytest.raises(ValueError, match="holds INT4 experts .*not FP8"):
        checkpoint.read_layer(tmp_path / "packed", 0, E, "FP8")


@pytest.mark.parametrize("layout", ["packed", "gptq"])
def test_convert_reads_int4_sources(tmp_path, layout):
    from kt_kernel import convert

    full = write_layer(tmp_path / "model", layout, 32)
    convert.convert_checkpoint(tmp_path / "model", tmp_path / "out", "BF16", progress=False)
    moe = moe_wrapper(E, K, H, I, method="BF16", weight_path=str(tmp_path / "out"))
    moe.load_weights()
    prob = make_problem(E, K, H, I, tokens=4, seed=3)
    ref = reference(prob, full)
    assert (
        (moe.forward(prob.hidden, prob.ids, prob.weights).double() - ref).norm() / ref.norm()
    ).item() < 0.01
