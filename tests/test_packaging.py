"""The wheel: three builds + the loader inside, installable into a fresh venv; the cibuildwheel matrix."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    given = os.environ.get("KT_KERNEL_WHEEL")
    if given:
        return Path(given)
    if os.environ.get("CIBUILDWHEEL") == "1":
        pytest.skip("under cibuildwheel the wheel under test was built (and installed) by cibuildwheel")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-w",
            str(out),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    (built,) = out.glob("kt_kernel-*.whl")
    return built


def test_wheel_holds_three_builds_and_the_loader(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for variant in ("amx", "avx512", "avx2"):
        assert [n for n in names if n.startswith(f"kt_kernel/_kt_kernel_{variant}.") and n.endswith(".so")], (
            names
        )
    for module in ("kt_kernel/__init__.py", "kt_kernel/loader/__init__.py", "kt_kernel/loader/select.py"):
        assert module in names


def test_wheel_installs_and_runs_in_a_fresh_venv(wheel, tmp_path):
    """The wheel and its declared dependencies alone, in a venv without system site-packages:
    import quietly, run a forward and a conversion."""
    import torch

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The torch of this interpreter, pinned with its local tag, so pip never picks another build.
    subprocess.run(
        [python, "-m", "pip", "install", "-q", f"torch=={torch.__version__}", str(wheel)],
        check=True,
        capture_output=True,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KT_KERNEL_", "PYTHON"))}
    script = """
import sys, torch
from safetensors.torch import save_file
import kt_kernel
from kt_kernel import KTMoEWrapper
print(kt_kernel.__file__, kt_kernel.__cpu_variant__)
E, H, I = 4, 64, 32
shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
save_file({f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": torch.randn(*shape).bfloat16()
           for e in range(E) for p, shape in shapes.items()}, sys.argv[1] + "/model.safetensors")
moe = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=2, hidden_size=H, moe_intermediate_size=I,
                   gpu_experts_mask=None, cpuinfer_threads=2, threadpool_count=1, weight_path=None,
                   chunked_prefill_size=512, method="BF16")
moe.load_weights_from_tensors(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I))
print(tuple(moe.forward(torch.randn(3, H).bfloat16(), torch.tensor([[0, 1]] * 3), torch.rand(3, 2)).shape))
"""
    result = subprocess.run(
        [python, "-c", script, str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # nothing from torch (numpy missing) nor nanobind (leaks at exit)
    module_file, variant, *shape = result.stdout.split()
    assert Path(module_file).is_relative_to(venv)
    assert variant in ("amx", "avx512", "avx2")
    assert "".join(shape) == "(3,64)"
    convert = subprocess.run(
        [venv / "bin" / "kt-kernel", "convert", str(tmp_path), str(tmp_path / "int8"), "--format", "int8",
         "--quiet"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert convert.returncode == 0, convert.stderr
    assert (tmp_path / "int8" / "kt_manifest.json").is_file()


def test_cibuildwheel_matrix():
    if shutil.which("cibuildwheel") is None:
        pytest.skip("cibuildwheel is not installed")
    result = subprocess.run(
        ["cibuildwheel", "--print-build-identifiers", "--platform", "linux"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    identifiers = set(result.stdout.split())
    for python in ("cp310", "cp311", "cp312", "cp313"):
        assert f"{python}-manylinux_x86_64" in identifiers
    assert all(i.endswith("-manylinux_x86_64") for i in identifiers), identifiers
