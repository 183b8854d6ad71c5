"""GGUF files computed exactly: every supported ggml type, written with gguf.GGUFWriter, read by
load_weights(method="GGUF") and run on the build under test, within 0.5 % of an fp64 forward on the
weights as gguf-py's dequantize decodes them, with outlier activations (4 channels x 100). Also
Q4_K_M's mix (Q6_K down) and llama.cpp's fallback for rows that are not whole K-quant blocks (1408
inputs: Q8_0 and Q5_0). test_variants runs it under every build and path."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from test_accuracy import BOUND, activations, reference, relative_error, routing

gguf = pytest.importorskip("gguf")

from test_gguf_file import FP16_FIELDS, KNOWN_TYPES, random_blocks, write_layer  # noqa: E402
from test_gguf_kernels import held_bytes  # noqa: E402

from kt_kernel.gguf_blocks import BLOCK_TYPES  # noqa: E402

from moe_reference import moe_wrapper  # noqa: E402

EXPERTS, TOP_K = 4, 2


def realistic_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks with the scales of real weights: every fp16 d / dmin about 2^-8 (either
    sign), MXFP4's E8M0 exponents 2^-9..2^-5, NVFP4's E4M3 scales 2^-3..2^0, so that the outputs stay
    far from overflow."""
    blocks = random_blocks(type_name, rows, k, rng)
    block = BLOCK_TYPES[type_name]
    blocks = blocks.reshape(-1, block.block_bytes)
    for offset in FP16_FIELDS[type_name]:
        field = (rng.standard_normal(len(blocks)) * 2.0**-8).astype(np.float16)
        blocks[:, offset : offset + 2] = field.view(np.uint8).reshape(-1, 2)
    if type_name == "MXFP4":
        blocks[:, 0] = rng.integers(119, 123, len(blocks))
    if type_name == "NVFP4":  # E4M3 scales as a quantizer writes them: no sign bit, no NaN, 2^-3..2^0
        blocks[:, 0:4] = rng.integers(0x28, 0x40, (len(blocks), 4))
    return blocks.reshape(rows, -1)


def run_layer(tmp_path, types: dict[str, str], hidden: int, inter: int, tokens: int, largest=False) -> float:
    """The layer's relative error against fp64; ``largest``: every block as LARGEST_BLOCKS makes it, on
    one token whose int8 row and residual sit near -127."""
    rng = np.random.default_rng(sum(map(ord, "".join(types.values()))))
    projections = {}
    for name, type_name in types.items():
        rows, k = (hidden, inter) if name == "down" else (inter, hidden)
        blocks = realistic_blocks(type_name, EXPERTS * rows, k, rng).reshape(EXPERTS, rows, -1)
        if largest:
            blocks = largest_blocks(type_name, blocks)
        projections[name] = (type_name, blocks)
    path = tmp_path / "model.gguf"
    decoded = write_layer(path, projections, experts=EXPERTS, hidden=hidden, inter=inter)
    moe = moe_wrapper(EXPERTS, TOP_K, hidden, inter, method="GGUF", weight_path=str(path))
    moe.load_weights()
    # Held as BLOCK_TYPES says: values in its held bits (4-bit indices, 5- or 6-bit planes, bytes),
    # scales factored (6-bit or int8 multiples of fp16 factors) or fp16, mins where it has them; the
    # types whose scales the data decides (factored None: MXFP4, NVFP4) in any layout, E4M3 bytes
    # times an fp32 per matrix among them (powers of two and E4M3 values are E4M3 codes).
    options = []
    for name, (rows, k) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        block = BLOCK_TYPES[types[name]]
        if block.factored is None:
            layouts = [(False, False, half, 8) for half in (False, True)] + [(False, True, False, 8)] * (
                not block.mins
            )
            layouts += [(True, False, half, bits) for half in (False, True) for bits in (6, 8)]
        else:
            layouts = [(block.factored, False, block.half, block.multiple_bits if block.factored else 8)]
        options.append(
            [
                held_bytes(rows, k, block.group, block.held_bits, f, block.mins, e, h, b)
                for f, e, h, b in layouts
            ]
        )
    held = {EXPERTS * sum(choice) for choice in itertools.product(*options)}
    assert sum(sp.engine.packed_bytes() for sp in moe._subpools) in held
    x = activations(tokens, hidden, 100)
    if largest:  # -255/256 of the largest: an int8 row at -127 and a residual near 127
        x = torch.full((tokens, hidden), -255 / 256)
        x[:, 0] = 1.0
    ids, weights = routing(tokens, EXPERTS, TOP_K, hot=True)
    exact = [torch.from_numpy(decoded[name]).double() for name in ("gate", "up", "down")]
    return relative_error(moe.forward(x, ids, weights), reference(exact, x, ids, weights))


