"""Shared helpers: which builds this CPU can run, and running Python in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_stream import Fake, build_fake

from kt_kernel.loader import REQUIRED_FLAGS, VARIANTS, cpu_flags, missing_flags

REPO = Path(__file__).resolve().parent.parent
HOST_FLAGS = cpu_flags(Path("/proc/cpuinfo").read_text())


def skip_unless_cpu_runs(variant: str) -> None:
    """Skip (saying which flags are missing) when this machine cannot execute `variant`."""
    missing = missing_flags(variant, HOST_FLAGS)
    if missing:
        pytest.skip(f"this CPU cannot run the {variant} build: it lacks {' '.join(missing)}")


def run_python(
    code: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (a clean import of kt_kernel) with extra environment."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KT_KERNEL_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


@pytest.fixture(scope="session")
def fake_library(tmp_path_factory) -> str:
    # One library for the session: the process loads the runtime once, at its first call with a stream.
    return build_fake(tmp_path_factory.mktemp("fake_cuda"))


@pytest.fixture(scope="module")
def fake(fake_library):
    """The stand-in CUDA runtime (tests/fake_stream.py), loaded by the first call with a stream."""
    library = fake_library
    os.environ["KT_KERNEL_CUDART"] = library  # the runtime is loaded once, at the first call with a stream
    yield Fake(library)
    del os.environ["KT_KERNEL_CUDART"]  # later modules: CPU tensors with a stream run directly again


__all__ = ["HOST_FLAGS", "REPO", "REQUIRED_FLAGS", "VARIANTS", "run_python", "skip_unless_cpu_runs"]
