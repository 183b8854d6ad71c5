"""On a CPU without AVX512 (qemu-user emulating Haswell) whose /proc/cpuinfo still shows the host's
AVX512 flags, `import kt_kernel` must end on the avx2 build (CPUID refusal + fallback, no SIGILL)
and BF16, MXFP4, INT8, INT4, FP8 and GGUF forwards must run and match the reference (the integer formats
on the plain AVX2 path: Haswell has no AVX-VNNI)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

QEMU = shutil.which("qemu-x86_64")

SCRIPT = """
import warnings
warnings.simplefilter("always")
import torch, kt_kernel
from moe_reference import make_problem, reference_forward, assert_close_to_reference
from mxfp4_reference import decode_mxfp4
p = make_problem(experts=8, top_k=2, hidden=64, inter=40, tokens=5)
moe = kt_kernel.KTMoEWrapper(0, 8, 2, 64, 40, None, 2, 1, None, 512, method="BF16")
moe.load_weights_from_tensors(p.gate, p.up, p.down)
assert_close_to_reference(moe.forward(p.hidden, p.ids, p.weights), reference_forward(p))
# MXFP4, the format the AVX2 build is the universal fallback for.
p = make_problem(experts=8, top_k=2, hidden=64, inter=64, tokens=9)
p.ids[:, 0] = 3  # expert 3 takes all 9 tokens (the prefill path), the others one or two
p.ids[:, 1] = torch.where(p.ids[:, 1] == 3, torch.full_like(p.ids[:, 1], 5), p.ids[:, 1])
moe = kt_kernel.KTMoEWrapper(0, 8, 2, 64, 64, None, 2, 1, None, 512, method="MXFP4")
moe.load_weights_from_tensors(p.gate, p.up, p.down)  # quantized on load
for name in ("gate", "up", "down"):  # the reference uses the exact quantized weights
    setattr(p, name, decode_mxfp4(*kt_kernel.quant.quantize("MXFP4", getattr(p, name))).float())
ref = reference_forward(p)  # exact to the stored weights: 0.5 %, as on every build
assert ((moe.forward(p.hidden, p.ids, p.weights).double() - ref).norm() / ref.norm()).item() < 0.005
for method in ("INT8", "INT4"):
    p = make_problem(experts=8, top_k=2, hidden=64, inter=64, tokens=9)
    moe = kt_kernel.KTMoEWrapper(0, 8, 2, 64, 64, None, 2, 1, None, 512, method=method)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    for name in ("gate", "up", "down"):
        q = kt_kernel.quant.quantize(method, getattr(p, name))
        setattr(p, name, kt_kernel.quant.dequantize(method, *q))
    ref = reference_forward(p)
    out = moe.forward(p.hidden, p.ids, p.weights).double()
    assert ((out - ref).norm() / ref.norm()).item() < 0.005, method
# FP8: up to four rows per expert decode the codes in registers, more through bf16 on the stack. Scales
# are powers of two, so the stored weights are bf16 numbers, as reference_forward takes them.
for tokens in (1, 9):
    p = make_problem(experts=8, top_k=2, hidden=64, inter=64, tokens=tokens)
    q = {}
    for name in ("gate", "up", "down"):
        codes, scales = kt_kernel.quant.quantize("FP8", getattr(p, name))
        q[name] = (codes, torch.exp2(torch.round(torch.log2(scales))))
        setattr(p, name, kt_kernel.quant.dequantize("FP8", *q[name]))
    moe = kt_kernel.KTMoEWrapper(0, 8, 2, 64, 64, None, 2, 1, None, 512, method="FP8")
    moe.load_weights_from_tensors(*(q[n][0] for n in q), **{f"{n}_scale": q[n][1] for n in q})
    assert_close_to_reference(moe.forward(p.hidden, p.ids, p.weights), reference_forward(p))
# GGUF (int8 values, a scale and a min per 32 inputs): always int16 activations on plain AVX2.
p = make_problem(experts=8, top_k=2, hidden=64, inter=64, tokens=9)
tensors = {}
for name in ("gate", "up", "down"):
    values, pairs = kt_kernel.quant.quantize("GGUF", getattr(p, name))
    pairs[..., 1::2] = 0.01 * torch.randn(pairs[..., 1::2].shape)  # mins, as K-quants have them
    tensors[name], tensors[name + "_scale"] = values, pairs
    setattr(p, name, kt_kernel.quant.dequantize("GGUF", values, pairs))
moe = kt_kernel.KTMoEWrapper(0, 8, 2, 64, 64, None, 2, 1, None, 512, method="GGUF")
moe.load_weights_from_tensors(tensors.pop("gate"), tensors.pop("up"), tensors.pop("down"), **tensors)
ref = reference_forward(p)
assert ((moe.forward(p.hidden, p.ids, p.weights).double() - ref).norm() / ref.norm()).item() < 0.005
print("VARIANT", kt_kernel.__cpu_variant__, kt_kernel.cpu_info()["kernels"]["bf16_path"])
print("INT8 PATH", kt_kernel.cpu_info()["kernels"]["int8_path"])
"""


def run_as_haswell(*python_args: str, **env_vars: str) -> subprocess.CompletedProcess:
    """This Python under qemu's Haswell (no AVX512, no AVX-VNNI), without the caller's KT_KERNEL_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_KERNEL_")} | env_vars
    return subprocess.run(
        [QEMU, "-cpu", "Haswell-v4", sys.executable, *python_args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.skipif(QEMU is None, reason="qemu-user is not installed (apt-get install qemu-user)")
def test_import_and_forward_under_emulated_haswell():
    result = run_as_haswell("-c", SCRIPT, PYTHONPATH=str(REPO / "tests"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "VARIANT avx2 avx2" in result.stdout
    assert "INT8 PATH avx2 (vpmaddwd" in result.stdout  # no AVX-VNNI in CPUID: the plain integer path
    if "avx512f" in open("/proc/cpuinfo").read():  # the loader was misled, and recovered
        assert "the avx512 build failed to load" in result.stderr
        assert "CPUID lacks avx512f" in result.stderr


@pytest.mark.skipif(QEMU is None, reason="qemu-user is not installed (apt-get install qemu-user)")
def test_one_token_k_quant_tiles_under_emulated_haswell():
    """The avx2 build's one-token Q4_K and Q6_K tiles (plain AVX2: Haswell has no AVX-VNNI) on a CPU
    without AVX512: the GGUF accuracy cases that reach them (their largest sums, and a few tokens per
    expert, included) pass there."""
    pytest.importorskip("gguf")
    cases = "largest or few_tokens or (Q4_K and 1) or (Q6_K and 1) or (q4_k_m and 1)"
    test_file = str(REPO / "tests/test_gguf_accuracy.py")
    result = run_as_haswell(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", cases, test_file, KT_KERNEL_CPU_VARIANT="avx2"
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-1000:]
