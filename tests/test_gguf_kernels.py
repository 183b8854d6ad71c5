"""The GGUF format: int8 values with a (scale, min) pair per 16 or 32 inputs, w = q * scale + min,
the way kt_kernel.gguf_blocks holds llama.cpp's block types. Random canonical tensors over the whole
int8 range, mins of both signs (K-quants' mins are negative) and scales of several magnitudes, against
fp64 on the weights as stored, outlier activations included, on every build and path (test_variants)."""

from __future__ import annotations

import pytest
import torch
from test_accuracy import BOUND, activations, reference, relative_error, routing

from kt_kernel import formats

from moe_reference import moe_wrapper

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 256, 96


def gguf_tensor(
    experts: int, rows: int, k: int, group: int, g: torch.Generator, mins: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random values [E, rows, k] (-128..127) and (scale, min) pairs [E, rows, 2k/group]: the
    scales spread over 2^-4..2^4 of 2^-10 per row, the mins up to 40 scales either way (a K-quant's
    min can be as large as its values' range)."""
    values = torch.randint(-128, 128, (experts, rows, k), generator=g, dtype=torch.int8)
    shape = (experts, rows, k // group)
    exponent = torch.randint(-14, -5, shape, generator=g).float()
    scale = torch.exp2(exponent) * (1 + torch.rand(shape, generator=g))
    minimum = scale * 40 * (2 * torch.rand(shape, generator=g) - 1) if mins else torch.zeros(shape)
    return values, torch.stack([scale, minimum], dim=-1).reshape(experts, rows, -1)


def decoded(values: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    pairs = pairs.double().reshape(*pairs.shape[:-1], -1, 2)
    group = values.shape[-1] // pairs.shape[-2]
    blocks = values.double().reshape(*pairs.shape[:-1], group)
    return (blocks * pairs[..., :1] + pairs[..., 1:]).reshape(values.shape)


def problem(groups: tuple[int, int], mins: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate_up_group, down_group = groups
    gate = gguf_tensor(EXPERTS, INTER, HIDDEN, gate_up_group, g, mins)
    up = gguf_tensor(EXPERTS, INTER, HIDDEN, gate_up_group, g, mins)
    down = gguf_tensor(EXPERTS, HIDDEN, INTER, down_group, g, mins)
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
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_within_half_a_percent_of_fp64_on_the_stored_weights(groups, mins, tokens):
    error = error_of(*problem(groups, mins), tokens)
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
    indexed, as_bytes = engine_bytes(gate, up, down), engine_bytes(*problem((32, 16), True, seed=5))
    assert as_bytes - indexed == 2 * EXPERTS * INTER * HIDDEN // 2  # gate and up: 4 bits a value fewer


def test_a_part_with_values_outside_the_levels_of_the_first_is_refused():
    """A load in parts (load_weights) holds a projection as indices into the first part's levels: a
    later part with other values is refused, and the layer completes with values that fit."""
    from kt_kernel._native import ext

    g = torch.Generator().manual_seed(6)
    tensors = [t for p in problem((32, 32), True, seed=6) for t in on_levels(p, LEVELS["0..15"], g)]
    engine = ext.MoEEngine(EXPERTS, TOP_K, HIDDEN, INTER, "GGUF", 1, [])
    first, rest = torch.arange(EXPERTS) < EXPERTS // 2, torch.arange(EXPERTS) >= EXPERTS // 2
    engine.load(*tensors, torch.where(first, torch.arange(EXPERTS), -1))
    other = list(tensors)
    other[0] = other[0].clone()
    other[0][EXPERTS - 1, 0, 0] = -1  # not one of 0..15
    with pytest.raises(ValueError, match="only values the parts before it hold"):
        engine.load(*other, torch.where(rest, torch.arange(EXPERTS), -1))
    engine.load(*tensors, torch.where(rest, torch.arange(EXPERTS), -1))
    assert (
        engine.packed_bytes()
        == engine_bytes(*problem((32, 32), True, seed=6)) - 3 * EXPERTS * INTER * HIDDEN // 2
    )


@pytest.mark.parametrize("levels", ["iq4", "-8..7"])
def test_unpack_gives_back_the_canonical_tensors(levels):
    """What the GPU write-back reads (MoEEngine.unpack): values and (scale, min) pairs as loaded, from
    4-bit indices and from bytes alike."""
    from kt_kernel._native import ext

    g = torch.Generator().manual_seed(7)
    gate, up, down = problem((32, 16), True, seed=7)
    gate = on_levels(gate, LEVELS[levels], g)  # indices; up and down stay bytes
    engine = ext.MoEEngine(EXPERTS, TOP_K, HIDDEN, INTER, "GGUF", 1, [])
    engine.load(gate[0], gate[1], up[0], up[1], down[0], down[1], torch.arange(EXPERTS))
    for name, (values, pairs), k0, cols in (("gate", gate, 64, 128), ("down", down, 32, 64)):
        out_values = torch.empty(16, cols, dtype=torch.int8)
        out_pairs = torch.empty(16, 2 * cols // (2 * values.shape[-1] // pairs.shape[-1]))
        engine.unpack(
            name,
            3,
            16,
            16,
            k0,
            cols,
            out_values.data_ptr(),
            cols,
            out_pairs.data_ptr(),
            out_pairs.shape[1] * 4,
        )
        group = 2 * values.shape[-1] // pairs.shape[-1]
        assert torch.equal(out_values, values[3, 16:32, k0 : k0 + cols])
        assert torch.equal(out_pairs, pairs[3, 16:32, 2 * k0 // group : 2 * (k0 + cols) // group])
