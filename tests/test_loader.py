"""The loader: build selection from recorded /proc/cpuinfo texts, overrides, fallback, debug output."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

import kt_kernel
from kt_kernel import loader
from kt_kernel.loader import select_variant

from conftest import HOST_FLAGS, run_python, skip_unless_cpu_runs

CPUINFO = Path(__file__).parent / "data" / "cpuinfo"
EXPECTED: dict[str, str | None] = json.loads((CPUINFO / "expected.json").read_text())


def cpuinfo(name: str) -> str:
    return (CPUINFO / name).read_text()


def test_recorded_cpus_cover_the_field():
    assert len(EXPECTED) >= 8
    assert {"amx", "avx512", "avx2", None} <= set(EXPECTED.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recorded_cpu(name):
    expected = EXPECTED[name]
    if expected is None:
        with pytest.raises(ImportError, match="AVX2"):
            select_variant(cpuinfo(name))
    else:
        assert select_variant(cpuinfo(name)) == expected


def test_flags_of_every_processor_are_intersected():
    text = cpuinfo("masked_vm_mixed.txt")
    first_block = text.split("\n\n")[0]
    assert select_variant(first_block) == "amx"  # processor 0 alone would pass
    assert select_variant(text) == "avx2"


def test_vmx_flags_line_is_not_read_as_flags():
    with pytest.raises(ImportError):
        select_variant("vmx flags\t: avx2 fma f16c\nflags\t\t: sse sse2\n")


@pytest.mark.parametrize("text", ["", "processor : 0\nmodel name : Something\n"])
def test_empty_or_flagless_cpuinfo_needs_avx2(text):
    with pytest.raises(ImportError, match="AVX2"):
        select_variant(text)


SPR = "intel_sapphire_rapids_xeon_8480.txt"


@pytest.mark.parametrize(
    "override,expected",
    [
        ("avx2", "avx2"),
        ("AVX512", "avx512"),
        ("  amx ", "amx"),
        ("auto", "amx"),
        ("", "amx"),
        (None, "amx"),
        (" Auto ", "amx"),
        ("avx512_bf16", "avx512"),
        ("avx512_vnni", "avx512"),
        ("avx512_vbmi", "avx512"),
        ("AVX512_BASE", "avx512"),
    ],
)
def test_override_values(override, expected):
    assert select_variant(cpuinfo(SPR), override) == expected


@pytest.mark.parametrize("override", ["avx1024", "sse4", "amx512", "avx-512"])
def test_unknown_override_lists_valid_values(override):
    with pytest.raises(ImportError) as info:
        select_variant(cpuinfo(SPR), override)
    for valid in ("auto", "amx", "avx512", "avx2"):
        assert valid in str(info.value)


def test_override_the_cpu_cannot_run_names_missing_flags():
    with pytest.raises(ImportError, match="amx_tile amx_int8 amx_bf16"):
        select_variant(cpuinfo("amd_zen4_epyc_9654.txt"), "amx")
    with pytest.raises(ImportError, match="avx512f avx512bw avx512vl avx512dq"):
        select_variant(cpuinfo("amd_zen3_ryzen_5950x.txt"), "avx512")
    with pytest.raises(ImportError, match="avx2 fma f16c"):
        select_variant(cpuinfo("intel_sandy_bridge_xeon_e5_2670.txt"), "avx2")


def test_reason_says_what_better_builds_need():
    selection = loader.explain_variant(cpuinfo("intel_cascade_lake_xeon_8280.txt"))
    assert selection.variant == "avx512"
    assert "amx needs avx512_bf16" in selection.reason and "amx_tile" in selection.reason


def fake_importer(failing: set[str]):
    def importer(name: str) -> ModuleType:
        variant = name.rsplit("_", 1)[-1]
        if variant in failing:
            raise ImportError(f"simulated refusal of {variant}")
        module = ModuleType(name)
        module.VARIANT = variant
        return module

    return importer


def test_fallback_to_next_build_warns(monkeypatch, tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo(SPR))
    monkeypatch.setenv("KT_KERNEL_CPUINFO", str(path))
    monkeypatch.delenv("KT_KERNEL_CPU_VARIANT", raising=False)
    with pytest.warns(RuntimeWarning, match="the amx build failed to load: simulated refusal of amx"):
        built = loader.load_build(fake_importer({"amx"}))
    assert built.variant == "avx512" and built.selection.variant == "amx"
    with pytest.warns(RuntimeWarning, match="using the avx2 build"):
        assert loader.load_build(fake_importer({"amx", "avx512"})).variant == "avx2"
    with pytest.raises(ImportError, match="no build could be loaded"):
        loader.load_build(fake_importer({"amx", "avx512", "avx2"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader.load_build(fake_importer(set())).variant == "amx"


def test_py_cpuinfo_is_used_without_proc_cpuinfo(monkeypatch):
    monkeypatch.delenv("KT_KERNEL_CPUINFO", raising=False)
    monkeypatch.setattr(loader.load, "PROC_CPUINFO", "/nonexistent/cpuinfo")
    text, source = loader.read_cpuinfo()
    assert source == "py-cpuinfo"
    # py-cpuinfo's CPUID names know no AMX, but where it reads /proc/cpuinfo itself it reports AMX.
    assert select_variant(text) in ("amx", "avx512", "avx2")
    assert "avx2" in loader.cpu_flags(text)


def test_lying_cpuinfo_ends_in_a_real_fallback():
    """cpuinfo claims AMX; the amx module's own CPUID check refuses, the loader falls back."""
    if "amx_tile" in HOST_FLAGS:
        pytest.skip("this CPU really has AMX")
    result = run_python(
        "import warnings; warnings.simplefilter('always')\n"
        "import kt_kernel; print('VARIANT', kt_kernel.__cpu_variant__)",
        env={"KT_KERNEL_CPUINFO": str(CPUINFO / SPR)},
    )
    assert result.returncode == 0, result.stderr
    assert "RuntimeWarning" in result.stderr and "amx build failed to load" in result.stderr
    assert "CPUID lacks" in result.stderr
    assert "VARIANT avx512" in result.stdout or "VARIANT avx2" in result.stdout


