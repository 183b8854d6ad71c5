"""`kt-kernel convert`: Hugging Face expert checkpoints -> converted layers, loaded by load_weights()."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kt_kernel import checkpoint, convert, formats, quant
from kt_kernel.__main__ import main
from kt_kernel.safetensors_io import CheckpointError

from moe_reference import MoEProblem, assert_close_to_reference, make_problem, moe_wrapper, reference_forward

E, K, H, I = 4, 2, 160, 96  # 160 and 96 are not multiples of the 128 of FP8 blocks
MOE_LAYERS = (1, 2)  # layer 0 is dense, as in DeepSeek
FP8_MAX = 448.0
MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}
NAMINGS = ("deepseek", "mixtral", "fused")
DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
FORMATS = list(formats.FORMATS)  # every registered format


def dead_pid() -> int:
    """The pid of a process that has exited (a converter killed while writing)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(child.stdout)


def fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with one scale per 128x128 block (the block's largest magnitude maps to 448)."""
    n, k = weight.shape
    values = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(n / 128), math.ceil(k / 128))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            scales[i, j] = block.abs().max() / FP8_MAX
            values[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / scales[i, j]).to(values.dtype)
    return values, scales


def fp8_reference(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Block by block: value * the scale of its 128x128 block."""
    out = torch.empty(values.shape)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            out[rows, cols] = values[rows, cols].float() * scales[i, j]
    return out


def stored(
    weight: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(tensor as stored, its FP8 scales or None, the float32 weight it means)."""
    if dtype == torch.float8_e4m3fn:
        values, scales = fp8_blocks(weight)
        return values, scales, fp8_reference(values, scales)
    values = weight.to(dtype).contiguous()
    return values, None, values.float()


def write_model(directory: Path, naming: str, dtype: torch.dtype, shards: int = 1) -> dict[int, MoEProblem]:
    """A small checkpoint with MoE layers MOE_LAYERS (plus tensors the converter must ignore);
    returns each layer's problem holding the float weights the checkpoint means."""
    named = {
        "model.embed_tokens.weight": torch.randn(8, H),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(I, H),
    }
    problems = {}
    for layer in MOE_LAYERS:
        p = make_problem(E, K, H, I, tokens=7, seed=10 + layer)
        prefix = f"model.layers.{layer}."
        named[prefix + "mlp.shared_experts.gate_proj.weight"] = torch.randn(I, H).to(torch.bfloat16)
        named[prefix + "mlp.gate.weight"] = torch.randn(E, H).to(torch.bfloat16)
        for name in ("gate", "up", "down"):
            means = []
            for e in range(E):
                values, scales, meaning = stored(getattr(p, name)[e], dtype)
                means.append(meaning)
                if naming == "fused":
                    continue
                key = prefix + (
                    f"mlp.experts.{e}.{name}_proj.weight"
                    if naming == "deepseek"
                    else f"block_sparse_moe.experts.{e}.{MIXTRAL[name]}.weight"
                )
                named[key] = values
                if scales is not None:
                    named[key + "_scale_inv"] = scales
            setattr(p, name, torch.stack(means))
        if naming == "fused":  # transformers v5 / Qwen3.5: gate_up [E, 2I, H] (gate first), down [E, H, I]
            text = f"model.language_model.layers.{layer}.mlp.experts."
            named[text + "gate_up_proj"] = torch.cat([p.gate, p.up], dim=1).to(dtype)
            named[text + "down_proj"] = p.down.to(dtype)
        problems[layer] = p
    directory.mkdir(parents=True)
    keys = sorted(named)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: named[k] for k in keys[shard::shards]}, str(directory / file))
        weight_map.update({k: file for k in keys[shard::shards]})
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return problems


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One source checkpoint per (naming, dtype), written once for the module."""
    cache = {}

    def get(naming: str, dtype: torch.dtype):
        if (naming, dtype) not in cache:
            directory = tmp_path_factory.mktemp("model") / f"{naming}-{str(dtype)[6:]}"
            cache[naming, dtype] = directory, write_model(directory, naming, dtype)
        return cache[naming, dtype]

    return get


def quantized_on_load(p: MoEProblem, fmt: str, layer: int = 0) -> torch.Tensor:
    """The forward of a wrapper given p's float weights (quantized on load: the same quant.quantize)."""
    moe = moe_wrapper(E, K, H, I, layer_idx=layer, method=fmt)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    return moe.forward(p.hidden, p.ids, p.weights)


