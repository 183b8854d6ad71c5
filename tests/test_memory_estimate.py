"""`kt-kernel info --memory`: the held bytes told from headers are the engines' packed_bytes() after
load_weights, exactly, for every format of the registry (converted checkpoints), every Hugging Face
source layout and every ggml type; where the engine chooses by the data (GGUF, GPTQ's zero points)
they are a bound the load stays within, and the output says "at most", after the bytes of each ggml
type's expected layout, which a file of realistic blocks is held in exactly. Odd sizes included."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kt_kernel import formats
from kt_kernel.__main__ import main
from kt_kernel.convert import convert_checkpoint
from kt_kernel.gguf_blocks import BLOCK_TYPES
from kt_kernel.memory_estimate import estimate

from moe_reference import moe_wrapper

EXPERTS = 3
NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def packed_bytes(path, method: str, hidden: int, inter: int) -> int:
    moe = moe_wrapper(EXPERTS, 2, hidden, inter, method=method, weight_path=str(path))
    moe.load_weights()
    return sum(sp.engine.packed_bytes() for sp in moe._subpools)


def write_source(directory, hidden: int, inter: int, expert_tensors, config: dict | None = None):
    """A Hugging Face directory of layer 0: expert_tensors(rows, k) gives one weight's tensors by
    suffix ("weight", "weight_scale", ...)."""
    directory.mkdir(exist_ok=True)
    tensors = {}
    for e in range(EXPERTS):
        for projection, name in NAMES.items():
            rows, k = (hidden, inter) if projection == "down" else (inter, hidden)
            for suffix, tensor in expert_tensors(rows, k).items():
                tensors[f"model.layers.0.mlp.experts.{e}.{name}.{suffix}"] = tensor.contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def bf16(rows: int, k: int) -> dict:
    return {"weight": torch.randn(rows, k).to(torch.bfloat16)}


def fp8(scales: str):
    def tensors(rows: int, k: int) -> dict:
        codes = torch.randn(rows, k).to(torch.float8_e4m3fn)
        shape = {"channel": (rows, 1), "block": (-(-rows // 128), k // 128), "mx": (rows, k // 32)}[scales]
        scale = torch.full(shape, 127, dtype=torch.uint8) if scales == "mx" else torch.ones(shape)
        return {"weight": codes, ("weight_scale" if scales == "channel" else "weight_scale_inv"): scale}

    return tensors


def nvfp4(rows: int, k: int) -> dict:
    return {
        "weight": torch.randint(0, 256, (rows, k // 2), dtype=torch.uint8),
        "weight_scale": torch.full((rows, k // 16), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(0.5),
    }


def int4(layout: str, group: int):
    def tensors(rows: int, k: int) -> dict:
        words = torch.randint(-(2**31), 2**31 - 1, (k // 8, rows) if layout == "gptq" else (rows, k // 8))
        if layout == "packed":
            return {"weight_packed": words.int(), "weight_scale": torch.ones(rows, k // group)}
        # Stored zeros 7 everywhere: symmetric GPTQ, whose zero points the load drops.
        return {"qweight": words.int(), "qzeros": torch.full((k // group, rows // 8), 0x77777777).int(),
                "scales": torch.ones(k // group, rows, dtype=torch.float16)}  # fmt: skip

    return tensors


def assert_exact(path, method: str, hidden: int, inter: int) -> dict:
    result = estimate(path, method).as_dict()
    assert result["exact"]
    assert result["held_bytes"] == result["expected_bytes"] == packed_bytes(path, method, hidden, inter)
    return result


@pytest.mark.parametrize("name", formats.FORMATS)
def test_every_format_converted_is_held_as_told(tmp_path, name):
    fmt = formats.FORMATS[name]
    # (100, 37): rows of a part-filled group (FP8: a scale per row, no block divides them).
    odd = fmt.k_multiple == 1
    hidden, inter = (100, 37) if odd else (96, 160)
    source = write_source(tmp_path / "source", hidden, inter, bf16)
    convert_checkpoint(source, tmp_path / "out", name, progress=False)
    result = estimate(tmp_path / "out").as_dict()
    actual = packed_bytes(tmp_path / "out", name, hidden, inter)
    if name == "GGUF":  # the canonical int8 values and pairs: the engine chooses a layout by them
        assert not result["exact"] and actual <= result["held_bytes"]
    else:
        assert result["exact"] and result["held_bytes"] == actual
    assert result["file_bytes"] == sum(map(data_bytes, (tmp_path / "out").glob("*.safetensors")))


def data_bytes(file) -> int:
    """A safetensors file's bytes past its header: its tensors' data."""
    with open(file, "rb") as f:
        return file.stat().st_size - 8 - int.from_bytes(f.read(8), "little")


@pytest.mark.parametrize(
    ("method", "tensors", "hidden", "inter"),
    [
        ("BF16", bf16, 100, 37),
        ("FP8", fp8("channel"), 100, 37),
        ("FP8", fp8("block"), 256, 128),
        ("FP8", fp8("mx"), 96, 160),
        ("NVFP4", nvfp4, 96, 160),
        ("INT4", int4("packed", 32), 96, 160),
        ("INT4", int4("packed", 128), 256, 128),
    ],
    ids=["bf16", "fp8-channel", "fp8-block", "mxfp8", "nvfp4", "int4-packed-32", "int4-packed-128"],
)
def test_hugging_face_sources_are_held_as_told(tmp_path, method, tensors, hidden, inter):
    source = write_source(tmp_path / "model", hidden, inter, tensors)
    assert estimate(source).as_dict()["method"] == formats.get(method).name  # the format found
    assert_exact(source, method, hidden, inter)


def test_gptq_zero_points_are_a_bound(tmp_path):
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}
    source = write_source(tmp_path / "model", 96, 160, int4("gptq", 32), config)
    result = estimate(source, "GPTQ_INT4").as_dict()
    assert not result["exact"]
    assert packed_bytes(source, "GPTQ_INT4", 96, 160) < result["held_bytes"]  # symmetric: dropped


gguf = pytest.importorskip("gguf")
from test_gguf_accuracy import realistic_blocks  # noqa: E402
from test_gguf_file import KNOWN_TYPES, write_layer  # noqa: E402
from test_gguf_held_bytes import EXPERTS as HELD_EXPERTS  # noqa: E402
from test_gguf_held_bytes import SHAPES as HELD_SHAPES  # noqa: E402
from test_gguf_held_bytes import held_from_a_file  # noqa: E402


@pytest.mark.parametrize("type_name", [*KNOWN_TYPES, "BF16", "F16", "F32"])
def test_every_ggml_type_is_held_within_what_is_told(tmp_path, type_name):
    block = BLOCK_TYPES.get(type_name)
    hidden, inter = (256, 256) if block is None or block.block_inputs > 32 else (96, 160)
    if block is None:
        hidden, inter = 100, 37
    rng = np.random.default_rng(0)
    projections = {}
    for name in NAMES:
        rows, k = (hidden, inter) if name == "down" else (inter, hidden)
        raw = None if block is None else realistic_blocks(type_name, EXPERTS * rows, k, rng)
        projections[name] = type_name if block is None else (type_name, raw.reshape(EXPERTS, rows, -1))
    path = tmp_path / "model.gguf"
    write_layer(path, projections, experts=EXPERTS, hidden=hidden, inter=inter)
    result = estimate(path).as_dict()
    actual = packed_bytes(path, "GGUF", hidden, inter)
    assert actual <= result["held_bytes"]
    assert actual == result["held_bytes"] or not result["exact"]
    assert result["file_bytes"] == sum(t.n_bytes for t in gguf.GGUFReader(path).tensors)


@pytest.mark.parametrize("type_name", KNOWN_TYPES)
def test_every_ggml_type_from_a_file_is_held_in_its_expected_bytes(tmp_path, type_name):
    """Realistic blocks, as ggml's quantizer writes them, take their type's own layout: the
    estimate's expected bytes are the engine's packed_bytes() exactly (Q2_K and Q3_K too, held above
    their file), within the bound, and held_bytes_per_weight() per weight, but for the engine's
    rounding (none at these sizes) and E4M3 layouts' blocks with an fp32 per matrix."""
    path = tmp_path / "model.gguf"
    held = held_from_a_file(path, type_name)
    result = estimate(path).as_dict()
    (entry,) = result["types"]
    assert entry["expected_bytes"] == result["expected_bytes"] == held
    assert not result["exact"] and held < result["held_bytes"]
    block = BLOCK_TYPES[type_name]
    weights = sum(HELD_EXPERTS * rows * k for rows, k in HELD_SHAPES.values())
    if block.factored is None:
        matrices = HELD_EXPERTS * len(HELD_SHAPES)
        assert held == weights * block.block_bytes // block.block_inputs + 4 * matrices
    else:
        assert held == weights * block.held_bytes_per_weight()


