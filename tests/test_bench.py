"""The benchmark command runs end to end (figures are not asserted: performance lives in the command)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kt_kernel.__main__ import main as kt_main
from kt_kernel.formats import FORMATS
from kt_kernel.loader import VARIANTS, missing_flags

from conftest import HOST_FLAGS, REPO


def test_bench_all_variants_json(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "kt_kernel", "bench", "--shape", "tiny", "--tokens", "1", "64", "--calls", "3",
         "--variant", "all", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    machine = data["machine"]
    assert machine["threads"] >= 1 and machine["dram_gbps"] > 0 and machine["cpu"]
    runnable = [v for v in VARIANTS if not missing_flags(v, HOST_FLAGS)]
    builds = {row["variant"].removesuffix("-plain") for row in data["rows"]}
    assert builds == set(runnable)
    for row in data["rows"]:
        assert row["median_ms"] > 0 and row["calls"] == 3 and row["torch_median_ms"] > 0
        assert (row["pct_of_bandwidth"] is None) == (row["tokens"] > 8)
        assert (row["pct_of_peak"] is None) == (row["tokens"] <= 8)
    assert "median ms" in result.stdout and "tiny" in result.stdout
    for variant, peaks in machine["peak_gflops"].items():  # the AMX-BF16 probe runs on the amx build only
        assert (peaks["tile_bf16"] > 0) == (variant == "amx"), (variant, peaks)


TINY_STACK = ("--model", "tiny", "--layers", "3", "--tokens", "1", "--format", "int4", "--calls", "3")


def run_bench(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kt_kernel", "bench", *options], cwd=REPO, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def test_model_mode_json(tmp_path):
    """A tiny stack, with the options that imitate a model's surroundings on."""
    out = tmp_path / "model.json"
    result = run_bench(*TINY_STACK, "--weight-sets", "2", "--cache-clear-mib", "1", "--gap-ms", "0.1",
                       "--co-runner", "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["model"] == {"shape": "tiny", "layers": 3, "cache_clear_mib": 1, "gap_ms": 0.1,
                             "co_runner": True, "deferred": None}  # fmt: skip
    assert data["machine"]["dram_gbps"] > 0
    [row] = data["model_rows"]
    assert (row["shape"], row["format"], row["tokens"], row["layers"], row["weight_sets"]) == (
        "tiny", "int4", 1, 3, 2,
    )  # fmt: skip
    assert row["steps"] == 3
    for field in ("step_ms", "layer_ms", "single_ms", "ratio", "layer_gbps", "dram_gbps", "pct_of_dram"):
        assert row[field] > 0, field
    assert row["step_p10_ms"] <= row["step_p90_ms"]
    assert 0 <= row["sync_ms"] <= row["layer_ms"]
    assert row["threads"] >= 1
    assert "1-layer ms" in result.stdout
    assert "cache clearing 1 MiB read, gap 0.1 ms; co-runner on" in result.stdout