# Byte ranges of a block set to one byte: every value, scale and min multiple at its largest. Q4_K:
# nibbles 15, 6-bit scale and min multiples 63 (all 12 bytes 0xFF); Q6_K: values 31 (low and high
# bits all ones), int8 scale multiples -128. Then a byte of values (and Q6_K's of multiples) at the
# other end, so that they still span the type's range: held as its own. (MXFP4's one-token tile, on
# the MXFP4 method: test_int_kernels.test_four_bit_sums_at_their_largest.)
LARGEST_BLOCKS = {
    "Q4_K": [(4, 144, 0xFF), (16, 17, 0x00)],
    "Q6_K": [(0, 192, 0xFF), (192, 208, 0x80), (0, 1, 0x00), (128, 129, 0x00), (192, 193, 0x7F)],
}


def largest_blocks(type_name: str, blocks: np.ndarray) -> np.ndarray:
    block_bytes = BLOCK_TYPES[type_name].block_bytes
    each = blocks.reshape(-1, block_bytes).copy()
    for start, end, byte in LARGEST_BLOCKS[type_name]:
        each[:, start:end] = byte
    return each.reshape(blocks.shape)


@pytest.mark.parametrize("type_name", sorted(LARGEST_BLOCKS))
def test_one_token_at_the_largest_values_and_multiples(tmp_path, type_name):
    """The one-token kernels' int16 products and int32 sums at their bounds (avx2 without AVX-VNNI:
    Q4_K's four lines per int16 lane, widened by 256 x 63; Q6_K's two quads, widened by -128 and
    summed over a block of 256 inputs), K of whole 256-input blocks, still within the bound."""
    error = run_layer(tmp_path, dict.fromkeys(("gate", "up", "down"), type_name), 512, 256, 1, largest=True)
    assert error < BOUND, f"{type_name}: relative error {error:.4%}"


@pytest.mark.parametrize("tokens", [2, 3, 4, 5])
def test_q4_k_m_with_a_few_tokens_per_expert(tmp_path, tokens):
    """Expert 0 gets every token: on avx2 without AVX-VNNI, Q4_K's 2 to 4 and Q6_K's 2 run the
    one-token tiles a token at a time, Q6_K's 3 and more and Q4_K's 5 the shared tile of widened
    tokens."""
    error = run_layer(tmp_path, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, 512, 256, tokens)
    assert error < BOUND, f"relative error {error:.4%}"


@pytest.mark.parametrize("tokens", [1, 24])
@pytest.mark.parametrize("type_name", KNOWN_TYPES)
def test_every_type_within_half_a_percent_of_fp64(tmp_path, type_name, tokens):
    error = run_layer(tmp_path, dict.fromkeys(("gate", "up", "down"), type_name), 512, 256, tokens)
    assert error < BOUND, f"{type_name}: relative error {error:.4%}"


@pytest.mark.parametrize(
    ("types", "hidden", "inter"),
    [
        ({"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, 512, 256),  # Q4_K_M
        ({"gate": "Q2_K", "up": "Q3_K", "down": "Q5_K"}, 512, 256),  # groups of 16 and 32 mixed
        ({"gate": "Q8_0", "up": "Q8_0", "down": "Q5_0"}, 512, 1408),  # 1408: not whole blocks of 256
    ],
    ids=["q4_k_m", "k-quants-mixed", "inter-1408"],
)
@pytest.mark.parametrize("tokens", [1, 24])
def test_mixed_layers_within_half_a_percent_of_fp64(tmp_path, types, hidden, inter, tokens):
    error = run_layer(tmp_path, types, hidden, inter, tokens)
    assert error < BOUND, f"{types}: relative error {error:.4%}"
