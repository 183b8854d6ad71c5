"""The amx build's tile code, run on software-emulated tiles (module _kt_kernel_amx_emulated, built
with -C cmake.define.KT_KERNEL_AMX_EMULATION=ON, as ci/run_tests.sh does): same kernels source,
same packing, the tile instructions replaced by a reference implementation of their semantics."""

from __future__ import annotations

import importlib

import pytest
import torch

from kt_kernel import formats

from conftest import skip_unless_cpu_runs
from moe_reference import assert_close_to_reference, make_problem, reference_forward


@pytest.fixture(scope="module")
def emulated():
    skip_unless_cpu_runs("avx512")  # the emulated build is the amx build's code on AVX512 only
    try:
        return importlib.import_module("kt_kernel._kt_kernel_amx_emulated")
    except ModuleNotFoundError:
        pytest.skip("built without -C cmake.define.KT_KERNEL_AMX_EMULATION=ON (see ci/run_tests.sh)")


def tile_products(module) -> int:
    return module.kernel_info()["emulated_tile_products"]


# (tokens, outputs, inputs, tiles used): the AMX-BF16 tiles take calls of at least 16 tokens (the
# last block padded) when the inputs are a multiple of 32; the rest goes to the AVX512 kernel.
@pytest.mark.parametrize(
    "tokens,n,k,tiled",
    [(32, 32, 64, True), (33, 40, 96, True), (600, 48, 256, True), (96, 17, 32, True), (31, 64, 64, True),
     (16, 16, 64, True), (15, 64, 64, False), (64, 64, 48, False)],
)  # fmt: skip
def test_linear_on_emulated_tiles(emulated, tokens, n, k, tiled):
    g = torch.Generator().manual_seed(tokens + n + k)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    y = torch.empty(tokens, n)
    before = tile_products(emulated)
    emulated.linear("BF16", x.view(torch.int16), w.view(torch.int16), None, y)
    assert (tile_products(emulated) > before) == tiled
    ref = x.double() @ w.double().T
    assert torch.all((y.double() - ref).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30)