def test_model_mode_rows_of_both_activation_modes(tmp_path):
    """--activations int8 gives the model mode a row of the opt-in mode beside the exact one, each
    from wrappers built with that int8_activations."""
    out = tmp_path / "model.json"
    modes = ("--activations", "exact", "int8")
    result = run_bench(*TINY_STACK, "--format", "int4", "bf16", *modes, "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["model_rows"]
    kinds = [(r["format"], r["activations"]) for r in rows]
    assert kinds == [("int4", "exact"), ("int4", "int8"), ("bf16", "exact")]
    assert "int4-i8act" in result.stdout
    assert "-i8act: the opt-in int8_activations=True mode" in result.stdout


def test_model_mode_deferral():
    result = run_bench(*TINY_STACK, "--deferred", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "deferred experts 1" in result.stdout


@pytest.mark.parametrize(
    "options, message",
    [
        (["--model", "tiny", "--layers", "0"], "argument --layers: must be >= 1"),
        (["--model", "tiny", "--gap-ms", "-1"], "argument --gap-ms: must be >= 0"),
        (["--model", "tiny", "--cache-clear-mib", "-5"], "argument --cache-clear-mib: must be >= 0"),
        (["--model", "tiny", "--deferred", "x"], "argument --deferred: expected int"),
        (["--model", "nope"], "argument --model: invalid choice"),
        (["--model", "tiny", "--layers", "3", "--weight-sets", "4"], "--weight-sets 4 exceeds --layers 3"),
        (["--model", "tiny", "--layers", "3", "--weight-sets", "1"], "--weight-sets 1: consecutive layers"),
        (["--layers", "3"], "--layers needs --model"),
        (["--model", "tiny", "--shape", "tiny"], "--model names the shape"),
        (["--variant", "avx9"], "--variant 'avx9' is not a build; valid values: auto, all, amx"),
        *[
            (["--variant", v], f"--variant {v}: this CPU cannot run the {v} build")
            for v in VARIANTS
            if missing_flags(v, HOST_FLAGS)
        ],
    ],
)
def test_model_mode_refuses_bad_options(options, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(kt_main(["bench", *options]))
    assert exit_info.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_model_mode_fp8_weights_are_normal_codes():
    """The model mode's random FP8 weights are the codes real weights nearly all are: no zero or
    subnormal code (the kernels decode lines holding one by a slower path) and no NaN."""
    import torch

    from kt_kernel import formats

    codes = formats.get("fp8").random_values((64, 4096), torch.Generator().manual_seed(0))
    assert not ((codes & 0x78) == 0).any()
    assert not ((codes & 0x7F) == 0x7F).any()
    assert len(codes.unique()) == 254 - 16  # every other code occurs


def test_bench_avx512_plain(tmp_path):
    """`--variant avx512-plain`: the AVX512 build without its BF16 and VNNI paths, labelled so."""
    if missing_flags("avx512", HOST_FLAGS):
        pytest.skip("this CPU cannot run the avx512 build")
    out = tmp_path / "plain.json"
    result = run_bench("--shape", "tiny", "--tokens", "1", "--calls", "3", "--format", "int4", "--no-torch",
                       "--variant", "avx512-plain", "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert {row["variant"] for row in json.loads(out.read_text())["rows"]} == {"avx512-plain"}


def test_forced_builds_hold_torch_to_their_instruction_set():
    from kt_kernel.bench import variant_runs

    assert variant_runs("auto") == [("", {})]
    if missing_flags("avx2", HOST_FLAGS):
        pytest.skip("this CPU cannot run the avx2 build")
    ((build, env),) = variant_runs("avx2")
    assert build == "avx2" and env == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    if not missing_flags("avx512", HOST_FLAGS):
        ((build, env),) = variant_runs("avx512-plain")
        assert build == "avx512" and env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
        assert env["KT_KERNEL_DISABLE_AVX512_BF16"] == "1"
    if "avx_vnni" in HOST_FLAGS:  # the avx2 build without AVX-VNNI, as Haswell and Zen 1-4 run it
        ((build, env),) = variant_runs("avx2-plain")
        assert (
            build == "avx2"
            and env["KT_KERNEL_DISABLE_AVX_VNNI"] == "1"
            and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
        )
        assert [name for name, _ in variant_runs("all")].count("avx2") == 2


def guard_row(fmt: str, ms: float, torch_ms: float) -> dict:
    return {"variant": "avx2", "shape": "tiny", "format": fmt, "tokens": 64, "median_ms": ms,
            "torch_median_ms": torch_ms, "speedup_vs_torch": torch_ms / ms}  # fmt: skip


@pytest.mark.parametrize("retry_ms, status", [(1.0, 0), (3.0, 1)])
def test_guard_retries_a_slower_row_once_and_fails_when_it_is_slower_again(
    monkeypatch, capsys, retry_ms, status
):
    """The guard's verdicts, on worker results made up here (the real rows are timed by CI's run)."""
    from kt_kernel import bench_common

    calls = []

    def fake_workers(args, runs):
        calls.append((list(args.format), runs))
        if len(calls) == 1:
            return [{"rows": [guard_row("bf16", 1.0, 2.0), guard_row("int8", 3.0, 2.0)]}]
        return [{"rows": [guard_row("int8", retry_ms, 2.0)]}]

    monkeypatch.setattr(bench_common, "run_workers", fake_workers)
    monkeypatch.setattr(bench_common, "variant_runs", lambda spec: [("avx2", {"X": spec})])
    assert kt_main(["bench", "--guard", "--shape", "tiny", "--tokens", "64"]) == status
    assert [formats for formats, _ in calls] == [[f.lower() for f in FORMATS], ["int8"]]
    assert calls[1][1] == [("avx2", {"X": "all"})]  # the retry runs the slow row's build alone
    out = capsys.readouterr().out
    assert "retried; first 3.00 vs 2.00 ms" in out
    assert ("guard FAILED: slower than torch twice: avx2 int8 T=64" in out) == bool(status)


@pytest.mark.parametrize(
    "options", [("--model", "tiny"), ("--quick",), ("--no-torch",), ("--activations", "int8")]
)
def test_guard_refuses_options_it_cannot_honour(options, capsys):
    assert kt_main(["bench", "--guard", *options]) == 2
    assert "--guard" in capsys.readouterr().err


def test_formats_with_a_group_size(tmp_path):
    """fp8:16 (NVFP4's blocks), fp8:32 (MXFP8's), int4:32, gguf (Q4_K_M's mix) and gguf:q6_k run in
    both modes, the layer mode loading them in those groups; bytes per weight count their scales."""
    from kt_kernel.bench_common import weight_bytes

    assert weight_bytes("fp8:16") == 1 + 4 / 16 and weight_bytes("int4:32") == 0.5 + 4 / 32
    # held as their files: Q4_K's 6-bit multiples, Q6_K's 6-bit values and int8 multiples, fp16 factors
    q4_k, q6_k = 144 / 256, 210 / 256
    assert weight_bytes("gguf") == (2 * q4_k + q6_k) / 3  # Q4_K_M's mix
    assert weight_bytes("gguf:16") == 1 + 4 / 16
    out = tmp_path / "bench.json"
    result = run_bench("--shape", "tiny", "--tokens", "1", "--calls", "3", "--no-torch", "--json", str(out),
                       "--format", "fp8:16", "fp8:32", "int4:32", "gguf", "gguf:q6_k")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["format"] for row in rows] == ["fp8:16", "fp8:32", "int4:32", "gguf", "gguf:q6_k"]
    for row in rows:  # measured from packed_bytes(): the values and scales, and a little layout overhead
        assert row["held_bytes_per_weight"] == pytest.approx(weight_bytes(row["format"]), rel=0.03)
    result = run_bench(
        "--model", "tiny", "--layers", "2", "--tokens", "1", "--calls", "3", "--format", "fp8:16"
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize(
    "entry", ["fp8:64", "int8:32", "bf16:16", "fp8:x", "fp8:0", "nf4", "gguf:iq2_xs", "int4:q4_k"]
)
def test_format_entries_outside_the_registry_are_refused(entry, capsys):
    with pytest.raises(SystemExit) as exit_info:
        kt_main(["bench", "--format", entry])
    assert exit_info.value.code == 2
    assert repr(entry) in capsys.readouterr().err


@pytest.mark.parametrize(
    "fmt", ["gguf", "gguf:32", "gguf:q6_k", "gguf:q4_0", "gguf:iq4_xs", "gguf:q2_k", "gguf:q5_k", "gguf:q5_1"]
)
def test_gguf_rows_are_held_in_the_bytes_the_bench_counts(fmt):
    """The bench's GGUF weights, in both modes, are held as its figures assume (weight_bytes): Q4_K_M's
    scales factored and Q6_K's without mins, fp32 scales (8-bit per G), or as a ggml type is."""
    from kt_kernel import bench, bench_model
    from kt_kernel.bench_common import weight_bytes

    from moe_reference import moe_wrapper

    experts, top_k, hidden, inter = bench.SHAPES["tiny"]
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    layer, model = (moe_wrapper(experts, top_k, hidden, inter, method="GGUF") for _ in range(2))
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(experts, *shape, generator=generator) * 0.05 for shape in shapes]
    weights[0][0, 0, :32] = weights[0][0, 0, :32].abs()  # a scale group whose min is 0 (a file's -0.0)
    bench.load_bench_weights(layer, fmt, *weights)
    model.load_weights_from_tensors(**bench_model.canonical_weights("tiny", fmt, seed=0))
    expected = weight_bytes(fmt) * 3 * experts * hidden * inter
    held = [sum(sp.engine.packed_bytes() for sp in moe._subpools) for moe in (layer, model)]
    # rel: the tiny shape's 128-input rows are half a block of factored scales (a float per 256)
    assert held[0] == held[1] == pytest.approx(expected, rel=0.03)


def test_load_mode_prints_a_row_per_format(tmp_path):
    """A tiny layer in every checkpoint format, loaded once in a fresh process (figures not asserted)."""
    pytest.importorskip("gguf")
    out = tmp_path / "load.json"
    result = run_bench("--load", "--load-shape", "4", "256", "256", "--load-threads", "1", "--load-runs", "1",
                       "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["threads"]) for r in rows] == [
        (f, 1) for f in ("bf16", "fp8", "mxfp4", "nvfp4", "gguf")
    ]
    for row in rows:
        assert row["load_s"] > 0 and row["file_mib"] > 0 and row["held_per_file"] > 0
        assert row["format"] in result.stdout
    assert "GB/s of file" in result.stdout


def test_load_mode_with_the_cache_maps_and_computes_the_same(tmp_path):
    """--load-cache: a packed, a first (cache-filling) and a mapped row per format; the mapped
    processes hold the cache's pages shared, add no anonymous layer, and give the packed outputs."""
    out = tmp_path / "load.json"
    args = ["--load", "bf16", "--load-shape", "4", "256", "256", "--load-threads", "1", "--load-runs", "1"]
    result = run_bench(*args, "--load-cache", "--load-forward", "1", "8", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["packed", "first", "mapped"]
    assert [rows[m]["mapped"] for m in rows] == [False, False, True]
    assert all(row["same_outputs"] and set(row["forward_ms"]) == {"1", "8"} for row in rows.values())
    mapped = rows["mapped"]
    assert mapped["anon_mib"] < 0.05 * rows["packed"]["anon_mib"]
    assert 0 < mapped["cache_pss_mib"] < 0.6 * mapped["cache_rss_mib"]  # two processes share the pages
    assert "fwd ms T=8" in result.stdout and "cache Rss/Pss MiB" in result.stdout
