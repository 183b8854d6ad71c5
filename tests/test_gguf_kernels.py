"""The GGUF format: int8 values with a (scale, min) pair per 16 or 32 inputs, w = q * scale + min,
the way kt_kernel.gguf_blocks holds llama.cpp's block types. Random canonical tensors over the whole
int8 range, mins of both signs (K-quants' mins are negative) and scales of several magnitudes, against
fp64 on the weights as stored, outlier activations included, on every build and path (test_variants)."""

from __future__ import annotations

import pytest
import torch
from test_accuracy import BOUND, activations, reference, relative_error, routing

from kt_kernel import formats
from kt_kernel.held_bytes import GgufLayout, projection_bytes

from moe_reference import moe_wrapper

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 256, 96


def gguf_tensor(
    experts: int, rows: int, k: int, group: int, g: torch.Generator, mins: bool = True, factored: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random values [E, rows, k] (-128..127) and (scale, min) pairs [E, rows, 2k/group]: the
    scales spread over 2^-4..2^4 of 2^-10 per row, the mins up to 40 scales either way (a K-quant's
    min can be as large as its values' range). Factored: as the K-quants store them, every scale
    and min an int8 multiple of one fp16 per 256 inputs (the engine then holds them so: int8
    multiples of fp16 factors)."""
    values = torch.randint(-128, 128, (experts, rows, k), generator=g, dtype=torch.int8)
    shape = (experts, rows, k // group)
    if factored:
        per_block = 256 // group
        blocks = (experts, rows, -(-k // 256))
        sign = torch.randint(0, 2, blocks, generator=g) * 2 - 1  # either sign: a 0 multiple is -0.0 or +0.0
        unit = (torch.exp2(torch.randint(-14, -9, blocks, generator=g).float()) * 1.3 * sign).half()
        unit = unit.float().repeat_interleave(per_block, dim=-1)[..., : k // group]
        scale = unit * torch.randint(-128, 128, shape, generator=g)
        min_unit = (unit * 0.3).half().float()
        minimum = min_unit * torch.randint(-128, 128, shape, generator=g) if mins else torch.zeros(shape)
    else:
        exponent = torch.randint(-14, -5, shape, generator=g).float()
        scale = torch.exp2(exponent) * (1 + torch.rand(shape, generator=g))
        minimum = scale * 40 * (2 * torch.rand(shape, generator=g) - 1) if mins else torch.zeros(shape)
    return values, torch.stack([scale, minimum], dim=-1).reshape(experts, rows, -1)


def held_bytes(
    rows: int,
    k: int,
    group: int,
    value_bits: int,
    factored: bool,
    mins: bool,
    e4m3: bool = False,
    half: bool = False,
    multiple_bits: int = 8,
) -> int:
    """The bytes of one packed matrix in the layout given (kt_kernel.held_bytes, src/core/kernels.h):
    values in value_bits bits (8: bytes, 4: indices, 5 or 6: value planes); ``half``, fp16 scales or
    (factored) factors."""
    halfs = (half and not factored, half and factored)
    return projection_bytes(
        "GGUF", 1, rows, k, group, layout=GgufLayout(value_bits, factored, mins, e4m3, *halfs, multiple_bits)
    )


def decoded(values: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    pairs = pairs.double().reshape(*pairs.shape[:-1], -1, 2)
    group = values.shape[-1] // pairs.shape[-2]
    blocks = values.double().reshape(*pairs.shape[:-1], group)
    return (blocks * pairs[..., :1] + pairs[..., 1:]).reshape(values.shape)


def problem(groups: tuple[int, int], mins: bool, seed: int = 0, factored: bool = False):
    g = torch.Generator().manual_seed(seed)
    gate_up_group, down_group = groups
    gate = gguf_tensor(EXPERTS, INTER, HIDDEN, gate_up_group, g, mins, factored)
    up = gguf_tensor(EXPERTS, INTER, HIDDEN, gate_up_group, g, mins, factored)
    down = gguf_tensor(EXPERTS, HIDDEN, INTER, down_group, g, mins, factored)
    return gate, up, down


def loaded(gate, up, down, **wrapper):
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="GGUF", **wrapper)
    moe.load_weights_from_tensors(
        gate[0], up[0], down[0], gate_scale=gate[1], up_scale=up[1], down_scale=down[1]
    )
    return moe


def error_of(gate, up, down, tokens: int) -> float:
    """The relative error of a forward on the tensors against fp64, 4 channels x 100."""
    x = activations(tokens, HIDDEN, 100)
    ids, weights = routing(tokens, EXPERTS, TOP_K, hot=True)
    ref = reference([decoded(*gate), decoded(*up), decoded(*down)], x, ids, weights)
    return relative_error(loaded(gate, up, down).forward(x, ids, weights), ref)


@pytest.mark.parametrize("groups", [(32, 16), (16, 32), (32, 32)], ids=["32-16", "16-32", "32-32"])
@pytest.mark.parametrize("mins", [True, False], ids=["mins", "no-mins"])
@pytest.mark.parametrize("factored", [False, True], ids=["fp32-scales", "factored"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_within_half_a_percent_of_fp64_on_the_stored_weights(groups, mins, factored, tokens):
    error = error_of(*problem(groups, mins, factored=factored), tokens)
    assert error < BOUND, f"relative error {error:.4%}"


def test_a_missing_min_term_would_be_seen():
    """The mins carry real weight: dropping them moves the output far past the bound."""
    gate, up, down = problem((32, 16), True, seed=1)
    moe = loaded(gate, up, down)
    x = activations(16, HIDDEN, 100)
    ids, weights = routing(16, EXPERTS, TOP_K, hot=True)

    def without_mins(t):
        pairs = t[1].reshape(*t[1].shape[:-1], -1, 2).clone()
        pairs[..., 1] = 0
        return decoded(t[0], pairs.reshape(t[1].shape))

    wrong = reference([without_mins(gate), without_mins(up), without_mins(down)], x, ids, weights)
    right = reference([decoded(*gate), decoded(*up), decoded(*down)], x, ids, weights)
    out = moe.forward(x, ids, weights)
    assert relative_error(out, right) < BOUND
    assert relative_error(wrong, right) > 10 * BOUND


def test_int8_activations_stay_the_opt_in_lossy_mode():
    gate, up, down = problem((32, 16), True, seed=2)
    x = activations(24, HIDDEN, 100)
    ids, weights = routing(24, EXPERTS, TOP_K, hot=True)
    ref = reference([decoded(*gate), decoded(*up), decoded(*down)], x, ids, weights)
    exact = relative_error(loaded(gate, up, down).forward(x, ids, weights), ref)
    fast = relative_error(loaded(gate, up, down, int8_activations=True).forward(x, ids, weights), ref)
    assert exact < BOUND < fast < 0.5


def test_quantize_and_dequantize():
    """dequantize is q * scale + min (to fp32 rounding); quantize gives symmetric groups, min 0."""
    gate, _, _ = problem((16, 16), True, seed=3)
    torch.testing.assert_close(formats.GGUF.dequantize(*gate).double(), decoded(*gate), rtol=1e-6, atol=1e-7)
    values, pairs = formats.GGUF.quantize(torch.randn(4, 64, 96))
    assert values.dtype == torch.int8 and pairs.shape == (4, 64, 6)
    assert torch.equal(pairs.reshape(4, 64, 3, 2)[..., 1], torch.zeros(4, 64, 3))


@pytest.mark.parametrize(
    ("scale_shape", "message"),
    [((EXPERTS, INTER, 17), "2K/G"), ((EXPERTS, INTER, HIDDEN // 32), "group size 64")],
)
def test_scales_of_another_shape_are_refused(scale_shape, message):
    gate, up, down = problem((32, 32), True, seed=4)
    bad = torch.ones(scale_shape)
    moe = moe_wrapper(EXPERTS, TOP_K, HIDDEN, INTER, method="GGUF")
    with pytest.raises(ValueError, match=message):
        moe.load_weights_from_tensors(
            gate[0], up[0], down[0], gate_scale=bad, up_scale=up[1], down_scale=down[1]
        )


#: The 16 levels of the 4-bit ggml types (the engine's catalog, src/core/formats/gguf.cpp).
LEVELS = {
    "0..15": list(range(16)),
    "-8..7": list(range(-8, 8)),
    "e2m1x2": [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
    "iq4": [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
}


def on_levels(t: tuple[torch.Tensor, torch.Tensor], levels: list[int], g: torch.Generator):
    """t with every value replaced by one of `levels`."""
    index = torch.randint(0, len(levels), t[0].shape, generator=g)
    return torch.tensor(levels, dtype=torch.int8)[index], t[1]


def engine_bytes(gate, up, down) -> int:
    """The packed bytes of an engine loaded with the tensors (the same shape every time)."""
    from kt_kernel._native import ext

    engine = ext.MoEEngine(EXPERTS, TOP_K, HIDDEN, INTER, "GGUF", 1, [])
    engine.load(gate[0], gate[1], up[0], up[1], down[0], down[1], torch.arange(EXPERTS))
    return engine.packed_bytes()


def expected_bytes(groups: tuple[int, int], value_bits: int, factored: bool, mins: bool) -> int:
    """An engine's bytes (held_bytes) where gate and up are held alike and down as bytes; factored
    scales (gguf_tensor's) as int8 multiples of fp16 factors."""
    gate_up = held_bytes(INTER, HIDDEN, groups[0], value_bits, factored, mins, half=factored)
    down = held_bytes(HIDDEN, INTER, groups[1], 8, factored, mins, half=factored)
    return EXPERTS * (2 * gate_up + down)


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_values_of_16_levels_are_held_as_4_bit_indices(levels, tokens):
    """Projections whose values are 16 levels (the 4-bit ggml types) are held as 4-bit indices,
    exactly: half the bytes of their values; one of bytes beside them (Q6_K's down) stays bytes."""
    g = torch.Generator().manual_seed(5)
    gate, up, down = problem((32, 16), True, seed=5)
    gate, up = on_levels(gate, LEVELS[levels], g), on_levels(up, LEVELS[levels], g)
    error = error_of(gate, up, down, tokens)
    assert error < BOUND, f"relative error {error:.4%}"
    assert engine_bytes(gate, up, down) == expected_bytes((32, 16), 4, False, True)
    assert engine_bytes(*problem((32, 16), True, seed=5)) == expected_bytes((32, 16), 8, False, True)


@pytest.mark.parametrize("groups", [(32, 16), (16, 32)], ids=["32-16", "16-32"])
@pytest.mark.parametrize("mins", [True, False], ids=["mins", "no-mins"])
@pytest.mark.parametrize("factored", [False, True], ids=["fp32-scales", "factored"])
def test_scales_are_factored_and_mins_left_out_where_the_data_allows(groups, mins, factored):
    """Scales that are int8 multiples of one float per 256 inputs (the K-quants') are held so, and
    mins that are all 0 are not held: fewer bytes, the same canonical tensors back (exactly)."""
    tensors = problem(groups, mins, seed=8, factored=factored)
    assert engine_bytes(*tensors) == expected_bytes(groups, 8, factored, mins)
    for name in ("gate", "down"):
        values, pairs = tensors[("gate", "up", "down").index(name)]
        assert same_bits(unpacked(tensors, name, 0, values.shape[-1])[1], pairs[3, 16:32])
    if factored:  # one scale in one block off the grid of its block: every scale held as fp32
        gate, pairs = tensors[0]
        off = pairs.clone()
        off[0, 0, 0] *= 1 + 2.0**-20
        assert engine_bytes((gate, off), *tensors[1:]) == expected_bytes(
            groups, 8, factored, mins
        ) + EXPERTS * (
            held_bytes(INTER, HIDDEN, groups[0], 8, False, mins)
            - held_bytes(INTER, HIDDEN, groups[0], 8, True, mins, half=True)
        )


def in_window(t: tuple[torch.Tensor, torch.Tensor], lowest: int, span: int, g: torch.Generator):
    """t with its values drawn from the span integers from lowest on, both ends among them."""
    values = torch.randint(lowest, lowest + span, t[0].shape, generator=g, dtype=torch.int16)
    values.view(-1)[:2] = torch.tensor([lowest, lowest + span - 1])
    return values.to(torch.int8), t[1]


def plane_bits(span: int, group: int) -> int:
    """The bits the engine holds values of `span` consecutive integers in (none of its level sets)."""
    if span <= 8:
        return 2 if span <= 4 else 3
    return 5 if span <= 32 and group % 32 == 0 else 6 if span <= 64 else 8


@pytest.mark.parametrize("span", [4, 5, 8, 9, 32, 33, 64, 65])
@pytest.mark.parametrize("end", ["-128 up", "127 down"])
def test_values_of_a_few_integers_are_held_in_value_planes(span, end):
    """Values within 4 or 8 integers are held in 2- or 3-bit planes, within 32 in 5-bit planes (where
    a scale group is whole 32s; else 6), within 64 in 6-bit planes, any more as bytes: the int8
    range's ends included, the forward within the bound, the values and pairs written back as
    loaded."""
    g = torch.Generator().manual_seed(span)
    lowest = -128 if end == "-128 up" else 128 - span
    tensors = [in_window(t, lowest, span, g) for t in problem((32, 16), True, seed=10)]
    gate_up = held_bytes(INTER, HIDDEN, 32, plane_bits(span, 32), False, True)
    assert engine_bytes(*tensors) == EXPERTS * (
        2 * gate_up + held_bytes(HIDDEN, INTER, 16, plane_bits(span, 16), False, True)
    )
    for tokens in (1, 24):
        error = error_of(*tensors, tokens)
        assert error < BOUND, f"{tokens} tokens: relative error {error:.4%}"
    assert_written_back(tensors, (("gate", 32, 160), ("down", 16, 64)))


# Exact: the channels at -255/256 of the largest give an int8 row at -127 and a residual near 127;
# int8_activations: -1 is exactly -127 (its loss elsewhere: test_int8_activations_stay_...).
@pytest.mark.parametrize("int8_activations, fill", [(False, -255 / 256), (True, -1.0)], ids=["exact", "int8"])
def test_value_planes_at_their_largest_on_the_largest_activations(int8_activations, fill):
    """6-bit planes whose values are all 63 above the lowest, on a token whose int8 row (and
    residual) sit near -127: a line's products reach 4 x 63 x 127, which an int16 lane just holds;
    two lines' would not."""
    g = torch.Generator().manual_seed(6)
    tensors = []
    for t in problem((32, 16), False, seed=11):
        values = torch.full_like(t[0], -128 + 63)
        values.view(-1)[0] = -128  # the window's other end: 64 integers, 6-bit planes
        tensors.append((values, t[1].abs()))
    tensors[2] = in_window(tensors[2], -128, 64, g)
    assert engine_bytes(*tensors) == EXPERTS * (
        2 * held_bytes(INTER, HIDDEN, 32, 6, False, False) + held_bytes(HIDDEN, INTER, 16, 6, False, False)
    )
    x = torch.full((1, HIDDEN), fill)
    x[0, 0] = 1.0  # the row's largest: its scale is 1 / 127
    ids, weights = routing(1, EXPERTS, TOP_K, hot=True)
    ref = reference([decoded(*t) for t in tensors], x, ids, weights)
    moe = loaded(*tensors, int8_activations=int8_activations)
    error = relative_error(moe.forward(x, ids, weights), ref)
    assert error < BOUND, f"relative error {error:.4%}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (-0.0 is not +0.0): what the write-back must give back."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("zeros", ["-0", "+0 and -0"])
def test_a_block_of_zero_scales_comes_back_with_its_signs(zeros):
    """A block whose scales are all zeros stays factored where they share a sign (the factor is
    that zero), and falls back to fp32 scales where they do not: bit for bit either way."""
    tensors = list(problem((32, 32), True, seed=9, factored=True))
    values, pairs = tensors[0]
    pairs = pairs.clone()
    block = pairs[3, 16, 0:16:2]  # row 16's first 8 scales (256 inputs)
    block[:] = -0.0
    if zeros == "+0 and -0":
        block[1] = 0.0
    tensors[0] = (values, pairs)
    factored = zeros == "-0"
    gate_up = [held_bytes(INTER, HIDDEN, 32, 8, f, True, half=f) for f in (factored, True)]
    assert engine_bytes(*tensors) == EXPERTS * (
        gate_up[0] + gate_up[1] + held_bytes(HIDDEN, INTER, 32, 8, True, True, half=True)
    )
    assert same_bits(unpacked(tensors, "gate", 0, HIDDEN)[1], pairs[3, 16:32])


def unpacked(tensors, name: str, k0: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 16..31 of expert 3's `name` projection, inputs [k0, k0 + cols), as MoEEngine.unpack
    gives them back (what the GPU write-back reads): values and (scale, min) pairs."""
    from kt_kernel._native import ext

    gate, up, down = tensors
    engine = ext.MoEEngine(EXPERTS, TOP_K, HIDDEN, INTER, "GGUF", 1, [])
    engine.load(gate[0], gate[1], up[0], up[1], down[0], down[1], torch.arange(EXPERTS))
    values, pairs = tensors[("gate", "up", "down").index(name)]
    group = 2 * values.shape[-1] // pairs.shape[-1]
    out_values = torch.empty(16, cols, dtype=torch.int8)
    out_pairs = torch.empty(16, 2 * cols // group)
    engine.unpack(
        name, 3, 16, 16, k0, cols, out_values.data_ptr(), cols, out_pairs.data_ptr(), out_pairs.shape[1] * 4
    )
    return out_values, out_pairs


def assert_written_back(tensors, regions) -> None:
    """Each region (projection, k0, cols) of rows 16..31 of expert 3 unpacked as loaded, bit for bit."""
    for name, k0, cols in regions:
        values, pairs = tensors[("gate", "up", "down").index(name)]
        group = 2 * values.shape[-1] // pairs.shape[-1]
        out_values, out_pairs = unpacked(tensors, name, k0, cols)
        assert torch.equal(out_values, values[3, 16:32, k0 : k0 + cols])
        assert same_bits(out_pairs, pairs[3, 16:32, 2 * k0 // group : 2 * (k0 + cols) // group])


def first_part_then(engine, tensors, later) -> None:
    """Loads the first half of the experts from `tensors`, then the rest from `later`."""
    first, rest = torch.arange(EXPERTS) < EXPERTS // 2, torch.arange(EXPERTS) >= EXPERTS // 2
    engine.load(*tensors, torch.where(first, torch.arange(EXPERTS), -1))
    engine.load(*later, torch.where(rest, torch.arange(EXPERTS), -1))


@pytest.mark.parametrize("misfit", ["value off the levels", "scale off the factors", "a min where none were"])
def test_a_later_part_that_does_not_fit_how_the_first_is_held_is_held_anew(misfit):
    """A load in parts (load_weights) holds a projection as the parts so far allow: a later part that
    does not fit (another value, a scale off the grid, a min) is not refused but holds the projection
    anew, as one load of the whole layer holds it, every expert exactly as loaded: whether a valid
    layer loads never depends on which experts come first."""
    from kt_kernel._native import ext

    g = torch.Generator().manual_seed(6)
    mins = misfit != "a min where none were"
    tensors = [
        t for p in problem((32, 32), mins, seed=6, factored=True) for t in on_levels(p, LEVELS["0..15"], g)
    ]
    other = [t.clone() for t in tensors]
    if misfit == "value off the levels":
        other[0][EXPERTS - 1, 0, 0] = -1  # not one of 0..15
    elif misfit == "scale off the factors":
        other[1][EXPERTS - 1, 0, 0] *= 1 + 2.0**-20
    else:
        other[1][EXPERTS - 1, 0, 1] = 1.0
    engine = ext.MoEEngine(EXPERTS, TOP_K, HIDDEN, INTER, "GGUF", 1, [])
    first_part_then(engine, tensors, other)
    as_loaded = [
        torch.cat([t[: EXPERTS // 2], o[EXPERTS // 2 :]]) for t, o in zip(tensors, other, strict=True)
    ]
    whole = ext.MoEEngine(EXPERTS, TOP_K, HIDDEN, INTER, "GGUF", 1, [])
    whole.load(*as_loaded, torch.arange(EXPERTS))
    fitting = EXPERTS * (
        2 * held_bytes(INTER, HIDDEN, 32, 4, True, mins, half=True)
        + held_bytes(HIDDEN, INTER, 32, 4, True, mins, half=True)
    )
    assert engine.packed_bytes() == whole.packed_bytes() > fitting  # gate held as the whole layer needs
    for expert in (0, EXPERTS // 2 - 1, EXPERTS - 1):
        values, pairs = torch.empty(INTER, HIDDEN, dtype=torch.int8), torch.empty(INTER, 2 * HIDDEN // 32)
        engine.unpack("gate", expert, 0, INTER, 0, HIDDEN, values.data_ptr(), HIDDEN, pairs.data_ptr(),
                      pairs.shape[1] * 4)  # fmt: skip
        assert torch.equal(values, as_loaded[0][expert]) and same_bits(pairs, as_loaded[1][expert]), expert
    engine.unload()  # a new load in parts, of parts that fit: held as the first part allows
    first_part_then(engine, tensors, tensors)
    assert engine.packed_bytes() == fitting


@pytest.mark.parametrize("factored", [False, True], ids=["fp32-scales", "factored"])
@pytest.mark.parametrize("levels", ["iq4", "-8..7"])
def test_unpack_gives_back_the_canonical_tensors(levels, factored):
    """What the GPU write-back reads (MoEEngine.unpack): values and (scale, min) pairs as loaded, from
    4-bit indices and from bytes, fp32 and factored scales alike."""
    g = torch.Generator().manual_seed(7)
    gate, up, down = problem((32, 16), True, seed=7, factored=factored)
    tensors = (on_levels(gate, LEVELS[levels], g), up, down)  # indices; up and down stay bytes
    assert_written_back(tensors, (("gate", 64, 128), ("down", 32, 64)))


def test_the_level_sets_of_the_engine_are_those_the_block_decoders_give():
    """One source: the engine's GGUF level sets (formats/gguf_levels.h, exported) hold the values
    every 4-bit ggml type decodes to (gguf_blocks.py)."""
    from kt_kernel._native import ext
    from kt_kernel.gguf_blocks import E2M1_DOUBLED, IQ4_LEVELS

    sets = [sorted(s) for s in ext.GGUF_LEVEL_SETS]
    assert sorted(IQ4_LEVELS.tolist()) in sets
    assert sorted(E2M1_DOUBLED.tolist()) in sets
    assert list(range(16)) in sets and list(range(-8, 8)) in sets  # Q4_1/Q4_K/Q2_K's and Q4_0/Q3_K's