@pytest.mark.parametrize("tokens,per_block", [(64, True), (40, False), (17, True)])
def test_fp8_decoded_onto_emulated_tiles(emulated, tokens, per_block):
    """FP8 codes decoded to bf16 run on the AMX-BF16 tile code, exact to fp32 rounding."""
    g = torch.Generator().manual_seed(tokens)
    n, k = 48, 256
    codes = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
    scales = torch.rand(n, k // 128 if per_block else 1, generator=g) + 0.5
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    y = torch.empty(tokens, n)
    before = tile_products(emulated)
    emulated.linear("FP8", x.view(torch.int16), codes.view(torch.uint8), scales, y)
    assert tile_products(emulated) > before
    w = codes.double() * scales.double().repeat_interleave(k // scales.shape[1], dim=1)
    ref = x.double() @ w.T
    assert torch.all((y.double() - ref).abs() <= 1e-6 * (x.double().abs() @ w.abs().T) + 1e-30)


def test_moe_forward_on_emulated_tiles(emulated):
    """Gate/up read routed (gathered) rows, down contiguous ones: both through the tiles."""
    p = make_problem(experts=6, top_k=2, hidden=128, inter=96, tokens=80, seed=3)
    p.ids[:, 0] = 1  # expert 1 takes all 80 tokens: two full tile blocks and a tail
    p.ids[:, 1] = torch.where(p.ids[:, 1] == 1, torch.full_like(p.ids[:, 1], 4), p.ids[:, 1])
    engine = emulated.MoEEngine(6, 2, 128, 96, "BF16", 2, [])
    bits = [w.to(torch.bfloat16).contiguous().view(torch.int16) for w in (p.gate, p.up, p.down)]
    engine.load(bits[0], None, bits[1], None, bits[2], None, torch.arange(6))
    out = torch.empty(80, 128, dtype=torch.bfloat16)
    engine.submit(p.hidden.view(torch.int16), p.ids, p.weights, out.view(torch.int16))
    engine.sync()
    assert_close_to_reference(out, reference_forward(p))


# INT8 tiles take calls of at least 16 tokens when the inputs are a multiple of 64: here one row per
# token (int8_activations=True); by default each token is two rows (its residual too).
@pytest.mark.parametrize(
    "tokens,n,k,tiled",
    [(32, 32, 64, True), (33, 40, 128, True), (300, 48, 256, True), (31, 64, 64, True), (16, 17, 576, True),
     (15, 64, 64, False), (64, 64, 96, False)],
)  # fmt: skip
def test_int8_linear_on_emulated_tiles(emulated, tokens, n, k, tiled):
    g = torch.Generator().manual_seed(tokens + n + k)
    values = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = torch.rand(n, 1, generator=g) * 0.1
    x = torch.randint(-127, 128, (tokens, k), generator=g).float()
    x[:, 0] = 127.0  # max |x| = 127: the int8 activations are x itself, so the result is exact
    y = torch.empty(tokens, n)
    before = tile_products(emulated)
    emulated.linear(
        "INT8",
        x.to(torch.bfloat16).view(torch.int16),
        values.view(torch.uint8),
        scales,
        y,
        int8_activations=True,
    )
    assert (tile_products(emulated) > before) == tiled
    weight = values.double() * scales.double()
    ref = x.double() @ weight.T
    assert torch.all((y.double() - ref).abs() <= 1e-6 * (x.double().abs() @ weight.abs().T) + 1e-30)


def test_int8_moe_forward_on_emulated_tiles(emulated):
    from kt_kernel import quant

    p = make_problem(experts=6, top_k=2, hidden=128, inter=64, tokens=80, seed=3)
    p.ids[:, 0] = 1  # expert 1 takes all 80 tokens: two full tile blocks and a tail
    p.ids[:, 1] = torch.where(p.ids[:, 1] == 1, torch.full_like(p.ids[:, 1], 4), p.ids[:, 1])
    engine = emulated.MoEEngine(6, 2, 128, 64, "INT8", 2, [])
    tensors = []
    for name in ("gate", "up", "down"):
        values, scales = quant.quantize("INT8", getattr(p, name))
        tensors += [values.view(torch.uint8), scales[..., None].contiguous()]
        setattr(p, name, quant.dequantize("INT8", values, scales))
    engine.load(*tensors, torch.arange(6))
    out = torch.empty(80, 128, dtype=torch.bfloat16)
    before = tile_products(emulated)
    engine.submit(p.hidden.view(torch.int16), p.ids, p.weights, out.view(torch.int16))
    engine.sync()
    assert tile_products(emulated) > before  # gate/up on gathered rows, down on contiguous ones
    ref = reference_forward(p)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.005  # two int8 parts per activation row


# 4-bit weights on the tiles: in the exact mode (two quantized rows per token), MXFP4 and INT4 without
# zero points in groups of 64 or more are decoded onto the AMX-BF16 tiles (the token's bf16 row) from
# 16 tokens on; INT4 with zero points or int8 activations takes the INT8 tiles (the widened nibbles x
# the quantized rows, blocks of 32 such rows, groups of 128); the rest the AVX512 kernel.
# (method, tokens, n, k, group, zero points, int8_activations, tiles: "bf16", "int8" or None)
FOUR_BIT_CASES = [
    ("INT4", 16, 32, 128, 128, False, False, "bf16"),
    ("INT4", 40, 32, 128, 64, False, False, "bf16"),
    ("INT4", 33, 40, 256, 128, False, True, "int8"),
    ("INT4", 300, 48, 256, 128, True, False, "int8"),
    ("INT4", 40, 33, 384, 128, True, False, "int8"),
    ("INT4", 15, 32, 128, 128, False, False, None),
    ("INT4", 40, 32, 128, 32, False, False, None),
    ("INT4", 64, 32, 96, 32, True, False, None),
    ("MXFP4", 64, 48, 96, 32, False, False, "bf16"),
    ("MXFP4", 16, 17, 64, 32, False, False, "bf16"),
    ("MXFP4", 15, 32, 64, 32, False, False, None),
    ("MXFP4", 64, 17, 64, 32, False, True, None),
]


def four_bit_weights(method, n, k, group, with_zeros, g):
    """Canonical bytes and scales, optional INT4 zero points, and the fp64 weight they hold."""
    from mxfp4_reference import decode_mxfp4
    from test_int_kernels import decode_int4, random_canonical

    if method == "MXFP4":
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        scales = torch.randint(100, 150, (n, k // 32), dtype=torch.uint8, generator=g)
        return codes, scales, None, decode_mxfp4(codes, scales).double()
    values, scales = random_canonical(method, n, k, group, g)
    weight = decode_int4(values, scales)
    zeros = None
    if with_zeros:
        zeros = torch.randint(-8, 9, scales.shape, dtype=torch.int8, generator=g)
        weight = weight - (zeros.double() * scales.double()).repeat_interleave(group, dim=-1)
    return values, scales, zeros, weight


@pytest.mark.parametrize("method,tokens,n,k,group,with_zeros,int8_activations,tiles", FOUR_BIT_CASES)
def test_four_bit_linear_on_emulated_tiles(
    emulated, method, tokens, n, k, group, with_zeros, int8_activations, tiles
):
    """Exact sums on the tiles (integer activations, which every path holds exactly); on Gaussian
    activations with outlier channels, the INT8 tiles give the AVX512 kernel's bits and the BF16
    tiles the product of the bf16 tokens to fp32 rounding."""
    from kt_kernel import _kt_kernel_avx512 as avx512

    g = torch.Generator().manual_seed(tokens * 100 + n + k)
    values, scales, zeros, weight = four_bit_weights(method, n, k, group, with_zeros, g)

    def linear(module, x):
        y = torch.empty(tokens, n)
        module.linear(
            method, x.view(torch.int16), values, scales, y, int8_activations=int8_activations, zeros=zeros
        )
        return y

    x = torch.randint(-127, 128, (tokens, k), generator=g).float()
    x[:, 0] = 127.0  # max |x| = 127: the int8 activations are x itself
    before = tile_products(emulated)
    y = linear(emulated, x.to(torch.bfloat16))
    assert (tile_products(emulated) > before) == (tiles is not None)
    ref = x.double() @ weight.T
    assert torch.all((y.double() - ref).abs() <= 1e-6 * (x.double().abs() @ weight.abs().T) + 1e-30)

    x = torch.randn(tokens, k, generator=g)
    x[:, 3] *= 100
    x = x.to(torch.bfloat16)
    if tiles == "bf16":
        ref = x.double() @ weight.T
        bound = 1e-5 * (x.double().abs() @ weight.abs().T) + 1e-30
        assert torch.all((linear(emulated, x).double() - ref).abs() <= bound)
    else:
        assert torch.equal(linear(emulated, x), linear(avx512, x))


def test_mxfp4_scales_at_the_ends_of_bf16(emulated):
    """E8M0 scales whose products with E2M1 values leave bf16's normal range: above 2^125 the matrix
    runs the AVX512 kernel (the same bits as the avx512 build); below 2^-125 the weights (at most
    6 x 2^-126, denormal in bf16, which the tiles read as zero) are flushed to zero on the tiles."""
    from mxfp4_reference import decode_mxfp4

    from kt_kernel import _kt_kernel_avx512 as avx512

    g = torch.Generator().manual_seed(5)
    n, k, tokens = 32, 64, 32
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)

    def run(module, scales, x):
        y = torch.empty(tokens, n)
        before = tile_products(emulated)
        module.linear("MXFP4", x.view(torch.int16), codes, scales, y)
        return y, tile_products(emulated) > before

    for extreme, tiled in ((253, False), (252, True), (1, True), (0, True)):
        scales = torch.full((n, k // 32), 127, dtype=torch.uint8)
        scales[3, 1] = extreme
        xs = x.clone()
        xs[:, 32:] *= 2.0 ** min(127 - extreme, 0)  # products of the large scale stay far from fp32's limit
        y, used_tiles = run(emulated, scales, xs)
        assert used_tiles == tiled, extreme
        if not tiled:
            assert torch.equal(y, run(avx512, scales, xs)[0])
            continue
        weight = decode_mxfp4(codes, scales).double()
        if extreme < 2:
            weight[3, 32:] = 0.0  # flushed
        ref = xs.double() @ weight.T
        bound = 1e-5 * (xs.double().abs() @ weight.abs().T) + 1e-30
        assert torch.all((y.double() - ref).abs() <= bound), extreme


# GGUF has no tiles yet: the amx build runs its AVX512 kernel (kernel_info's gguf_path says so).
TILED = [name for name in formats.FORMATS if name != "GGUF"]


def test_gguf_runs_the_avx512_kernel_in_the_amx_build(emulated):
    info = emulated.kernel_info()
    assert info["gguf_path"] == emulated.kernel_info()["int8_path"].rsplit("else ", 1)[-1]


@pytest.mark.parametrize("method", TILED)
def test_tiles_within_half_a_percent_on_outlier_activations(emulated, method):
    """The accuracy bound of test_accuracy.py, on the tile paths (64 tokens per expert: full tiles)."""
    from test_accuracy import BOUND, accuracy_case

    def forward(load, x, ids, topk_weights):
        layer = emulated.MoESubpools(8, 2, 256, method, emulated.WorkerPools([2], [[]]), [128], [])
        scales = [s if s.dim() == 3 else s[..., None].contiguous() for s in load["scales"].values()]
        scales = scales or [None] * 3
        tensors = [t for pair in zip(load["tensors"], scales, strict=True) for t in pair]
        layer.engine(0).load(*tensors, torch.arange(8))
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        before = tile_products(emulated)
        layer.submit(x.view(torch.int16), ids, topk_weights.float(), out.view(torch.int16))
        layer.sync()
        assert tile_products(emulated) > before
        return out

    error = accuracy_case(forward, method, (8, 2, 256, 128), 256, 100, hot=True)
    assert error < BOUND, f"{method} on tiles: relative error {error:.4%}"
