"""Import-time binding of the best compiled build: the rules are in kt_kernel.loader.select."""

from __future__ import annotations

import importlib
import os
import stat
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from .select import Selection, explain_variant, fallback_order

PROC_CPUINFO = "/proc/cpuinfo"
#: Far above the /proc/cpuinfo of any real machine (about 1.5 KiB per logical CPU).
MAX_CPUINFO_BYTES = 4 << 20


def debug(message: str) -> None:
    """Print one loader step to stderr when KT_KERNEL_DEBUG is set (and not 0)."""
    if os.environ.get("KT_KERNEL_DEBUG", "0") not in ("", "0"):
        print(f"[kt-kernel] {message}", file=sys.stderr)


def _read_text(path: str, limit: int = MAX_CPUINFO_BYTES) -> str:
    """At most ``limit`` bytes of a regular file, decoded; OSError otherwise. Regular is decided by
    stat before opening (opening a FIFO blocks); the size is not, since /proc files report 0."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(f"{path} is not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in still opens at once
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path} is larger than {limit} bytes")
    return data.decode("utf-8", errors="replace")


def read_cpuinfo() -> tuple[str, str]:
    """The CPU description as /proc/cpuinfo text, and where it came from.

    KT_KERNEL_CPUINFO names another file (recorded cpuinfo; used by the tests): one that cannot be
    read is an ImportError, not a silent fall back to this CPU. Without a readable /proc/cpuinfo,
    py-cpuinfo's CPUID flags are written as one 'flags' line.
    """
    override = os.environ.get("KT_KERNEL_CPUINFO")
    if override:
        try:
            return _read_text(override), override
        except OSError as error:
            raise ImportError(
                f"kt_kernel: cannot read {override!r}, the file KT_KERNEL_CPUINFO names ({error})"
            ) from error
    try:
        return _read_text(PROC_CPUINFO), PROC_CPUINFO
    except OSError as error:
        debug(f"cannot read {PROC_CPUINFO} ({error}); asking py-cpuinfo")
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
