"""GGUF's scales held in no more bytes than the file's (kernels.h): fp16 scales and mins (Q4_0, Q8_0,
Q4_1, IQ4_NL), 6-bit multiples of fp16 factors (Q4_K, Q5_K, IQ4_XS, Q2_K, Q3_K), int8 multiples of
fp16 factors (Q6_K), each chosen by the data at load where exact, else the fp32 layouts: every case
within 0.5 % of fp64 and written back bit for bit."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from test_accuracy import BOUND, activations, reference, relative_error, routing

pytest.importorskip("gguf")

from test_gguf_accuracy import realistic_blocks, run_layer  # noqa: E402
from test_gguf_file import KNOWN_TYPES, write_layer  # noqa: E402
from test_gguf_kernels import decoded, same_bits  # noqa: E402

from kt_kernel.gguf_blocks import BLOCK_TYPES, convert_rows  # noqa: E402
from kt_kernel.held_bytes import GgufLayout, projection_bytes  # noqa: E402

from moe_reference import moe_wrapper  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 4, 2, 512, 256
NAMES = ("gate", "up", "down")
SHAPES = {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
#: Scale bytes per 256 inputs of a row: Q6_K's int8 per 16 and an fp16; Q5_K's 6-bit scale and min per
#: 32 and two fp16.
SCALE_BYTES_PER_256 = {"Q6_K": 18, "Q5_K": 16}


def canonical(type_name: str, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Realistic blocks of each projection as the canonical (values, pairs), [EXPERTS, rows, ...]."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, (rows, k) in SHAPES.items():
        raw = realistic_blocks(type_name, EXPERTS * rows, k, rng)
        values, pairs = convert_rows(type_name, raw)
        tensors[name] = (
            torch.from_numpy(values).reshape(EXPERTS, rows, k),
            torch.from_numpy(pairs).reshape(EXPERTS, rows, -1),
        )
    return tensors


def file_bytes(type_name: str) -> int:
    block = BLOCK_TYPES[type_name]
    return sum(EXPERTS * rows * k // block.block_inputs * block.block_bytes for rows, k in SHAPES.values())


def check(tensors: dict[str, tuple[torch.Tensor, torch.Tensor]], tokens: int = 5) -> int:
    """Loads the tensors, checks the forward against fp64 and the write-back bit for bit, and gives
    the engine's packed bytes."""
    from kt_kernel._native import ext

    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="GGUF")
    gate, up, down = (tensors[n] for n in NAMES)
    moe.load_weights_from_tensors(
        gate[0], up[0], down[0], gate_scale=gate[1], up_scale=up[1], down_scale=down[1]
    )
    x = activations(tokens, HIDDEN, 100)
    ids, weights = routing(tokens, EXPERTS, TOP_K, hot=True)
    ref = reference([decoded(*tensors[n]) for n in NAMES], x, ids, weights)
    error = relative_error(moe.forward(x, ids, weights), ref)
    assert error < BOUND, f"relative error {error:.4%}"
    engine = ext.MoEEngine(EXPERTS, TOP_K, HIDDEN, INTER, "GGUF", 1, [])
    engine.load(gate[0], gate[1], up[0], up[1], down[0], down[1], torch.arange(EXPERTS))
    for name in NAMES:
        values, pairs = tensors[name]
        rows, k = SHAPES[name]
        for expert in range(EXPERTS):
            out_values = torch.empty(rows, k, dtype=torch.int8)
            out_pairs = torch.empty(rows, pairs.shape[-1])
            engine.unpack(name, expert, 0, rows, 0, k, out_values.data_ptr(), k, out_pairs.data_ptr(),
                          pairs.shape[-1] * 4)  # fmt: skip
            assert torch.equal(out_values, values[expert]), (name, expert)
            assert same_bits(out_pairs, pairs[expert]), (name, expert)
    held = engine.packed_bytes()
    assert sum(sp.engine.packed_bytes() for sp in moe._subpools) == held
    return held


def layout_bytes(type_name: str, **layout) -> int:
    """The bytes of the three projections of type_name in the layout given (kt_kernel.held_bytes)."""
    block = BLOCK_TYPES[type_name]
    held = GgufLayout(block.held_bits, layout.pop("factored", False), block.mins, **layout)
    return sum(projection_bytes("GGUF", EXPERTS, r, k, block.group, layout=held) for r, k in SHAPES.values())


def value_bytes(type_name: str) -> int:
    return sum(EXPERTS * rows * k for rows, k in SHAPES.values()) * BLOCK_TYPES[type_name].held_bits // 8


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q4_1", "IQ4_NL", "Q5_0", "Q5_1"])
def test_fp16_scales_are_held_as_fp16(type_name):
    held = check(canonical(type_name, 1))
    assert held == layout_bytes(type_name, half_scales=True)
    assert held <= file_bytes(type_name)


