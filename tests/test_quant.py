"""kt_kernel.quant: MXFP4 quantize / dequantize."""

from __future__ import annotations

import pytest
import torch
from mxfp4_reference import decode_mxfp4

from kt_kernel import formats, quant


def test_round_trip_error_bound_on_random_weights():
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    codes, scales = quant.quantize("MXFP4", w)
    assert codes.shape == (64, 256) and codes.dtype == torch.uint8
    assert scales.shape == (64, 16) and scales.dtype == torch.uint8
    back = quant.dequantize("MXFP4", codes, scales)
    assert torch.equal(back.double(), decode_mxfp4(codes, scales))  # matches the independent decode
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)  # each block's scale X
    # Nearest E2M1 value: error <= half the widest gap (4 -> 6) = 1 X; block max <= 6 X, not clipped.
    assert torch.all((back - w).abs() <= step)
    blocks = w.reshape(64, 16, 32).abs().amax(-1)
    assert torch.all(blocks <= 6 * step[:, ::32]) and torch.all(blocks > 3 * step[:, ::32])
    rel = ((back - w).norm() / w.norm()).item()
    assert 0.02 < rel < 0.13, rel


def test_representable_values_round_trip_exactly():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (8, 4), dtype=torch.uint8, generator=g)
    values = quant.dequantize("MXFP4", codes, scales)
    again = quant.dequantize("MXFP4", *quant.quantize("MXFP4", values))
    assert torch.equal(again, values)


def test_nearest_rounding_ties_to_even_and_signs():
    row = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.3, -4.9, -6.0, -0.0] + [0.0] * 20)
    codes, scales = quant.quantize("MXFP4", row[None])
    assert scales.item() == 127  # block max 6 -> scale 2^0
    got = quant.dequantize("MXFP4", codes, scales)[0, :12]
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -4.0, -6.0, 0.0]
    assert codes[0, 5].item() == 0x0F  # k=10: -6 is code 8|7 (low nibble); k=11: -0.0 is stored as +0


def test_zero_block_and_layout():
    w = torch.zeros(2, 64)
    w[1, 0], w[1, 1], w[1, 33] = 1.0, -6.0, 0.5  # row 1: k=0 -> low nibble, k=1 -> high nibble
    codes, scales = quant.quantize("MXFP4", w)
    assert torch.all(codes[0] == 0)
    assert codes[1, 0].item() == 0x2 | (0xF << 4)  # 1.0 is code 2, -6.0 is code 8|7
    # Block 1 of row 1 holds only 0.5: scale 2^-3 (smallest X with 0.5 <= 6 X), 0.5 = 4 X = code 6,
    # in the high nibble of byte 16 (k = 33).
    assert codes[1, 16].item() == 0x60
    assert scales[1].tolist() == [127, 124]


def test_nan_scale_decodes_to_nan():
    out = quant.dequantize(
        "MXFP4", torch.full((1, 16), 0x22, dtype=torch.uint8), torch.tensor([[255]], dtype=torch.uint8)
    )
    assert torch.isnan(out).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize("MXFP4", torch.randn(4, 48))
    with pytest.raises(TypeError, match="floating-point"):
        quant.quantize("MXFP4", torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="unknown method"):
        quant.quantize("FP3", torch.randn(4, 32))
    with pytest.raises(ValueError, match="group_size must be one of"):
        quant.quantize("AMXINT4", torch.randn(4, 96), group_size=48)
    with pytest.raises(ValueError, match="multiple of group_size 64"):
        quant.quantize("INT4", torch.randn(4, 96), group_size=64)
    with pytest.raises(ValueError, match=f"{' and '.join(formats.GROUP_CHOICE)} only"):
        quant.quantize("INT8", torch.randn(4, 32), group_size=32)
    assert quant.quantize("bf16", torch.randn(2, 3))[0].dtype == torch.bfloat16


def test_int8_round_trip_within_half_a_step():
    w = torch.randn(16, 100, generator=torch.Generator().manual_seed(2))
    w[3] = 0  # an all-zero row: scale 0, values 0
    values, scales = quant.quantize("AMXINT8", w)
    assert values.dtype == torch.int8 and values.shape == (16, 100) and scales.shape == (16,)
    assert values.abs().max() == 127 and torch.all(values[3] == 0)
    back = quant.dequantize("INT8", values, scales)
    assert torch.all((back - w).abs() <= scales[:, None] / 2 * (1 + 1e-6))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_and_layout(group):
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(group))
    values, scales = quant.quantize("INT4", w, group_size=group)
    assert values.dtype == torch.uint8 and values.shape == (8, 128) and scales.shape == (8, 256 // group)
    back = quant.dequantize("INT4", values, scales)
    step = scales.repeat_interleave(group, dim=-1)
    assert torch.all((back - w).abs() <= step / 2 * (1 + 1e-6))
    # Low nibble = even k, two's complement: decode the bytes by hand.
    low = (values & 0xF).to(torch.int16)
    high = (values >> 4).to(torch.int16)
    q = torch.stack([low - 16 * (low > 7), high - 16 * (high > 7)], dim=-1).reshape(8, 256)
    assert torch.equal(q.float() * step, back)
    assert q.abs().max() == 7


@pytest.mark.parametrize(
    "method,fmt",
    [
        ("AMXINT4", "INT4"),
        ("MOE_INT4", "INT4"),
        ("amxint8", "INT8"),
        ("MOE_INT8", "INT8"),
        ("mxfp4", "MXFP4"),
    ],
)
def test_upstream_method_names(method, fmt):
    assert quant.weight_format(method) == fmt