# Fused FP8 experts are refused (test_fused_fp8_is_refused), so that pair is not a case here.
SOURCES = [
    pytest.param(naming, dtype, id=f"{naming}-{str(dtype)[6:]}")
    for naming in NAMINGS
    for dtype in DTYPES
    if not (naming == "fused" and dtype == torch.float8_e4m3fn)
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("naming", "dtype"), SOURCES)
def test_converted_forward_matches_source_weights(tmp_path, models, naming, dtype, fmt):
    source, problems = models(naming, dtype)
    manifest = convert.convert_checkpoint(source, tmp_path / "out", fmt, progress=False)
    assert sorted(manifest["layers"]) == ["1", "2"] and manifest["format"] == fmt
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        ".kt_manifest.lock", "kt_manifest.json", "layer_001.safetensors", "layer_002.safetensors",
    ]  # fmt: skip
    for layer, p in problems.items():
        moe = moe_wrapper(E, K, H, I, layer_idx=layer, weight_path=str(tmp_path / "out"), method=fmt)
        moe.load_weights()
        out = moe.forward(p.hidden, p.ids, p.weights)
        # The converted file loads exactly what quantizing the source's weights on load gives ...
        assert torch.equal(out, quantized_on_load(p, fmt, layer))
        # ... which is within the format's error (weights, and activations for INT) of the float model.
        exact = reference_forward(p)
        if fmt == "BF16":
            assert_close_to_reference(out, exact)
        else:
            rel = ((out.double() - exact).norm() / exact.norm()).item()
            assert rel < {"INT8": 0.05, "INT4": 0.25, "MXFP4": 0.3, "FP8": 0.1, "GGUF": 0.05}[fmt], rel


@pytest.mark.parametrize("fmt", ["BF16", "MXFP4", "INT8", "INT4"])
def test_converted_tensors_are_the_quantized_source(tmp_path, models, fmt):
    """Engine-free: every converted tensor equals quant.quantize of the weight the source means."""
    source, problems = models("deepseek", torch.float8_e4m3fn)
    group = 32 if fmt == "INT4" else None
    convert.convert_checkpoint(source, tmp_path / "out", fmt, group_size=group, progress=False)
    manifest = json.loads((tmp_path / "out" / "kt_manifest.json").read_text())
    assert manifest["source_dtype"] == "F8_E4M3"  # the expert tensors only
    assert manifest["layers"]["2"] == {
        "file": "layer_002.safetensors",
        "experts": E,
        "hidden": H,
        "intermediate": I,
    }
    assert manifest.get("group_size") == group and manifest["kt_kernel_version"]
    alias = {"INT8": "AMXINT8", "INT4": "AMXINT4"}.get(fmt, fmt)
    tensors = checkpoint.read_converted_layer(tmp_path / "out", 2, E, alias)
    assert sorted(tensors) == sorted(
        ["gate", "up", "down"] + ([] if fmt == "BF16" else ["gate_scale", "up_scale", "down_scale"])
    )
    for name in ("gate", "up", "down"):
        for e in range(E):
            values, scales = quant.quantize(fmt, getattr(problems[2], name)[e], group)
            assert torch.equal(tensors[name][e], values)
            if scales is not None:
                assert torch.equal(tensors[f"{name}_scale"][e], scales)
    assert checkpoint.read_converted_layer(tmp_path / "out", 1, 2, fmt)["down"].shape[0] == 2  # a prefix