@pytest.mark.parametrize("type_name", ["Q4_K", "IQ4_XS", "Q5_K", "Q2_K", "Q3_K", "Q6_K"])
def test_k_quant_scales_are_small_multiples_of_fp16_factors(type_name):
    held = check(canonical(type_name, 2))
    bits = BLOCK_TYPES[type_name].multiple_bits
    assert held == layout_bytes(type_name, factored=True, half_factors=True, multiple_bits=bits)
    assert held <= file_bytes(type_name)
    if type_name in SCALE_BYTES_PER_256:
        inputs = sum(EXPERTS * rows * k for rows, k in SHAPES.values())
        assert held - value_bytes(type_name) <= inputs // 256 * SCALE_BYTES_PER_256[type_name]


def test_every_type_is_held_in_its_file_bytes_per_weight():
    """The bytes per weight the layouts give, as gguf_blocks tells them (info --memory): each type's
    file's, but MXFP4's and NVFP4's blocks (E4M3 layouts: their fp32 per matrix on top, checked from
    a file below)."""
    held = {name: b.held_bytes_per_weight() for name, b in BLOCK_TYPES.items() if b.factored is not None}
    assert set(held) == set(BLOCK_TYPES) - {"MXFP4", "NVFP4"}
    assert held == {name: BLOCK_TYPES[name].block_bytes / BLOCK_TYPES[name].block_inputs for name in held}


def test_a_scale_not_an_fp16_is_held_as_fp32():
    tensors = canonical("Q4_0", 3)
    values, pairs = tensors["gate"]
    pairs = pairs.clone()
    pairs[1, 7, 4] *= 1 + 2.0**-20  # a scale off fp16's grid
    tensors["gate"] = (values, pairs)
    held = check(tensors)
    fp32, half = (
        projection_bytes(
            "GGUF", EXPERTS, INTER, HIDDEN, 32, layout=GgufLayout(4, False, False, half_scales=h)
        )
        for h in (False, True)
    )
    assert held == layout_bytes("Q4_0", half_scales=True) + fp32 - half


def test_small_mins_stay_exact_in_fp16():
    """Q4_1's mins of fp16 subnormal size: held as themselves in fp16 (min / 128 would lose bits)."""
    tensors = canonical("Q4_1", 4)
    for name in NAMES:
        values, pairs = tensors[name]
        pairs = pairs.clone()
        pairs[..., 1::2] = (pairs[..., 1::2] * 2.0**-12).half().float()  # subnormal fp16 mins
        tensors[name] = (values, pairs)
    assert check(tensors) == layout_bytes("Q4_1", half_scales=True)


