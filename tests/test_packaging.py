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
            "--no-build-isolation",
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


def test_wheel_installs_and_imports_in_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    # System site-packages only supply torch & co.; kt_kernel itself comes from the wheel.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
        check=True,
    )
    result = subprocess.run(
        [python, "-c", "import kt_kernel; print(kt_kernel.__file__); print(kt_kernel.__cpu_variant__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("KT_KERNEL_")},
    )
    assert result.returncode == 0, result.stderr
    module_file, variant = result.stdout.split()
    assert Path(module_file).is_relative_to(venv)
    assert variant in ("amx", "avx512", "avx2")


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