@pytest.mark.parametrize(("fmt", "group"), [("FP8", 16), ("FP8", 32), ("GGUF", 16)])
def test_group_sizes_of_the_formats_that_offer_them(tmp_path, models, fmt, group):
    """--group-size 16 / 32 for FP8 (NVFP4's and MXFP8's blocks) and GGUF: the quantized source."""
    source, problems = models("deepseek", torch.bfloat16)
    convert.convert_checkpoint(source, tmp_path / "out", fmt, group_size=group, progress=False)
    assert json.loads((tmp_path / "out" / "kt_manifest.json").read_text())["group_size"] == group
    p = problems[1]
    tensors = checkpoint.read_converted_layer(tmp_path / "out", 1, E, fmt)
    quantized = {name: quant.quantize(fmt, getattr(p, name), group) for name in ("gate", "up", "down")}
    for name, (values, scales) in quantized.items():
        assert torch.equal(tensors[name], values) and torch.equal(tensors[f"{name}_scale"], scales)
    moe = moe_wrapper(E, K, H, I, layer_idx=1, weight_path=str(tmp_path / "out"), method=fmt)
    moe.load_weights()
    reference = moe_wrapper(E, K, H, I, method=fmt)
    reference.load_weights_from_tensors(
        *(values for values, _ in quantized.values()),
        **{f"{name}_scale": scales for name, (_, scales) in quantized.items()},
    )
    assert torch.equal(moe.forward(p.hidden, p.ids, p.weights), reference.forward(p.hidden, p.ids, p.weights))


def test_fp8_sources_are_copied_to_fp8_as_they_are(tmp_path):
    """H and I multiples of 128: the codes bit for bit, each block scale on the rows it covers."""
    hidden, inter = 256, 384
    g = torch.Generator().manual_seed(4)
    named, stored_codes = {}, {}
    for e in range(E):
        for name, n, k in (
            ("gate_proj", inter, hidden),
            ("up_proj", inter, hidden),
            ("down_proj", hidden, inter),
        ):
            values, scales = fp8_blocks(torch.randn(n, k, generator=g) / k**0.5)
            key = f"model.layers.1.mlp.experts.{e}.{name}.weight"
            named[key], named[key + "_scale_inv"] = values, scales
            stored_codes[key] = values.view(torch.uint8), scales.repeat_interleave(128, dim=0)[:n]
    (tmp_path / "src").mkdir()
    save_file(named, str(tmp_path / "src" / "model.safetensors"))
    convert.convert_checkpoint(tmp_path / "src", tmp_path / "out", "FP8", progress=False)
    tensors = checkpoint.read_converted_layer(tmp_path / "out", 1, E, "FP8")
    for name in ("gate", "up", "down"):
        for e in range(E):
            codes, scales = stored_codes[f"model.layers.1.mlp.experts.{e}.{name}_proj.weight"]
            assert torch.equal(tensors[name][e], codes)
            assert torch.equal(tensors[f"{name}_scale"][e], scales)


def test_fp8_block_dequantization_matches_reference():
    g = torch.Generator().manual_seed(3)
    values = (torch.randn(300, 200, generator=g) * 100).to(torch.float8_e4m3fn)
    scales = torch.rand(3, 2, generator=g) + 0.01
    assert torch.equal(convert.dequantize_fp8_blocks(values, scales), fp8_reference(values, scales))


