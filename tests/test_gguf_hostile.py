"""GGUF files corrupt or unusual (kt_kernel.gguf_file): a corrupt one is a CheckpointError naming the
file and the tensor, never a silent load, a signal or an IndexError; a valid one loads, whatever
expert comes first and whatever type its experts are. Files written with gguf.GGUFWriter and patched
in place where a writer would not write them so."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from test_accuracy import BOUND, reference, relative_error  # noqa: E402
from test_gguf_file import ARCH, T, write_layer, write_problem  # noqa: E402

from kt_kernel.gguf_file import GGUFLayerReader, gguf_files  # noqa: E402
from kt_kernel.safetensors_io import CheckpointError  # noqa: E402

from moe_reference import make_problem, moe_wrapper  # noqa: E402

Q8 = {"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"}


def patch(file, change) -> None:
    """``change(reader)`` on a writable GGUFReader of ``file``: its fields are views of the file."""
    reader = gguf.GGUFReader(file, "r+")
    change(reader)
    reader.data.flush()
    del reader


def tensor_offset(reader, name: str):
    """The relative data offset of tensor ``name`` in the tensor table, as a writable [1] array."""
    return next(t for t in reader.tensors if t.name == name).field.parts[-1]


@pytest.mark.parametrize("change", ["gate on up's range", "gate and up swapped"])
def test_tensor_data_ranges_out_of_ggmls_order_are_refused(tmp_path, change):
    """Two tensors on one range, or swapped, would load as each other's data (102-206 % off)."""
    file = tmp_path / "model.gguf"
    write_layer(file, Q8)
    gate, up = "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"

    def move(reader) -> None:
        gate_offset, up_offset = tensor_offset(reader, gate), tensor_offset(reader, up)
        old = int(gate_offset[0])
        gate_offset[0] = up_offset[0]
        if change == "gate and up swapped":
            up_offset[0] = old

    patch(file, move)
    with pytest.raises(
        CheckpointError, match=rf"{file}: tensor '{gate}' has its data at offset \d+, expected 0"
    ):
        GGUFLayerReader(file, 0, "GGUF")