def gate_block_scales(tensors, group: int = 32, expert: int = 1, row: int = 5) -> torch.Tensor:
    """A writable view of the gate's first block of scales (256 / group) of one row."""
    values, pairs = tensors["gate"]
    pairs = pairs.clone()
    tensors["gate"] = (values, pairs)
    return pairs[expert, row, 0 : 2 * 256 // group : 2]


def gate_bytes(type_name: str = "Q4_K", **layout) -> int:
    """A gate of type_name in the (factored) layout given."""
    block = BLOCK_TYPES[type_name]
    held = GgufLayout(block.held_bits, True, block.mins, **layout)
    return projection_bytes("GGUF", EXPERTS, INTER, HIDDEN, block.group, layout=held)


SIX_BITS = {"half_factors": True, "multiple_bits": 6}


def test_a_multiple_past_6_bits_is_held_as_int8():
    tensors = canonical("Q4_K", 5)
    scales = gate_block_scales(tensors)
    scales[:] = torch.tensor([100, 1, 2, 3, 4, 5, 6, 7]) * 2.0**-8  # 100: an int8 multiple of 2^-8 only
    held = check(tensors)
    int8 = gate_bytes(half_factors=True, multiple_bits=8)
    assert held == layout_bytes("Q4_K", factored=True, **SIX_BITS) + int8 - gate_bytes(**SIX_BITS)


def test_a_factor_not_an_fp16_keeps_6_bits_with_fp32_factors():
    tensors = canonical("Q4_K", 6)
    scales = gate_block_scales(tensors)
    scales[:] = torch.arange(1, 9) * 2.0**-30  # a factor below fp16's least subnormal
    held = check(tensors)
    fp32 = gate_bytes(half_factors=False, multiple_bits=6)
    assert held == layout_bytes("Q4_K", factored=True, **SIX_BITS) + fp32 - gate_bytes(**SIX_BITS)


def test_a_factor_not_an_fp16_with_int8_multiples_keeps_the_fp32_layout():
    """Q6_K's block of a factor below fp16 and a multiple past 6 bits: fp32 factors first, padded."""
    tensors = canonical("Q6_K", 7)
    scales = gate_block_scales(tensors, group=16)
    scales[:] = torch.tensor([100, *range(-7, 8)]) * 2.0**-30
    held = check(tensors)
    halfs = {"half_factors": True, "multiple_bits": 8}
    fp32 = gate_bytes("Q6_K", half_factors=False, multiple_bits=8)
    assert held == layout_bytes("Q6_K", factored=True, **halfs) + fp32 - gate_bytes("Q6_K", **halfs)


@pytest.mark.parametrize("type_name", ["Q4_K", "IQ4_XS", "Q4_1", "Q6_K"])
def test_a_saved_engine_maps_back_every_field(tmp_path, type_name):
    """The packed file keeps the layout's fields (6-bit multiples and their bias, fp16 scales and
    factors): the mapped engine gives the loaded tensors back bit for bit."""
    from kt_kernel._native import ext

    tensors = canonical(type_name, 8)
    packed = ext.MoEEngine(EXPERTS, TOP_K, HIDDEN, INTER, "GGUF", 1, [])
    packed.load(*(t for name in NAMES for t in tensors[name]), torch.arange(EXPERTS))
    path = str(tmp_path / "engine.ktpacked")
    packed.save_packed(path, b"")
    view = ext.MoEEngine(EXPERTS, TOP_K, HIDDEN, INTER, "GGUF", 1, [])
    assert view.map_packed(path, True) == ("", b"") and view.mapped
    assert view.packed_bytes() == packed.packed_bytes()
    for name in NAMES:
        values, pairs = tensors[name]
        rows, k = SHAPES[name]
        out_values, out_pairs = torch.empty(rows, k, dtype=torch.int8), torch.empty(rows, pairs.shape[-1])
        view.unpack(
            name, 2, 0, rows, 0, k, out_values.data_ptr(), k, out_pairs.data_ptr(), pairs.shape[-1] * 4
        )
        assert torch.equal(out_values, values[2]) and same_bits(out_pairs, pairs[2]), name


def held_from_a_file(path, type_name: str) -> int:
    """Writes a layer of type_name's realistic blocks (SHAPES, EXPERTS) to the GGUF file ``path``,
    loads it with load_weights and gives the engine's packed bytes."""
    rng = np.random.default_rng(list(BLOCK_TYPES).index(type_name))
    projections = {}
    for name, (rows, k) in SHAPES.items():
        blocks = realistic_blocks(type_name, EXPERTS * rows, k, rng).reshape(EXPERTS, rows, -1)
        projections[name] = (type_name, blocks)
    write_layer(path, projections, experts=EXPERTS, hidden=HIDDEN, inter=INTER)
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="GGUF", weight_path=str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no note of memory or rounding
        moe.load_weights()
    return sum(sp.engine.packed_bytes() for sp in moe._subpools)


@pytest.mark.parametrize("type_name", KNOWN_TYPES)
def test_every_type_from_a_file_is_held_in_at_most_its_bytes(tmp_path, type_name):
    """A layer read from a GGUF file (realistic blocks) holds at most the file's expert bytes; E4M3
    layouts (MXFP4's, NVFP4's blocks) add their fp32 per matrix, as NVFP4's per-tensor scalars."""
    held = held_from_a_file(tmp_path / "model.gguf", type_name)
    matrix_factors = 4 * EXPERTS * len(NAMES) if BLOCK_TYPES[type_name].factored is None else 0
    assert held <= file_bytes(type_name) + matrix_factors


#: The ggml types whose values span 4, 8, 32 or 64 integers: held in value planes of 2, 3, 5 or 6 bits
#: (kernels.h).
PLANAR = {"Q2_K": 2, "Q3_K": 3, "Q6_K": 6, "Q5_K": 5, "Q5_0": 5, "Q5_1": 5}


@pytest.mark.parametrize("type_name", PLANAR)
def test_planar_types_are_held_in_value_planes_exactly(tmp_path, type_name):
    """Q6_K's values (-32..31) in 6 bits, Q5_K's, Q5_0's and Q5_1's in 5, Q3_K's (-4..3) in 3 and
    Q2_K's (0..3) in 2, where bytes took 1 (packed_bytes() counts them), a forward within the bound
    of fp64 (from a file, and from tensors), and the write-back (MoEEngine.unpack) giving back the
    canonical tensors bit for bit."""
    block, bits = BLOCK_TYPES[type_name], PLANAR[type_name]
    assert block.held_bits == bits
    error = run_layer(tmp_path, dict.fromkeys(NAMES, type_name), HIDDEN, INTER, 5)
    assert error < BOUND, f"{type_name}: relative error {error:.4%}"
    factored = bool(block.factored)
    fp16 = {"half_factors": True, "multiple_bits": block.multiple_bits} if factored else {"half_scales": True}
    assert check(canonical(type_name, 60)) == layout_bytes(type_name, factored=factored, **fp16)