def test_text_and_json_output(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    write_layer(path, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, experts=EXPERTS, hidden=256, inter=256)
    assert main(["info", "--memory", str(path)]) == 0
    text = capsys.readouterr().out
    assert "Q4_K" in text and "Q6_K" in text and "at most" in text and "total" in text
    assert text.count("held expected ") == 3  # each type and the total: expected, then at most
    assert main(["info", "--memory", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [t["stored_as"] for t in result["types"]] == ["Q4_K", "Q6_K"]
    assert result["held_bytes"] == sum(t["held_bytes"] for t in result["types"])
    assert result["expected_bytes"] == sum(t["expected_bytes"] for t in result["types"])
    assert all(t["expected_bytes"] < t["held_bytes"] for t in result["types"])


@pytest.mark.parametrize(
    ("make", "method", "message"),
    [
        (lambda d: d / "missing", None, "neither a .gguf file nor a model directory"),
        (lambda d: d, None, "no .safetensors files"),
        (lambda d: write_source(d / "m", 64, 32, bf16), "NOPE", "unknown method 'NOPE'"),
        (lambda d: write_source(d / "m", 64, 32, bf16), "INT8", "converted checkpoints"),
        (lambda d: write_source(d / "m", 64, 32, bf16), "FP8", "holds BF16 experts, not FP8"),
    ],
    ids=["missing", "no-model", "unknown-method", "int8-source", "other-format"],
)
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, make, method, message):
    path = make(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--memory", str(path), *(["--method", method] if method else [])])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_directory_without_experts_is_refused(tmp_path, capsys):
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--memory", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "no routed-expert tensors" in capsys.readouterr().err


def test_a_gguf_whose_scales_do_not_factor_stays_within_what_is_told(tmp_path):
    """A Q6_K block of scale -0 and scales of both signs: its entries are +0 and -0, which no one
    factor gives, so the engine holds that projection with fp32 scales, though Q6_K's scales are
    int8 multiples of one fp16 by construction. The bound must count that layout."""
    rng = np.random.default_rng(0)
    projections = {
        name: ("Q6_K", realistic_blocks("Q6_K", EXPERTS * 256, 256, rng).reshape(EXPERTS, 256, -1))
        for name in NAMES
    }
    block = projections["down"][1][0, 0, :210]  # ql 128, qh 64, int8 scales 16, fp16 d
    block[192:208] = np.array([1, -1] * 8, np.int8).view(np.uint8)
    block[208:210] = np.array([-0.0], np.float16).view(np.uint8)
    path = tmp_path / "model.gguf"
    write_layer(path, projections, experts=EXPERTS, hidden=256, inter=256)
    result = estimate(path).as_dict()
    actual = packed_bytes(path, "GGUF", 256, 256)
    assert not result["exact"] and actual <= result["held_bytes"]