def test_a_tensor_name_in_two_parts_of_a_split_set_is_refused(tmp_path):
    """ggml refuses a duplicate name; the later part's copy was read silently."""
    write_layer(tmp_path / "model.gguf", Q8, split_max_tensors=2)  # part 2 holds down only
    second = tmp_path / "model-00002-of-00002.gguf"
    writer = gguf.GGUFWriter(second, ARCH)
    writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, 1)
    writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, 2)
    blocks = np.zeros((4, 512, 256 // 32 * 34), np.uint8)
    for name in ("down", "gate"):  # gate again, after part 1's
        writer.add_tensor(f"blk.0.ffn_{name}_exps.weight", blocks, raw_dtype=T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        CheckpointError,
        match=r"00002-of-00002.gguf: tensor 'blk.0.ffn_gate_exps.weight' is also in .*00001-of-00002",
    ):
        GGUFLayerReader(tmp_path / "model-00001-of-00002.gguf", 0, "GGUF")


@pytest.mark.parametrize(
    "name", ["model-00001-of-00000.gguf", "model-00003-of-00002.gguf", "model-00000-of-00002.gguf"]
)
def test_a_split_name_that_numbers_no_part_is_refused(tmp_path, name):
    write_layer(tmp_path / name, Q8)
    with pytest.raises(CheckpointError, match=rf"{name}: part \d+ of \d+ is no part of a split set"):
        gguf_files(tmp_path / name)


@pytest.mark.parametrize("key", ["embedding_length", "expert_feed_forward_length"])
def test_metadata_that_disagrees_with_the_tensors_is_refused(tmp_path, key):
    """load_weights passes the layer's sizes, which the tensors match: the metadata must match too
    (docs/formats.md lists a disagreement as a CheckpointError)."""
    file = tmp_path / "model.gguf"
    write_layer(file, Q8, hidden=512, inter=256)
    GGUFLayerReader(file, 0, "GGUF", (512, 256))  # as written: agrees
    patch(file, lambda reader: reader.get_field(f"{ARCH}.{key}").parts[-1].__setitem__(0, 1024))
    with pytest.raises(
        CheckpointError, match=rf"{file}: tensor 'blk.0.ffn_gate_exps.weight' .*{key} is 1024"
    ):
        GGUFLayerReader(file, 0, "GGUF", (512, 256))
    with pytest.raises(CheckpointError, match=str(file)):
        GGUFLayerReader(file, 0, "GGUF")  # without sizes the metadata's are checked against the tensors


@pytest.mark.parametrize("rewrite", ["truncated", "rewritten at the same size"])
def test_a_file_changed_between_two_reads_is_an_error_not_a_signal(tmp_path, rewrite):
    """A file truncated in place between two load parts: reading its mapped pages past the new end
    would be a SIGBUS, which kills the process."""
    file = tmp_path / "model.gguf"
    write_layer(file, Q8)
    reader = GGUFLayerReader(file, 0, "GGUF")
    reader.read(range(2))
    size = file.stat().st_size
    if rewrite == "truncated":
        os.truncate(file, size // 2)
    else:
        with open(file, "r+b") as f:
            f.seek(size - 64)
            f.write(bytes(64))
        stat = file.stat()
        os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a coarse clock's same tick
    with pytest.raises(
        CheckpointError, match=rf"{file}: changed since it was opened.*'blk.0.ffn_gate_exps.weight'"
    ):
        reader.read(range(2, 4))


@pytest.mark.parametrize("type_name", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("method", ["GGUF", "LLAMAFILE"])
def test_method_gguf_reads_float_experts_as_bf16(tmp_path, type_name, method):
    """A GGUF file read with method GGUF (upstream's LLAMAFILE) loads whatever its experts are: float
    ones are held as BF16 (a warning where F16/F32 round), as method BF16 holds them."""
    p = make_problem(6, 2, 64, 96, tokens=9, seed=7)
    write_problem(tmp_path / "model.gguf", p, type_name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moe = moe_wrapper(6, 2, 64, 96, weight_path=str(tmp_path / "model.gguf"), method=method)
        moe.load_weights()
    rounded = [w for w in caught if "holds float experts as bf16: it rounds" in str(w.message)]
    assert bool(rounded) == (type_name != "BF16")
    assert moe.weight_format == "BF16" and moe.method == method
    as_bf16 = moe_wrapper(6, 2, 64, 96, weight_path=str(tmp_path / "model.gguf"), method="BF16")
    as_bf16.load_weights()
    out = moe.forward(p.hidden, p.ids, p.weights)
    assert torch.equal(out, as_bf16.forward(p.hidden, p.ids, p.weights))
    if type_name == "BF16":  # the stored weights exactly
        reference_moe = moe_wrapper(6, 2, 64, 96)
        reference_moe.load_weights_from_tensors(p.gate.bfloat16(), p.up.bfloat16(), p.down.bfloat16())
        assert torch.equal(out, reference_moe.forward(p.hidden, p.ids, p.weights))


E, K, H, I = 16, 2, 256, 128
MXFP4_BLOCK = 17  # an E8M0 exponent, then 16 bytes of E2M1 pairs


def mxfp4_layer(odd_block: str) -> dict[str, np.ndarray]:
    """A valid MXFP4 layer [E, N, K/32 * 17] of exponents 120..123 (their scales factor as int8
    multiples in every part), but for one block of expert 15's gate: all zero (exponent 0, as ggml
    writes a zero block) or 2^8 larger than its row's largest."""
    rng = np.random.default_rng(15)
    layer = {}
    for name, (rows, k) in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items():
        blocks = rng.integers(0, 256, (E, rows, k // 32, MXFP4_BLOCK), dtype=np.uint8)
        blocks[..., 0] = rng.integers(120, 124, (E, rows, k // 32))
        layer[name] = blocks
    odd = layer["gate"][E - 1, 5, 3]
    if odd_block == "all-zero":
        odd[:] = 0
    else:
        odd[0] = 123 + 8
    return {name: blocks.reshape(E, blocks.shape[1], -1) for name, blocks in layer.items()}


@pytest.mark.parametrize("odd_block", ["all-zero", "2^8 larger"])
def test_a_valid_mxfp4_layer_loads_whatever_expert_comes_first(tmp_path, odd_block):
    """16 parts of one expert each (experts.LOAD_PARTS): the first part's experts factor, expert 15's
    do not; the layer is held as one load of it would be and runs within 0.5 % of fp64, also when
    skip_gpu_expert_cpu_copy hands expert 15 back to the CPU during serving."""
    file = tmp_path / "model.gguf"
    stored = write_layer(file, {n: ("MXFP4", b) for n, b in mxfp4_layer(odd_block).items()}, experts=E,
                         hidden=H, inter=I)  # fmt: skip
    weights = [torch.from_numpy(stored[name].astype(np.float64)) for name in ("gate", "up", "down")]
    tensors = GGUFLayerReader(file, 0, "GGUF").read(E)
    whole = moe_wrapper(E, K, H, I, method="GGUF")
    whole.load_weights_from_tensors(
        tensors["gate"], tensors["up"], tensors["down"],
        gate_scale=tensors["gate_scale"], up_scale=tensors["up_scale"], down_scale=tensors["down_scale"],
    )  # fmt: skip
    in_parts = moe_wrapper(E, K, H, I, method="GGUF", weight_path=str(file))
    in_parts.load_weights()
    on_gpu = torch.arange(E) == E - 1
    handed_back = moe_wrapper(E, K, H, I, method="GGUF", weight_path=str(file), gpu_experts_mask=on_gpu,
                              skip_gpu_expert_cpu_copy=True)  # fmt: skip
    handed_back.load_weights()
    handed_back.gpu_experts_mask = torch.zeros(E, dtype=torch.bool)  # expert 15 to the CPU: read now
    p = make_problem(E, K, H, I, tokens=24, seed=8)
    ids = p.ids.clone()
    ids[:, 0] = E - 1  # every token through expert 15 (its odd block's row)
    ids[:, 1] = torch.where(ids[:, 1] == E - 1, 0, ids[:, 1])
    ref = reference(weights, p.hidden, ids, p.weights)
    out = whole.forward(p.hidden, ids, p.weights)
    assert relative_error(out, ref) < BOUND
    assert torch.equal(in_parts.forward(p.hidden, ids, p.weights), out)
    assert torch.equal(handed_back.forward(p.hidden, ids, p.weights), out)