def test_bad_override_at_import_is_an_import_error():
    result = run_python("import kt_kernel", env={"KT_KERNEL_CPU_VARIANT": "avx9000"})
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "valid values" in result.stderr


def test_debug_prints_each_step():
    result = run_python("import kt_kernel", env={"KT_KERNEL_DEBUG": "1", "KT_KERNEL_CPU_VARIANT": "avx2"})
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("[kt-kernel] ")]
    text = "\n".join(lines)
    assert "CPU flags read from /proc/cpuinfo" in text
    assert "KT_KERNEL_CPU_VARIANT='avx2'" in text
    assert "chose avx2: forced" in text
    assert "loaded " in text and "_kt_kernel_avx2" in text
    quiet = run_python("import kt_kernel", env={"KT_KERNEL_CPU_VARIANT": "avx2"})
    assert "[kt-kernel]" not in quiet.stderr


def test_cpu_info_and_cli():
    info = kt_kernel.cpu_info()
    assert info["variant"] == kt_kernel.__cpu_variant__
    assert set(info["builds_present"]) == {"amx", "avx512", "avx2"}
    assert info["flags"]["avx2"] is True and "reason" in info and "override" in info
    assert kt_kernel.__version__ and kt_kernel.__version__[0].isdigit()
    result = subprocess.run([sys.executable, "-m", "kt_kernel", "info"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"build in use      : {kt_kernel.__cpu_variant__}" in result.stdout
    assert "builds present    : amx avx512 avx2" in result.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "kt_kernel", "info", "--json"], capture_output=True, text=True
    )
    assert json.loads(as_json.stdout)["variant"] == kt_kernel.__cpu_variant__


def test_the_modules_cpu_checks_and_the_loader_agree_on_every_builds_flags():
    from kt_kernel._native import ext

    assert ext.BUILD_REQUIREMENTS == loader.REQUIRED_FLAGS
    assert tuple(ext.BUILD_REQUIREMENTS) == loader.VARIANTS  # best first, the same builds


@pytest.mark.parametrize("build", [*loader.VARIANTS, "amx_emulated"])
def test_every_build_has_a_kernel_and_a_path_for_every_registered_format(build):
    """Each module checks its kernel table when it loads (require_kernels_for_every_format): a
    format without a kernel, or without words for its path, fails the import, and kernel_info names
    a path of its own for every format (none falls back to INT8's)."""
    skip_unless_cpu_runs("avx512" if build == "amx_emulated" else build)
    try:
        module = importlib.import_module(f"kt_kernel._kt_kernel_{build}")
    except ModuleNotFoundError:
        pytest.skip(f"the {build} module is not built here")
    info = module.kernel_info()
    for name in module.FORMATS:
        path = info[f"{name.lower()}_path"]
        assert isinstance(path, str) and path, f"{build}: {name} has no path"


def test_the_fp8_block_is_the_engines():
    """FP8_BLOCK is kernels.h's kFp8Block, exported by the module: formats.py reads it, and
    sources.py reads formats.py's."""
    from kt_kernel import formats, sources
    from kt_kernel._native import ext

    assert formats.FP8_BLOCK == ext.FP8_BLOCK
    assert not hasattr(sources, "FP8_BLOCK")  # one source: it reads formats.FP8_BLOCK
    assert ext.FP8_BLOCK in ext.FORMATS["FP8"]["scale_groups"]
