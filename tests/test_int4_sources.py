"""INT4 checkpoints as they ship, read by load_weights() bit for bit as this package's INT4:
compressed-tensors "pack-quantized" (Kimi-K2-Thinking, method RAWINT4) and 4-bit GPTQ (GPTQ_INT4),
symmetric or with zero points; what cannot be INT4 (act-order, other bit widths) refused."""

from __future__ import annotations

import json

import pytest
import torch
from test_fp8 import reference, write_model_dir

from kt_kernel import checkpoint, formats, sources

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


def write_layer(
    directory,
    layout: str,
    group: int,
    offset: int = 1,
    act_order: bool = False,
    asymmetric: bool | set[int] = False,
    inter: int = I,
):
    """One layer (0) of experts in `layout` ("packed" or "gptq"); returns the fp64 weights. GPTQ
    zero points: 8 (symmetric) or, with `asymmetric` (every expert, or the experts in the set),
    random stored zeros 0..15 per group."""
    tensors, full = {}, [[], [], []]
    for e in range(E):
        for p, (name, n, k) in enumerate(
            (("gate_proj", inter, H), ("up_proj", inter, H), ("down_proj", H, inter))
        ):
            q, scales = random_int4(n, k, group, 10 * e + p)
            zero = torch.full((k // group, n), 8)
            # Asymmetric: stored values q + 8 (0..15), zero points offset..15 + offset.
            if asymmetric is True or (asymmetric and e in asymmetric):
                zero = (
                    torch.randint(0, 16, (k // group, n), generator=torch.Generator().manual_seed(e)) + offset
                )
                q = q + 8 - zero.T.repeat_interleave(group, dim=1)
            base = f"model.layers.0.mlp.experts.{e}.{name}."
            if layout == "packed":
                tensors[base + "weight_packed"] = pack_along_last(q + 8)
                tensors[base + "weight_scale"] = scales.to(torch.bfloat16)
                tensors[base + "weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
                scales = scales.to(torch.bfloat16)
            else:
                stored = q + zero.T.repeat_interleave(group, dim=1)
                along_k = stored.T.reshape(k // 8, 8, n).permute(0, 2, 1)  # [K/8, N, 8]
                tensors[base + "qweight"] = pack_along_last(along_k)[..., 0]
                tensors[base + "qzeros"] = pack_along_last(zero - offset)
                tensors[base + "scales"] = scales.T.contiguous().to(torch.float16)
                g_idx = torch.arange(k, dtype=torch.int32) // group
                tensors[base + "g_idx"] = g_idx.flip(0) if act_order else g_idx
                scales = scales.to(torch.float16)
            full[p].append(weight(q, scales))
    write_model_dir(directory, tensors)
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True}}
    (directory / "config.json").write_text(json.dumps(config))
    return [torch.stack(f) for f in full]


def mark_gptq_v2(directory) -> None:
    """Declare the checkpoint's zero points stored as they are (checkpoint_format gptq_v2)."""
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (directory / "config.json").write_text(json.dumps(config))


def decoded(tensors: dict[str, torch.Tensor], name: str, group: int) -> torch.Tensor:
    """fp64 weights of canonical INT4 tensors read for projection `name`, with their zero points."""
    nibbles = torch.stack([tensors[name] & 0xF, tensors[name] >> 4], dim=-1).flatten(-2).long()
    q = torch.where(nibbles > 7, nibbles - 16, nibbles)
    assert q.shape[-1] // tensors[f"{name}_scale"].shape[-1] == group
    if f"{name}_zeros" in tensors:
        q = q - tensors[f"{name}_zeros"].long().repeat_interleave(group, dim=-1)
    return q.double() * tensors[f"{name}_scale"].double().repeat_interleave(group, dim=-1)


def assert_forward_matches(directory, method: str, full: list[torch.Tensor], tokens: int, seed: int) -> None:
    """load_weights() of the directory runs within 0.5 % of the fp64 MoE of `full`."""
    moe = moe_wrapper(E, K, H, I, method=method, weight_path=str(directory))
    moe.load_weights()
    prob = make_problem(E, K, H, I, tokens=tokens, seed=seed)
    ref = reference(prob, full)
    out = moe.forward(prob.hidden, prob.ids, prob.weights)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.005


@pytest.mark.parametrize(
    "layout,method,group", [("packed", "RAWINT4", 32), ("gptq", "GPTQ_INT4", 128), ("gptq", "INT4", 32)]
)
def test_int4_checkpoints_load_bit_for_bit(tmp_path, layout, method, group):
    full = write_layer(tmp_path / "model", layout, group)
    tensors = checkpoint.read_layer(tmp_path / "model", 0, E, method)
    for p, name in enumerate(("gate", "up", "down")):
        assert torch.equal(decoded(tensors, name, group), full[p])
    assert_forward_matches(tmp_path / "model", method, full, tokens=5, seed=1)


def test_gptq_v2_zero_points_are_stored_as_they_are(tmp_path):
    full = write_layer(tmp_path / "model", "gptq", 64, offset=0)
    mark_gptq_v2(tmp_path / "model")
    tensors = checkpoint.read_layer(tmp_path / "model", 0, E, "GPTQ_INT4")
    assert tensors["gate_scale"].shape == (E, I, H // 64)
    assert_forward_matches(tmp_path / "model", "GPTQ_INT4", full, tokens=3, seed=2)


@pytest.mark.parametrize("group,offset", [(32, 1), (128, 0)])
def test_asymmetric_gptq_runs_with_its_zero_points(tmp_path, group, offset):
    """Zero points other than 8 (and 0 or 16, the ends of the range) stay exact: the engine
    subtracts them per group instead of 8."""
    full = write_layer(tmp_path / "model", "gptq", group, offset=offset, asymmetric=True)
    if offset == 0:
        mark_gptq_v2(tmp_path / "model")
    tensors = checkpoint.read_layer(tmp_path / "model", 0, E, "GPTQ_INT4")
    for p, name in enumerate(("gate", "up", "down")):
        assert f"{name}_zeros" in tensors
        assert torch.equal(decoded(tensors, name, group), full[p])
    assert_forward_matches(tmp_path / "model", "GPTQ_INT4", full, tokens=7, seed=4)
    moe = moe_wrapper(E, K, H, I, method="GPTQ_INT4", weight_path=str(tmp_path / "model"))
    moe.load_weights()
    with pytest.raises(NotImplementedError, match="zero points"):  # would lose them
        moe.submit_write_weight_scale_to_buffer(1, 0, [0], [0], [0], [0])


def test_symmetric_gptq_loads_without_zero_points(tmp_path):
    write_layer(tmp_path / "model", "gptq", 64)
    tensors = checkpoint.read_layer(tmp_path / "model", 0, E, "GPTQ_INT4")
    assert not any(name.endswith("_zeros") for name in tensors)


def test_what_is_not_int4_is_refused(tmp_path):
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


def test_the_format_registry_says_what_a_source_directory_is_read_in(tmp_path):
    """A format without source_dtypes is read from converted checkpoints only (refused before the
    directory is looked at); a layer's dtypes mean the quantized format they belong to, else BF16."""
    for fmt in formats.FORMATS.values():
        if not fmt.source_dtypes:
            with pytest.raises(NotImplementedError, match="read from converted checkpoints"):
                sources.read_source_layer(tmp_path / "absent", 0, E, fmt)
    assert sources.stored_format(frozenset({"BF16", "F32"})) is formats.BF16
    assert sources.stored_format(frozenset({"I4", "BF16"})) is formats.INT4
    assert sources.stored_format(frozenset({"F8_E4M3", "F16"})) is formats.FP8


@pytest.mark.parametrize("layout,asymmetric", [("packed", False), ("gptq", False), ("gptq", True)])
def test_convert_reads_int4_sources(tmp_path, layout, asymmetric):
    from kt_kernel import convert

    full = write_layer(tmp_path / "model", layout, 32, asymmetric=asymmetric)
    convert.convert_checkpoint(tmp_path / "model", tmp_path / "out", "BF16", progress=False)
    moe = moe_wrapper(E, K, H, I, method="BF16", weight_path=str(tmp_path / "out"))
    moe.load_weights()
    prob = make_problem(E, K, H, I, tokens=4, seed=3)
    ref = reference(prob, full)
    assert (
        (moe.forward(prob.hidden, prob.ids, prob.weights).double() - ref).norm() / ref.norm()
    ).item() < 0.01


def test_zero_points_through_subpools_and_bad_zero_points(tmp_path):
    """Zero points given to load_weights_from_tensors split with the intermediate dimension like the
    scales (threadpool_count = 2 is as exact as 1); bad ones are errors naming the tensor."""
    inter = 256  # two subpools cut at a multiple of 128
    full = write_layer(tmp_path / "model", "gptq", 32, asymmetric=True, inter=inter)
    tensors = checkpoint.read_layer(tmp_path / "model", 0, E, "GPTQ_INT4")
    prob = make_problem(E, K, H, inter, tokens=6, seed=5)
    outs = []
    for pools in (1, 2):
        moe = moe_wrapper(E, K, H, inter, method="GPTQ_INT4", threadpool_count=pools)
        moe.load_weights_from_tensors(
            tensors["gate"], tensors["up"], tensors["down"], **{k: v for k, v in tensors.items() if "_" in k}
        )
        outs.append(moe.forward(prob.hidden, prob.ids, prob.weights))
    ref = reference(prob, full)
    for out in outs:
        assert ((out.double() - ref).norm() / ref.norm()).item() < 0.005

    scales = {k: v for k, v in tensors.items() if k.endswith("_scale")}
    moe = moe_wrapper(E, K, H, inter, method="INT4")
    args = (tensors["gate"], tensors["up"], tensors["down"])
    too_big = tensors["down_zeros"].clone()
    too_big[0, 0, 0] = 9
    with pytest.raises(ValueError, match="down_zeros must lie in -8..8"):
        moe.load_weights_from_tensors(*args, **scales, down_zeros=too_big)
    with pytest.raises(ValueError, match="gate_zeros must have shape"):
        moe.load_weights_from_tensors(*args, **scales, gate_zeros=tensors["gate_zeros"][:, :, :1])
    with pytest.raises(TypeError, match="up_zeros must be an integer tensor"):
        moe.load_weights_from_tensors(*args, **scales, up_zeros=tensors["up_zeros"].float())
    with pytest.raises(ValueError, match="go with scales"):
        moe.load_weights_from_tensors(*args, gate_zeros=tensors["gate_zeros"])
    int8 = moe_wrapper(E, K, H, I, method="INT8")
    q = torch.zeros(E, I, H, dtype=torch.int8)
    with pytest.raises(ValueError, match="INT8 takes no zero points"):
        int8.load_weights_from_tensors(
            q, q, torch.zeros(E, H, I, dtype=torch.int8), gate_scale=torch.ones(E, I),
            up_scale=torch.ones(E, I), down_scale=torch.ones(E, H),
            gate_zeros=torch.zeros(E, I, dtype=torch.int8),
        )  # fmt: skip


@pytest.mark.parametrize(
    "bad",
    [
        lambda z: torch.cat([z, z]),  # twice the rows
        lambda z: z.T.contiguous(),  # transposed
        lambda z: z.view(torch.float32),  # F32 bits
    ],
    ids=["twice-the-rows", "transposed", "f32"],
)
def test_gptq_zero_points_of_the_wrong_shape_or_dtype_are_refused(tmp_path, bad):
    from safetensors.torch import load_file, save_file

    write_layer(tmp_path / "model", "gptq", 32, asymmetric=True)
    file = tmp_path / "model" / "model.safetensors"
    tensors = load_file(str(file))
    key = "model.layers.0.mlp.experts.1.up_proj.qzeros"
    tensors[key] = bad(tensors[key])
    save_file(tensors, str(file))
    moe = moe_wrapper(E, K, H, I, method="GPTQ_INT4", weight_path=str(tmp_path / "model"))
    with pytest.raises(ValueError, match=rf"{key}: .* expected int32 \[8, 16\]"):
        moe.load_weights()


@pytest.mark.parametrize("layout", ["packed", "gptq"])
def test_an_expert_of_another_group_size_is_an_error_naming_its_scales(tmp_path, layout):
    """The experts of a layer are stacked into one tensor: one expert's group size differing (its
    own scales well formed) was torch's "The expanded size of the tensor ... must match"."""
    from safetensors.torch import load_file, save_file

    write_layer(tmp_path / "model", layout, 32)
    other = tmp_path / "other"
    write_layer(other, layout, 64)
    file = tmp_path / "model" / "model.safetensors"
    tensors, others = load_file(str(file)), load_file(str(other / "model.safetensors"))
    base = "model.layers.0.mlp.experts.2.up_proj."
    for name in others:
        if name.startswith(base):
            tensors[name] = others[name]  # expert 2's up_proj in groups of 64
    save_file(tensors, str(file))
    scales = base + ("weight_scale" if layout == "packed" else "scales")
    with pytest.raises(
        sources.CheckpointError, match=rf"{file}: tensor '{scales}' has shape .* one group size"
    ):
        checkpoint.read_layer(tmp_path / "model", 0, E, "RAWINT4" if layout == "packed" else "GPTQ_INT4")
