"""GGUF checkpoints: every supported ggml type converted to the GGUF format's canonical tensors
against gguf-py's own dequantize, and the file reader's errors (kt_kernel.gguf_blocks,
kt_kernel.gguf_file), on tiny files written with gguf.GGUFWriter."""

import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kt_kernel import checkpoint, formats  # noqa: E402
from kt_kernel.gguf_blocks import BLOCK_TYPES, convert_rows  # noqa: E402
from kt_kernel.gguf_file import GGUFLayerReader, gguf_files, is_gguf_checkpoint  # noqa: E402
from kt_kernel.safetensors_io import CheckpointError  # noqa: E402

from moe_reference import make_problem, moe_wrapper  # noqa: E402

T = gguf.GGMLQuantizationType
ARCH = "qwen3moe"
#: Byte offsets of each type's fp16 fields (d, dmin, m): random bytes there could be Inf or NaN.
FP16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
    "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
    "MXFP4": (), "NVFP4": (),
}  # fmt: skip
#: Where gguf-py's fp32 arithmetic is exact (integer times fp16 d times small integers, no sum),
#: the conversion must reproduce it bit for bit; the others add a min, which rounds once.
EXACT_TYPES = ("Q8_0", "Q4_0", "Q5_0", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4")
#: The supported types this gguf package knows (0.17 predates MXFP4 and NVFP4).
KNOWN_TYPES = [name for name in BLOCK_TYPES if name in T.__members__]
#: The types gguf-py can quantize to: their blocks come from real weights as well.
QUANTIZABLE = [name for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4") if name in KNOWN_TYPES]


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of ``type_name``, uint8 [rows, K's bytes]: random bytes with finite fp16
    fields of varied magnitude (negative ones too) and E8M0 exponents whose products stay finite in fp32."""
    block = BLOCK_TYPES[type_name]
    count = rows * k // block.block_inputs
    blocks = rng.integers(0, 256, (count, block.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        field = rng.standard_normal(count) * np.exp2(rng.integers(-20, 2, count))
        blocks[:, offset : offset + 2] = field.astype(np.float16).view(np.uint8).reshape(count, 2)
    if type_name == "MXFP4":
        blocks[:, 0] = rng.integers(0, 250, count)  # denormal scales (0, 1) included; 12 * 2^121 fits fp32
    return blocks.reshape(rows, -1)


def weight_of(values: torch.Tensor, pairs: torch.Tensor) -> np.ndarray:
    """The real weight the canonical tensors mean, in float64: values * scale + min."""
    group = 2 * values.shape[-1] // pairs.shape[-1]
    scale = pairs[..., 0::2].double().repeat_interleave(group, dim=-1)
    minimum = pairs[..., 1::2].double().repeat_interleave(group, dim=-1)
    return (values.double() * scale + minimum).numpy()


def assert_matches_gguf(type_name: str, raw: np.ndarray) -> None:
    values, pairs = (torch.from_numpy(a) for a in convert_rows(type_name, raw))
    reference = gguf.quants.dequantize(raw, T[type_name]).astype(np.float64)
    assert values.dtype == torch.int8 and pairs.dtype == torch.float32
    assert pairs.shape[-1] == 2 * values.shape[-1] // BLOCK_TYPES[type_name].group
    weight = weight_of(values, pairs)
    if type_name in EXACT_TYPES:
        np.testing.assert_array_equal(weight, reference)
    else:  # within fp32 rounding of gguf-py's sum, relative to the largest magnitude of its block
        block = BLOCK_TYPES[type_name].block_inputs
        blocks_max = np.abs(reference).reshape(-1, block).max(axis=1, keepdims=True)
        error = np.abs(weight - reference).reshape(-1, block)
        assert (error <= 1e-6 * blocks_max).all(), f"{type_name}: {(error / blocks_max).max()}"


def test_block_sizes_are_ggmls():
    for name in KNOWN_TYPES:
        block = BLOCK_TYPES[name]
        assert gguf.GGML_QUANT_SIZES[T[name]] == (block.block_inputs, block.block_bytes), name
        assert block.group in (16, 32) and block.block_inputs % block.group == 0


@pytest.mark.parametrize("type_name", KNOWN_TYPES)
def test_every_type_matches_gguf_dequantize(type_name):
    rng = np.random.default_rng(list(BLOCK_TYPES).index(type_name))
    assert_matches_gguf(type_name, random_blocks(type_name, 6, 512, rng).reshape(2, 3, -1))


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_quantized_weights_match_gguf_dequantize(type_name):
    weight = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    assert_matches_gguf(type_name, gguf.quants.quantize(weight, T[type_name]))


def test_value_ranges_are_the_types():
    """The integer parts as documented: unsigned where ggml adds a min, offset where it centres."""
    rng = np.random.default_rng(2)
    expected = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q5_0": (-16, 15), "Q2_K": (0, 3), "Q3_K": (-4, 3),
                "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31), "IQ4_NL": (-127, 113),
                "MXFP4": (-12, 12), "NVFP4": (-12, 12)}  # fmt: skip
    for name, (low, high) in expected.items():
        values, _ = convert_rows(name, random_blocks(name, 64, 256, rng))
        assert (values.min(), values.max()) == (low, high), name


def test_denormal_mxfp4_scale_is_exact():
    blocks = np.zeros((2, 17), np.uint8)
    blocks[:, 0] = (0, 1)  # 2^-128 and 2^-127: float32 denormals
    blocks[:, 1] = 0x07  # the first value is 12 (6, doubled)
    values, pairs = convert_rows("MXFP4", blocks)
    assert values[:, 0].tolist() == [12, 12]
    assert pairs[:, 0].tolist() == [2.0**-128, 2.0**-127]
    np.testing.assert_array_equal(
        weight_of(torch.from_numpy(values), torch.from_numpy(pairs))[:, 0], [12 * 2.0**-128, 12 * 2.0**-127]
    )


def write_layer(
    path, projections, *, experts=4, hidden=512, inter=256, layer=0, metadata=True, **writer_args
):
    """A GGUF file (or split set) with layer ``layer``'s experts: projections maps gate/up/down to
    a ggml type name or to raw blocks [E, N, bytes] with their type. Returns what gguf-py
    dequantizes each projection to."""
    rng = np.random.default_rng(layer)
    writer = gguf.GGUFWriter(path, ARCH, **writer_args)
    if metadata:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
        writer.add_embedding_length(hidden)
        writer.add_expert_feed_forward_length(inter)
    reference = {}
    for name, spec in projections.items():
        rows, k = (hidden, inter) if name == "down" else (inter, hidden)
        type_name, raw = spec if isinstance(spec, tuple) else (spec, None)
        tensor_name = f"blk.{layer}.ffn_{name}_exps.weight"
        if type_name in ("F32", "F16"):
            data = rng.standard_normal((experts, rows, k)).astype(
                np.float32 if type_name == "F32" else np.float16
            )
            writer.add_tensor(tensor_name, data)
            reference[name] = data.astype(np.float32)
            continue
        if type_name == "BF16":
            data = rng.standard_normal((experts, rows, k)).astype(np.float32)
            raw = gguf.quants.quantize(data, T.BF16)
        elif raw is None:
            raw = random_blocks(type_name, experts * rows, k, rng).reshape(experts, rows, -1)
        writer.add_tensor(tensor_name, raw, raw_dtype=T[type_name])
        if type_name in BLOCK_TYPES or type_name == "BF16":
            with np.errstate(invalid="ignore"):  # a test's corrupt block
                reference[name] = gguf.quants.dequantize(raw, T[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def assert_layer_matches(tensors, reference, experts=slice(None)):
    for name, expected in reference.items():
        if f"{name}_scale" in tensors:
            weight = weight_of(tensors[name], tensors[f"{name}_scale"])
            np.testing.assert_allclose(weight, expected[experts], rtol=0, atol=1e-6 * np.abs(expected).max())
        else:
            assert tensors[name].dtype == torch.bfloat16
            np.testing.assert_array_equal(
                tensors[name].float().numpy(), torch.from_numpy(expected[experts]).bfloat16().float().numpy()
            )


def test_mixed_types_in_one_layer_each_with_its_group(tmp_path):
    """Q4_K_M's layers: gate/up Q4_K, down Q6_K (groups of 32 and 16)."""
    file = tmp_path / "model.gguf"
    reference = write_layer(file, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"})
    reader = GGUFLayerReader(file, 0, "GGUF", (512, 256))
    assert (reader.experts, reader.hidden, reader.intermediate) == (4, 512, 256)
    assert (reader.info.architecture, reader.info.expert_count, reader.info.expert_used_count) == (ARCH, 4, 2)
    assert (reader.info.embedding_length, reader.info.expert_feed_forward_length) == (512, 256)
    tensors = reader.read(4)
    assert set(tensors) == {"gate", "up", "down", "gate_scale", "up_scale", "down_scale"}
    assert tensors["gate"].shape == (4, 256, 512) and tensors["down"].shape == (4, 512, 256)
    assert tensors["gate_scale"].shape == (4, 256, 2 * 512 // 32)
    assert tensors["down_scale"].shape == (4, 512, 2 * 256 // 16)
    assert_layer_matches(tensors, reference)


def test_an_expert_range_is_the_slice_of_the_whole(tmp_path):
    file = tmp_path / "model.gguf"
    write_layer(file, {"gate": "IQ4_XS", "up": "Q5_K", "down": "Q8_0"})
    reader = GGUFLayerReader(file, 0, "GGUF")
    whole, part = reader.read(range(4)), reader.read(range(1, 3))
    assert set(part) == set(whole)
    for name, tensor in part.items():
        assert torch.equal(tensor, whole[name][1:3]), name


def test_odd_width_rows_as_llama_cpp_stores_them(tmp_path):
    """An intermediate size of 1408 is no multiple of 256: llama.cpp falls back to Q5_0/Q8_0."""
    file = tmp_path / "model.gguf"
    reference = write_layer(file, {"gate": "Q5_0", "up": "Q5_0", "down": "Q8_0"}, hidden=256, inter=1408)
    tensors = GGUFLayerReader(file, 0, "GGUF", (256, 1408)).read(range(2, 4))
    assert tensors["down"].shape == (2, 256, 1408) and tensors["down_scale"].shape == (2, 256, 88)
    assert_layer_matches(tensors, reference, slice(2, 4))


def test_split_set_read_from_any_part_or_the_directory(tmp_path):
    reference = write_layer(
        tmp_path / "model.gguf", {"gate": "Q4_0", "up": "Q4_1", "down": "Q5_1"}, split_max_tensors=2
    )
    parts = sorted(tmp_path.glob("*.gguf"))
    assert [p.name for p in parts] == ["model-00001-of-00002.gguf", "model-00002-of-00002.gguf"]
    assert gguf.GGUFReader(parts[1]).get_field("split.count").contents() == 2
    for given in (parts[0], parts[1], tmp_path):
        assert is_gguf_checkpoint(given)
        assert gguf_files(given) == tuple(parts)
        assert_layer_matches(GGUFLayerReader(given, 0, "GGUF").read(4), reference)


def test_split_set_with_a_missing_part(tmp_path):
    write_layer(tmp_path / "model.gguf", {"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"}, split_max_tensors=1)
    (tmp_path / "model-00002-of-00003.gguf").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.gguf"):
        GGUFLayerReader(tmp_path / "model-00001-of-00003.gguf", 0, "GGUF")


def test_a_part_renamed_out_of_its_set(tmp_path):
    """A file whose metadata says it is one of three parts, named as a whole model."""
    write_layer(tmp_path / "model.gguf", {"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"}, split_max_tensors=1)
    lone = tmp_path / "lone" / "model.gguf"
    lone.parent.mkdir()
    (tmp_path / "model-00001-of-00003.gguf").rename(lone)
    with pytest.raises(CheckpointError, match=r"lone/model.gguf.*split set of 3"):
        GGUFLayerReader(lone, 0, "GGUF")


def test_truncated_file(tmp_path):
    file = tmp_path / "model.gguf"
    write_layer(file, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"})
    data = file.read_bytes()
    for size in (len(data) - 1000, 100, 0):
        file.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match=rf"{file}: not a valid GGUF file"):
            GGUFLayerReader(file, 0, "GGUF")


def test_missing_tensor_names_it_and_the_file(tmp_path):
    file = tmp_path / "model.gguf"
    write_layer(file, {"gate": "Q8_0", "up": "Q8_0"})
    with pytest.raises(
        CheckpointError, match=r"model.gguf: no tensor 'blk.0.ffn_down_exps.weight'.*ffn_up_exps"
    ):
        GGUFLayerReader(file, 0, "GGUF")
    with pytest.raises(CheckpointError, match="no tensor 'blk.3.ffn_gate_exps.weight'"):
        GGUFLayerReader(file, 3, "GGUF")


def test_wrong_shapes(tmp_path):
    file = tmp_path / "model.gguf"
    write_layer(file, {"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"})
    with pytest.raises(
        CheckpointError, match=r"'blk.0.ffn_gate_exps.weight' has shape .* \[4, 256, 512\].*hidden size 1024"
    ):
        GGUFLayerReader(file, 0, "GGUF", (1024, 256))
    # down stored with the wrong inner size
    write_layer(
        file,
        {
            "gate": "Q8_0",
            "up": "Q8_0",
            "down": (
                "Q8_0",
                random_blocks("Q8_0", 4 * 512, 512, np.random.default_rng()).reshape(4, 512, -1),
            ),
        },
    )
    with pytest.raises(
        CheckpointError, match=r"'blk.0.ffn_down_exps.weight' has shape \[E, N, K\] = \[4, 512, 512\]"
    ):
        GGUFLayerReader(file, 0, "GGUF")
    # the metadata's expert count disagrees with the tensors
    write_layer(file, {"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"}, experts=4, metadata=False)
    assert GGUFLayerReader(file, 0, "GGUF").experts == 4  # no metadata: the tensors decide
    with pytest.raises(CheckpointError, match="layer 0 has 4 experts, range"):
        GGUFLayerReader(file, 0, "GGUF").read(range(2, 5))


def test_unsupported_type_names_file_tensor_and_the_supported_ones(tmp_path):
    file = tmp_path / "model.gguf"
    iq2 = np.random.default_rng(3).integers(0, 256, (4, 256, 512 // 256 * 66), dtype=np.uint8)
    write_layer(file, {"gate": ("IQ2_XXS", iq2), "up": "Q4_K", "down": "Q4_K"})
    with pytest.raises(CheckpointError) as caught:
        GGUFLayerReader(file, 0, "GGUF")
    message = str(caught.value)
    assert str(file) in message and "'blk.0.ffn_gate_exps.weight' is IQ2_XXS" in message
    assert all(name in message for name in BLOCK_TYPES)
    with pytest.raises(ValueError, match="IQ2_XXS"):
        convert_rows("IQ2_XXS", iq2)


def test_float_experts_read_as_bf16(tmp_path):
    """Float experts read as bf16, with method BF16 or GGUF (any GGUF layer: held_format says BF16)."""
    file = tmp_path / "model.gguf"
    reference = write_layer(file, {"gate": "BF16", "up": "BF16", "down": "BF16"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bf16 is taken as it is: nothing to warn of
        tensors = GGUFLayerReader(file, 0, "BF16").read(range(1, 4))
        as_gguf = GGUFLayerReader(file, 0, "GGUF")
    assert set(tensors) == {"gate", "up", "down"}
    assert_layer_matches(tensors, reference, slice(1, 4))
    assert as_gguf.held_format == "BF16"
    assert all(torch.equal(t, tensors[name]) for name, t in as_gguf.read(range(1, 4)).items())

    reference = write_layer(file, {"gate": "F16", "up": "F32", "down": "F16"})
    with pytest.warns(
        UserWarning,
        match=r"as bf16: it rounds 'blk.0.ffn_gate_exps.weight' \(F16\), 'blk.0.ffn_up_exps.weight' \(F32\)",
    ):
        reader = GGUFLayerReader(file, 0, "BF16")
    assert_layer_matches(reader.read(4), reference)

    write_layer(file, {"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"})
    with pytest.raises(CheckpointError, match="is Q4_K, a quantized type: read it with method='GGUF'"):
        GGUFLayerReader(file, 0, "BF16")
    write_layer(file, {"gate": "Q4_K", "up": "Q4_K", "down": "F16"})
    with pytest.raises(CheckpointError, match="mixing float and quantized"):
        GGUFLayerReader(file, 0, "GGUF")
    with pytest.raises(ValueError, match="not 'INT4'"):
        GGUFLayerReader(file, 0, "INT4")


def test_corrupt_scale_and_unknown_companion_tensor(tmp_path):
    file = tmp_path / "model.gguf"
    raw = random_blocks("Q4_K", 4 * 256, 512, np.random.default_rng(4)).reshape(4, 256, -1)
    raw[2, 7, 144 : 144 + 2] = np.array([np.inf], np.float16).view(np.uint8)  # row 7's second block's d
    write_layer(file, {"gate": ("Q4_K", raw), "up": "Q4_K", "down": "Q4_K"})
    reader = GGUFLayerReader(file, 0, "GGUF")
    reader.read(range(2))  # the corrupt block is in expert 2
    with pytest.raises(
        CheckpointError, match=r"gate_exps.weight' holds a non-finite scale \(expert 2, row 7, group 8\)"
    ):
        reader.read(range(1, 4))

    writer = gguf.GGUFWriter(file, ARCH)
    for name in ("gate", "up", "down"):
        writer.add_tensor(
            f"blk.0.ffn_{name}_exps.weight",
            random_blocks("Q8_0", 4 * 256, 256, np.random.default_rng()).reshape(4, 256, -1),
            raw_dtype=T.Q8_0,
        )
    writer.add_tensor("blk.0.ffn_gate_exps.scale", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="'blk.0.ffn_gate_exps.scale' goes with the experts' weight"):
        GGUFLayerReader(file, 0, "GGUF")


def test_directory_of_several_models_is_refused(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        write_layer(tmp_path / name, {"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"})
    with pytest.raises(CheckpointError, match=r"found 2 models \(a.gguf, b.gguf\)"):
        GGUFLayerReader(tmp_path, 0, "GGUF")
    assert not is_gguf_checkpoint(tmp_path / "missing")


def write_problem(path, p, type_name):
    """The problem's float experts as layer 0 of a GGUF file: bf16 as they are, or quantized."""
    writer = gguf.GGUFWriter(path, ARCH)
    writer.add_expert_count(p.gate.shape[0])
    writer.add_embedding_length(p.gate.shape[2])
    writer.add_expert_feed_forward_length(p.gate.shape[1])
    for name in ("gate", "up", "down"):
        weight = getattr(p, name).numpy()
        writer.add_tensor(
            f"blk.0.ffn_{name}_exps.weight",
            gguf.quants.quantize(weight, T[type_name]),
            raw_dtype=T[type_name],
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_load_weights_reads_a_bf16_gguf_file(tmp_path):
    p = make_problem(6, 2, 64, 96, tokens=9, seed=5)
    write_problem(tmp_path / "model.gguf", p, "BF16")
    moe = moe_wrapper(6, 2, 64, 96, weight_path=str(tmp_path / "model.gguf"))
    moe.load_weights()
    reference = moe_wrapper(6, 2, 64, 96)
    reference.load_weights_from_tensors(p.gate.bfloat16(), p.up.bfloat16(), p.down.bfloat16())
    assert torch.equal(moe.forward(p.hidden, p.ids, p.weights), reference.forward(p.hidden, p.ids, p.weights))
    # a directory holding the file is the same model; the caller's sizes are checked before any read
    assert torch.equal(checkpoint.read_layer(tmp_path, 0, range(2, 4), "BF16")["up"], p.up[2:4].bfloat16())
    with pytest.raises(
        CheckpointError, match="'blk.0.ffn_gate_exps.weight' has shape .* intermediate size 128"
    ):
        checkpoint.LayerReader(tmp_path, 0, "BF16", (64, 128))
    with pytest.raises(CheckpointError, match="read it with method='GGUF'"):
        write_problem(tmp_path / "model.gguf", p, "Q8_0")
        checkpoint.LayerReader(tmp_path, 0, "BF16")


def test_load_weights_reads_a_quantized_gguf_file(tmp_path):
    """Once the engine lists the GGUF format: load_weights() is load_weights_from_tensors of what the
    reader returns."""
    if "GGUF" not in formats.METHODS or "LLAMAFILE" not in formats.METHODS:
        pytest.skip("the engine has no GGUF format yet")
    p = make_problem(6, 2, 64, 96, tokens=9, seed=6)
    write_problem(tmp_path / "model.gguf", p, "Q8_0")
    tensors = GGUFLayerReader(tmp_path / "model.gguf", 0, "GGUF").read(6)
    for method in ("GGUF", "LLAMAFILE"):
        moe = moe_wrapper(6, 2, 64, 96, weight_path=str(tmp_path / "model.gguf"), method=method)
        moe.load_weights()
        reference = moe_wrapper(6, 2, 64, 96, method=method)
        reference.load_weights_from_tensors(
            tensors["gate"], tensors["up"], tensors["down"],
            gate_scale=tensors["gate_scale"], up_scale=tensors["up_scale"], down_scale=tensors["down_scale"],
        )  # fmt: skip
        assert torch.equal(
            moe.forward(p.hidden, p.ids, p.weights), reference.forward(p.hidden, p.ids, p.weights)
        )