def test_resume_after_an_interrupted_run(tmp_path, models, monkeypatch):
    source, problems = models("mixtral", torch.bfloat16)
    out = tmp_path / "out"
    real_write = convert.write_safetensors

    def crash_while_writing_layer_2(tensors, path, metadata):
        if "layer_002" in path.name:
            path.write_bytes(b"half a file")
            raise KeyboardInterrupt
        real_write(tensors, path, metadata)

    monkeypatch.setattr(convert, "write_safetensors", crash_while_writing_layer_2)
    with pytest.raises(KeyboardInterrupt):
        convert.convert_checkpoint(source, out, "MXFP4", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        ".kt_manifest.lock",
        "kt_manifest.json",
        "layer_001.safetensors",
    ]
    assert list(json.loads((out / "kt_manifest.json").read_text())["layers"]) == ["1"]
    with pytest.raises(CheckpointError, match="layer 2 is not in the converted checkpoint"):
        checkpoint.read_converted_layer(out, 2, E, "MXFP4")
    monkeypatch.undo()

    (out / f".layer_002.safetensors.{dead_pid()}.tmp").write_bytes(b"left by a killed run")
    done_before = (out / "layer_001.safetensors").stat().st_mtime_ns
    converted = []
    real_convert = convert._convert_layer
    monkeypatch.setattr(
        convert,
        "_convert_layer",
        lambda s, layer, *a: converted.append(layer.index) or real_convert(s, layer, *a),
    )
    convert.convert_checkpoint(source, out, "MXFP4", resume=True, progress=False)
    assert converted == [2] and (out / "layer_001.safetensors").stat().st_mtime_ns == done_before
    assert sorted(p.name for p in out.iterdir()) == [
        ".kt_manifest.lock",
        "kt_manifest.json",
        "layer_001.safetensors",
        "layer_002.safetensors",
    ]

    # A listed layer whose file is damaged is converted again.
    (out / "layer_001.safetensors").write_bytes(b"damaged")
    convert.convert_checkpoint(source, out, "MXFP4", resume=True, progress=False)
    assert converted == [2, 1]
    for layer, p in problems.items():
        moe = moe_wrapper(E, K, H, I, layer_idx=layer, weight_path=str(out), method="MXFP4")
        moe.load_weights()
        assert torch.equal(moe.forward(p.hidden, p.ids, p.weights), quantized_on_load(p, "MXFP4"))


