"""load_weights() from checkpoints in the DeepSeek-V4-Flash MXFP4 layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kt_kernel import KTMoEWrapper, quant
from kt_kernel.safetensors_io import CheckpointError

from moe_reference import make_problem

E, K, H, I, LAYER = 6, 2, 64, 96, 3
PROJ = {"gate": "w1", "up": "w3", "down": "w2"}


@pytest.fixture(scope="module")
def experts():
    """Canonical MXFP4 tensors of one layer, and a batch to run."""
    p = make_problem(E, K, H, I, tokens=11, seed=21)
    tensors = {}
    for name in PROJ:
        tensors[name], tensors[f"{name}_scale"] = quant.quantize("MXFP4", getattr(p, name))
    return p, tensors


def v4_flash_tensors(tensors, layer=LAYER, prefix="", scale_dtype=torch.float8_e8m0fnu):
    """The layer's experts under V4-Flash names, plus tensors a loader must ignore."""
    out = {f"{prefix}layers.{layer}.attn.wq.weight": torch.randn(4, 4).to(torch.bfloat16)}
    for name, short in PROJ.items():
        for e in range(E):
            out[f"{prefix}layers.{layer}.ffn.experts.{e}.{short}.weight"] = (
                tensors[name][e].view(torch.int8).clone()
            )
            out[f"{prefix}layers.{layer}.ffn.experts.{e}.{short}.scale"] = (
                tensors[f"{name}_scale"][e].clone().view(scale_dtype)
            )
    return out


def write_checkpoint(directory: Path, named: dict[str, torch.Tensor], shards: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(named)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: named[k] for k in keys[shard::shards]}
        save_file(part, str(directory / file))
        weight_map.update({k: file for k in part})
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def wrapper(path) -> KTMoEWrapper:
    return KTMoEWrapper(
        LAYER, E, K, H, I, None, 2, 1, None if path is None else str(path), 512, method="MXFP4"
    )


def reference_output(p, tensors):
    moe = wrapper(None)
    moe.load_weights_from_tensors(
        tensors["gate"], tensors["up"], tensors["down"],
        gate_scale=tensors["gate_scale"], up_scale=tensors["up_scale"], down_scale=tensors["down_scale"],
    )  # fmt: skip
    return moe.forward(p.hidden, p.ids, p.weights)


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("prefix", ["", "model."])
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.uint8])
def test_load_v4_flash_layout(tmp_path, experts, shards, prefix, scale_dtype):
    p, tensors = experts
    named = v4_flash_tensors(tensors, prefix=prefix, scale_dtype=scale_dtype)
    named.update(v4_flash_tensors(tensors, layer=LAYER + 1, prefix=prefix))  # another layer, not read
    moe = wrapper(write_checkpoint(tmp_path / "ckpt", named, shards))
    moe.load_weights()
    assert torch.equal(moe.forward(p.hidden, p.ids, p.weights), reference_output(p, tensors))


def test_sharded_without_index_is_scanned(tmp_path, experts):
    p, tensors = experts
    directory = write_checkpoint(tmp_path / "ckpt", v4_flash_tensors(tensors), shards=2)
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    moe = wrapper(directory)
    moe.load_weights()
    assert torch.equal(moe.forward(p.hidden, p.ids, p.weights), reference_output(p, tensors))


def test_missing_tensor_names_the_key(tmp_path, experts):
    _, tensors = experts
    named = v4_flash_tensors(tensors)
    del named[f"layers.{LAYER}.ffn.experts.4.w3.scale"]
    moe = wrapper(write_checkpoint(tmp_path / "ckpt", named, shards=1))
    with pytest.raises(CheckpointError, match=f"'layers.{LAYER}.ffn.experts.4.w3.scale' is missing"):
        moe.load_weights()


def test_wrong_layer_is_a_missing_tensor(tmp_path, experts):
    _, tensors = experts
    directory = write_checkpoint(tmp_path / "ckpt", v4_flash_tensors(tensors, layer=7), shards=1)
    with pytest.raises(CheckpointError, match=f"layers.{LAYER}.ffn.experts.0.w1.weight"):
        wrapper(directory).load_weights()


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_file_is_a_clear_error(tmp_path, experts, damage):
    _, tensors = experts
    directory = write_checkpoint(tmp_path / "ckpt", v4_flash_tensors(tensors), shards=2)
    file = directory / "model-00002-of-00002.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00\x01garbage" + data[10:])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        wrapper(directory).load_weights()


def test_nan_scale_is_rejected(tmp_path, experts):
    _, tensors = experts
    named = v4_flash_tensors(tensors, scale_dtype=torch.uint8)
    named[f"layers.{LAYER}.ffn.experts.2.w2.scale"][1, 0] = 0xFF
    with pytest.raises(ValueError, match="down_scale holds the E8M0 NaN code 0xFF.*\\[2, 1, 0\\]"):
        wrapper(write_checkpoint(tmp_path / "ckpt", named, shards=1)).load_weights()


def test_missing_directory_and_no_weight_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="weight_path does not exist.*nope"):
        wrapper(tmp_path / "nope").load_weights()
    with pytest.raises(ValueError, match="needs weight_path"):
        wrapper(None).load_weights()
