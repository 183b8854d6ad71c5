"""The avx2 build's AVX-VNNI path (VEX vpdpbusd on ymm, for the CPUs with AVX-VNNI and no AVX512:
Intel clients since Alder Lake) gives the integer formats the results of the plain AVX2 path, on a
CPU that has AVX-VNNI. (qemu-user cannot stand in for such a CPU: neither 7.2 nor 10.0 emulates
AVX-VNNI under TCG. That the avx2 module holds no EVEX or zmm is test_isa_purity's; that a CPU
without AVX-VNNI gets the plain path, test_emulated_haswell's.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import HOST_FLAGS, REPO

SCRIPT = """
import sys, torch, kt_kernel
from test_accuracy import activations, routing, stored_weights
from moe_reference import moe_wrapper
shape = (8, 2, 512, 256)
outputs = {}
for method in ("INT8", "INT4", "MXFP4"):
    load, _ = stored_weights(method, 8, 512, 256)
    for tokens in (1, 5, 40):
        moe = moe_wrapper(*shape, method=method)
        moe.load_weights_from_tensors(*load["tensors"], **load["scales"])
        ids, weights = routing(tokens, 8, 2, hot=True)
        outputs[f"{method}-{tokens}"] = moe.forward(activations(tokens, 512, 100), ids, weights)
torch.save(outputs, sys.argv[1])
print("VARIANT", kt_kernel.__cpu_variant__, kt_kernel.cpu_info()["kernels"]["int8_path"])
"""


def outputs_of(tmp_path, name: str, extra_env: dict[str, str]) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_KERNEL_")}
    env |= {"PYTHONPATH": str(REPO / "tests"), "KT_KERNEL_CPU_VARIANT": "avx2"} | extra_env
    out = tmp_path / f"{name}.pt"
    command = [sys.executable, "-c", SCRIPT, str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out), result.stdout


def assert_same_results(vnni: dict, plain: dict) -> None:
    """The same integer sums, scaled and added in another order: every bf16 output equal or one
    rounding step (2^-8 of its magnitude) apart."""
    for case, out in vnni.items():
        a, b = out.double(), plain[case].double()
        step = torch.maximum(a.abs(), b.abs()) * 2.0**-8
        assert bool(((a - b).abs() <= step).all()), (
            f"{case}: {int(((a - b).abs() > step).sum())} outputs differ"
        )


def test_the_avx_vnni_path_gives_the_plain_paths_results(tmp_path):
    if "avx_vnni" not in HOST_FLAGS:
        pytest.skip("this CPU lacks AVX-VNNI: the avx2 build runs its plain path only")
    vnni, stdout = outputs_of(tmp_path, "vnni", {})
    assert "avx_vnni (vpdpbusd)" in stdout
    plain, stdout = outputs_of(tmp_path, "plain", {"KT_KERNEL_DISABLE_AVX_VNNI": "1"})
    assert "vpmaddwd" in stdout
    assert_same_results(vnni, plain)