def test_cli_layers_subset_resume_and_format_clash(tmp_path, models, capsys):
    source, problems = models("deepseek", torch.float16)
    out = tmp_path / "out"
    assert main(["convert", str(source), str(out), "--format", "bf16", "--layers", "2"]) == 0
    assert list(json.loads((out / "kt_manifest.json").read_text())["layers"]) == ["2"]
    assert "layer 1/1 (L2)" in capsys.readouterr().err
    assert main(["convert", str(source), str(out), "--format", "bf16", "--layers", "1-2", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "(L1): 4 experts in" in err and "(L2): already converted, skipped" in err
    moe = moe_wrapper(E, K, H, I, layer_idx=1, weight_path=str(out), method="BF16")
    moe.load_weights()
    p = problems[1]
    assert_close_to_reference(moe.forward(p.hidden, p.ids, p.weights), reference_forward(p))

    assert main(["convert", str(source), str(out), "--format", "mxfp4", "--resume"]) == 1
    assert "already holds BF16 weights" in capsys.readouterr().err
    assert main(["convert", str(source), str(tmp_path / "o1"), "--format", "int8", "--group-size", "64"]) == 1
    choosing = " and ".join(formats.GROUP_CHOICE).lower()
    assert f"--group-size applies to {choosing} only" in capsys.readouterr().err
    assert main(["convert", str(source), str(tmp_path / "o2"), "--format", "int4", "--group-size", "64"]) == 1
    assert "group size 64 does not divide" in capsys.readouterr().err
    assert main(["convert", str(source), str(tmp_path / "o3"), "--format", "bf16", "--layers", "0-1"]) == 1
    assert "layers [0] hold no routed experts" in capsys.readouterr().err


def test_parse_layers():
    assert convert.parse_layers("0-3") == [range(0, 4)]
    assert convert.parse_layers("5") == [range(5, 6)]
    assert convert.parse_layers("7, 0-2") == [range(7, 8), range(0, 3)]
    for bad in ("3-1", "a", "1-2-3", "", "²"):
        with pytest.raises(ValueError, match="--layers"):
            convert.parse_layers(bad)


def test_method_mismatch_is_a_clear_error(tmp_path, models):
    source, _ = models("deepseek", torch.bfloat16)
    convert.convert_checkpoint(source, tmp_path / "out", "BF16", progress=False)
    moe = moe_wrapper(E, K, H, I, layer_idx=1, weight_path=str(tmp_path / "out"), method="MXFP4")
    with pytest.raises(ValueError, match="holds BF16 weights, but method 'MXFP4' needs MXFP4"):
        moe.load_weights()
    with pytest.raises(ValueError, match="holds BF16 weights, but method 'AMXINT4' needs INT4"):
        checkpoint.read_converted_layer(tmp_path / "out", 1, E, "AMXINT4")
    with pytest.raises(CheckpointError, match="has 4 experts, 5 asked"):
        checkpoint.read_converted_layer(tmp_path / "out", 1, E + 1, "BF16")


@pytest.mark.parametrize("shards", [1, 2])
def test_corrupt_input_names_the_file(tmp_path, shards):
    write_model(tmp_path / "model", "deepseek", torch.bfloat16, shards=shards)
    file = sorted((tmp_path / "model").glob("*.safetensors"))[-1]
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=file.name):
        convert.convert_checkpoint(tmp_path / "model", tmp_path / "out", "INT8", progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_expert_tensor_names_the_key(tmp_path):
    directory = tmp_path / "model"
    write_model(directory, "mixtral", torch.float8_e4m3fn)
    (file,) = directory.glob("*.safetensors")
    from safetensors.torch import load_file

    named = load_file(file)
    del named["model.layers.2.block_sparse_moe.experts.3.w3.weight"]
    del named["model.layers.1.block_sparse_moe.experts.0.w2.weight_scale_inv"]
    save_file(named, str(file))
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.1\.block_sparse_moe\.experts\.0\.w2\.weight_scale_inv' is missing",
    ):
        convert.convert_checkpoint(directory, tmp_path / "out", "BF16", progress=False)
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.2\.block_sparse_moe\.experts\.3\.w3\.weight' is missing"
    ):
        convert.convert_checkpoint(directory, tmp_path / "out", "BF16", layers=[2], progress=False)
    assert not (tmp_path / "out").exists()  # every key is checked before anything is written


def test_fused_fp8_is_refused(tmp_path):
    named = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(E, 2 * I, H).to(torch.float8_e4m3fn),
        "model.layers.0.mlp.experts.down_proj": torch.zeros(E, H, I).to(torch.float8_e4m3fn),
    }
    (tmp_path / "model").mkdir()
    save_file(named, str(tmp_path / "model" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="fused experts must be BF16, F16 or F32, got F8_E4M3"):
        convert.convert_checkpoint(tmp_path / "model", tmp_path / "out", "BF16", progress=False)


def test_no_experts_is_a_clear_error(tmp_path):
    (tmp_path / "model").mkdir()
    save_file(
        {"model.layers.0.mlp.gate_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "model" / "a.safetensors")
    )
    with pytest.raises(CheckpointError, match="no routed-expert tensors found"):
        convert.convert_checkpoint(tmp_path / "model", tmp_path / "out", "BF16", progress=False)
    assert os.listdir(tmp_path) == ["model"]


def test_fp8_with_a_scale_per_row_takes_any_input_count():
    """Group 0 (a scale per row) where no block of 16/32/128 divides K: no block-size arithmetic."""
    weight = torch.randn(37, 100, generator=torch.Generator().manual_seed(5))
    assert formats.get("FP8").choose_group(100, 0) == 0
    values, scales = quant.quantize("FP8", weight, 0)
    assert values.shape == (37, 100) and scales.shape == (37, 1)
    assert torch.allclose(quant.dequantize("FP8", values, scales), weight, rtol=0.07, atol=1e-6)
