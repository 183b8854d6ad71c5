"""Write-back never writes past a buffer it was told the size of: ``write_buffer_nbytes`` gives each
buffer's bytes for every method and scale layout a load accepts, the write fills exactly that, and
weights upstream's layout cannot hold are a ValueError before any byte is written."""

from __future__ import annotations

import pytest
import torch

from kt_kernel import formats, quant

from moe_reference import make_problem, moe_wrapper

E, K, H, I = 4, 2, 256, 256
GUARD = 64  # bytes after each buffer that must stay as they were
NAMES = ("w13_weight", "w13_scale", "w2_weight", "w2_scale")


def fp8_codes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes)  # no NaN codes


def fp8_scales(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "block":
        return torch.rand(E, n // 128, k // 128, generator=g) + 0.5
    if kind == "channel":
        return torch.rand(E, n, generator=g) + 0.5
    if kind == "e8m0-32":
        return torch.randint(120, 130, (E, n, k // 32), dtype=torch.uint8, generator=g).view(
            torch.float8_e8m0fnu
        )
    assert kind == "per-16"
    return torch.rand(E, n, k // 16, generator=g) + 0.5


def load_fp8(method: str, kind: str):
    moe = moe_wrapper(E, K, H, I, method=method)
    moe.load_weights_from_tensors(
        fp8_codes((E, I, H), 1), fp8_codes((E, I, H), 2), fp8_codes((E, H, I), 3),
        gate_scale=fp8_scales(kind, I, H, 4), up_scale=fp8_scales(kind, I, H, 5),
        down_scale=fp8_scales(kind, H, I, 6),
    )  # fmt: skip
    return moe


def load_nvfp4():
    """NVFP4 as nvfp4_to_fp8 gives it: held as GGUF, written back as loaded."""
    g = torch.Generator().manual_seed(7)

    def projection(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, generator=g)
        scales = (torch.rand(E, n, k // 16, generator=g) + 0.5).to(torch.float8_e4m3fn).view(torch.uint8)
        return formats.nvfp4_to_fp8(values, scales, 1 / 3)

    (gate, gs), (up, us), (down, ds) = projection(I, H), projection(I, H), projection(H, I)
    moe = moe_wrapper(E, K, H, I, method="NVFP4")
    moe.load_weights_from_tensors(gate, up, down, gate_scale=gs, up_scale=us, down_scale=ds)
    return moe


def load_quantized(method: str, group_size: int | None = None):
    """Canonical weights (values and scales) given to the load, bit-exactly."""
    p = make_problem(E, K, H, I, tokens=1, seed=9)
    moe = moe_wrapper(E, K, H, I, method=method)
    if method == "BF16":
        moe.load_weights_from_tensors(p.gate, p.up, p.down)
        return moe
    (gv, gs), (uv, us), (dv, ds) = (quant.quantize(method, w, group_size) for w in (p.gate, p.up, p.down))
    moe.load_weights_from_tensors(gv, uv, dv, gate_scale=gs, up_scale=us, down_scale=ds)
    return moe


def write(moe, tp: int, sizes: dict[str, int], fill: int) -> list[dict[str, torch.Tensor]]:
    parts = [
        {name: torch.full((sizes[name] + GUARD,), fill, dtype=torch.uint8) for name in NAMES}
        for _ in range(tp)
    ]
    ptrs = {name: [part[name].data_ptr() for part in parts] for name in NAMES}
    moe.submit_write_weight_scale_to_buffer(tp, 1, ptrs["w13_weight"], ptrs["w13_scale"], ptrs["w2_weight"],
                                            ptrs["w2_scale"])  # fmt: skip
    return parts


CASES = {
    "BF16": lambda: load_quantized("BF16"),
    "INT8": lambda: load_quantized("INT8"),
    "INT4 G32": lambda: load_quantized("INT4", 32),
    "INT4 G128": lambda: load_quantized("INT4", 128),
    "RAWINT4 G32": lambda: load_quantized("RAWINT4", 32),
    "MXFP4": lambda: load_quantized("MXFP4"),
    "FP8 blocks": lambda: load_fp8("FP8", "block"),
    "FP8_PERCHANNEL": lambda: load_fp8("FP8_PERCHANNEL", "channel"),
    "NVFP4": load_nvfp4,
}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_the_write_fills_exactly_the_bytes_write_buffer_nbytes_gives(case, tp):
    moe = CASES[case]()
    sizes = moe.write_buffer_nbytes(tp)
    assert sizes["w13_weight"] > 0 and sizes["w2_weight"] > 0
    zeros, ones = write(moe, tp, sizes, 0x00), write(moe, tp, sizes, 0xFF)
    for r in range(tp):
        for name in NAMES:
            size = sizes[name]
            assert bool((zeros[r][name][size:] == 0x00).all()) and bool(
                (ones[r][name][size:] == 0xFF).all()
            ), f"part {r} {name}: written past its {size} bytes"
            # Every byte written: the same bytes whatever the buffer held before.
            assert torch.equal(zeros[r][name][:size], ones[r][name][:size]), (
                f"part {r} {name}: bytes left unwritten"
            )
    moe.close()


@pytest.mark.parametrize(
    "method, kind",
    [("FP8", "channel"), ("FP8", "e8m0-32"), ("FP8", "per-16"), ("FP8_PERCHANNEL", "block")],
)
def test_scales_upstreams_layout_cannot_hold_are_refused_before_any_byte_is_written(method, kind):
    moe = load_fp8(method, kind)
    with pytest.raises(ValueError, match="upstream's FP8 buffers for this method hold one per"):
        moe.write_buffer_nbytes(1)
    big = 4 * E * H * I  # larger than any buffer could need
    parts = [torch.full((big,), 0xA5, dtype=torch.uint8) for _ in NAMES]
    with pytest.raises(ValueError, match="upstream's FP8"):
        moe.submit_write_weight_scale_to_buffer(1, 0, *([b.data_ptr()] for b in parts))
    assert all(bool((b == 0xA5).all()) for b in parts)
    moe.close()


def test_fp8_quantized_here_is_refused_before_any_byte_is_written():
    """Weights quantized here have a scale per row and 128 inputs: not one per 128 x 128 block. That
    is seen only in the scales' values, so nothing is written until every part is converted."""
    moe = load_quantized("FP8")
    sizes = moe.write_buffer_nbytes(2)
    parts = [{name: torch.full((sizes[name],), 0xA5, dtype=torch.uint8) for name in NAMES} for _ in range(2)]
    ptrs = [[part[name].data_ptr() for part in parts] for name in NAMES]
    with pytest.raises(ValueError, match="within a block"):
        moe.submit_write_weight_scale_to_buffer(2, 0, *ptrs)
    assert all(bool((b == 0xA5).all()) for part in parts for b in part.values())
    moe.close()
