"""kt_kernel.loader: picks the compiled build for this CPU. Pure Python; usable without any build."""

from .load import LoadedBuild, load_build, read_cpuinfo
from .select import (
    REQUIRED_FLAGS,
    VARIANTS,
    Selection,
    cpu_flags,
    explain_variant,
    fallback_order,
    missing_flags,
    select_variant,
)

__all__ = [
    "REQUIRED_FLAGS",
    "VARIANTS",
    "LoadedBuild",
    "Selection",
    "cpu_flags",
    "explain_variant",
    "fallback_order",
    "load_build",
    "missing_flags",
    "read_cpuinfo",
    "select_variant",
]
