"""Hostile scale tensors in the checkpoints load_weights() and `kt-kernel convert` read (FP8 block
scales, compressed-tensors RAWINT4, GPTQ): each is a CheckpointError (a ValueError) naming the
tensor, before anything is packed; the converter exits 1 with the same message."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_fp8 import expert_tensors, write_model_dir
from test_int4_sources import write_layer

from kt_kernel.__main__ import main

from moe_reference import moe_wrapper

VARIANTS = {
    "nan": lambda t: t.clone().fill_(float("nan")),
    "inf": lambda t: t.clone().fill_(float("inf")),
    "zero": lambda t: torch.zeros_like(t),
    "negative": lambda t: -t.abs() - 0.1,
    "int32": lambda t: t.to(torch.int32),
    "bool": lambda t: t.bool(),
    "one-row-more": lambda t: torch.cat([t, t[:1]]),
    "3-d": lambda t: t[None],
}


def fp8_layer(path) -> None:
    write_model_dir(path, expert_tensors("model.", 0, per_channel=False, seed=1)[0])


SOURCES = {  # (writer, the scale tensor spoiled, E, K, H, I, method)
    "FP8": (fp8_layer, "weight_scale_inv", 4, 2, 256, 384, "FP8"),
    "RAWINT4": (lambda path: write_layer(path, "packed", 32), "weight_scale", 4, 2, 256, 128, "RAWINT4"),
    "GPTQ": (lambda path: write_layer(path, "gptq", 32), "scales", 4, 2, 256, 128, "GPTQ_INT4"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("source", list(SOURCES))
def test_a_hostile_scale_is_an_error_naming_the_tensor(tmp_path, source, variant):
    write, kind, E, K, H, I, method = SOURCES[source]
    write(tmp_path / "model")
    file = tmp_path / "model" / "model.safetensors"
    tensors = load_file(str(file))
    key = f"model.layers.0.mlp.experts.1.up_proj.{kind}"
    tensors[key] = VARIANTS[variant](tensors[key]).contiguous()
    save_file(tensors, str(file))
    moe = moe_wrapper(E, K, H, I, method=method, weight_path=str(tmp_path / "model"))
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        moe.load_weights()
    with pytest.raises(RuntimeError, match="not loaded"):  # nothing half-loaded runs
        moe.forward(torch.zeros(1, H), torch.zeros(1, K, dtype=torch.int64), torch.ones(1, K))
    if source != "FP8":  # the converter reads packed INT4 sources the same way
        assert main(["convert", str(tmp_path / "model"), str(tmp_path / "out"), "--format", "int4"]) == 1


def test_a_layer_of_other_sizes_is_refused_from_the_headers_before_reading(tmp_path, monkeypatch):
    from kt_kernel import sources

    write_layer(tmp_path / "model", "packed", 32)  # H = 256, I = 128
    read = []
    monkeypatch.setattr(sources.ExpertSource, "read_stored", lambda *args: read.append(args))
    moe = moe_wrapper(4, 2, 512, 128, method="RAWINT4", weight_path=str(tmp_path / "model"))
    with pytest.raises(
        ValueError, match="hidden size 256 and intermediate size 128, the layer has 512 and 128"
    ):
        moe.load_weights()
    assert not read


def test_a_lying_weight_shape_is_an_error_naming_it(tmp_path):
    write_layer(tmp_path / "model", "packed", 32)
    file = tmp_path / "model" / "model.safetensors"
    tensors = load_file(str(file))
    key = "model.layers.0.mlp.experts.2.down_proj.weight_shape"
    tensors[key] = torch.tensor([999, 7], dtype=torch.int32)
    save_file(tensors, str(file))
    moe = moe_wrapper(4, 2, 256, 128, method="RAWINT4", weight_path=str(tmp_path / "model"))
    with pytest.raises(ValueError, match=rf"{key}' declares \[999, 7\]"):
        moe.load_weights()
