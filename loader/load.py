"""Import-time binding of the best compiled build (see DESIGN.md, "Loader rules")."""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from .select import Selection, explain_variant, fallback_order

PROC_CPUINFO = "/proc/cpuinfo"


def debug(message: str) -> None:
    """Print one loader step to stderr when KT_KERNEL_DEBUG is set (and not 0)."""
    if os.environ.get("KT_KERNEL_DEBUG", "0") not in ("", "0"):
        print(f"[kt-kernel] {message}", file=sys.stderr)


def read_cpuinfo() -> tuple[str, str]:
    """The CPU description as /proc/cpuinfo text, and where it came from.

    KT_KERNEL_CPUINFO names another file (recorded cpuinfo; used by the tests). Without
    /proc/cpuinfo, py-cpuinfo's CPUID flags are written as one 'flags' line.
    """
    path = os.environ.get("KT_KERNEL_CPUINFO") or PROC_CPUINFO
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(), path
    except OSError as error:
        debug(f"cannot read {path} ({error}); asking py-cpuinfo")
    import cpuinfo  # py-cpuinfo

    flags = cpuinfo.get_cpu_info().get("flags", [])
    return "flags\t\t: " + " ".join(flags) + "\n", "py-cpuinfo"


@dataclass(frozen=True)
class LoadedBuild:
    module: ModuleType
    variant: str
    selection: Selection
    cpuinfo_source: str
    fallbacks: tuple[str, ...]  # one line per build that failed to load before this one


def module_name(variant: str) -> str:
    return f"kt_kernel._kt_kernel_{variant}"


def load_build(importer: Callable[[str], ModuleType] = importlib.import_module) -> LoadedBuild:
    """Choose the build for this CPU and import it, falling back to lower builds with a warning."""
    text, source = read_cpuinfo()
    debug(f"CPU flags read from {source}")
    override = os.environ.get("KT_KERNEL_CPU_VARIANT")
    debug(f"KT_KERNEL_CPU_VARIANT={override!r}" if override is not None else "KT_KERNEL_CPU_VARIANT not set")
    selection = explain_variant(text, override)
    debug(f"chose {selection.variant}: {selection.reason}")
    failures: list[str] = []
    for variant in fallback_order(selection.variant):
        try:
            module = importer(module_name(variant))
        except ImportError as error:
            failures.append(f"the {variant} build failed to load: {error}")
            debug(failures[-1])
            continue
        if failures:
            warnings.warn(
                f"kt_kernel: {'; '.join(failures)}; using the {variant} build instead",
                RuntimeWarning,
                stacklevel=3,
            )
        debug(f"loaded {getattr(module, '__file__', module_name(variant))}")
        return LoadedBuild(module, variant, selection, source, tuple(failures))
    raise ImportError("kt_kernel: no build could be loaded: " + "; ".join(failures))
