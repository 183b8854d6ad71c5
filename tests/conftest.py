"""Shared helpers: which builds this CPU can run, and running Python in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


__all__ = ["HOST_FLAGS", "REPO", "REQUIRED_FLAGS", "VARIANTS", "run_python", "skip_unless_cpu_runs"]
