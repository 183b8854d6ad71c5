"""Hostile files: FIFOs, malformed safetensors and indexes, huge --layers ranges, a full disk,
concurrent and killed converters, non-finite weights, unreadable KT_KERNEL_CPUINFO."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from test_convert import write_model

from kt_kernel import checkpoint, convert, formats, quant, safetensors_io
from kt_kernel.__main__ import main
from kt_kernel.loader import load, read_cpuinfo
from kt_kernel.safetensors_io import CheckpointError

from conftest import REPO, run_python

FORMATS = tuple(formats.FORMATS)  # every registered format


@pytest.fixture(autouse=True)
def no_hang():
    """Every test here must finish promptly: a blocking open of a FIFO becomes a failure, not a hang."""

    def interrupt(signum, frame):
        raise TimeoutError("the test blocked for 60 s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def safetensors_bytes(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file by hand: 8-byte little-endian header length, header, data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


def tensor(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# ---- safetensors files ----------------------------------------------------------------------


MALFORMED = {
    "shorter than the length field": b"\x10\x00\x00",
    "length past the end": safetensors_bytes({"a": tensor("U8", [4], 0, 4)}, b"1234", length=1000),
    "length beyond the limit": safetensors_bytes(b"{}", length=1 << 40),
    "invalid JSON": safetensors_bytes(b'{"a": {"dtype": "U8", ', b"1234"),
    "not UTF-8": safetensors_bytes(b'{"\xff\xfe": 1}'),
    "not an object": safetensors_bytes([1, 2, 3]),
    "a name twice": safetensors_bytes(
        b'{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, '
        b'"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}',
        b"1234",
    ),
    "offsets past the data": safetensors_bytes({"a": tensor("U8", [8], 0, 8)}, b"1234"),
    "offsets reversed": safetensors_bytes({"a": tensor("U8", [0], 3, 1)}, b"1234"),
    "negative offset": safetensors_bytes({"a": tensor("U8", [2], -2, 0)}, b"1234"),
    "overlapping": safetensors_bytes({"a": tensor("U8", [3], 0, 3), "b": tensor("U8", [3], 1, 4)}, b"1234"),
    "shape vs bytes": safetensors_bytes({"a": tensor("F32", [2], 0, 4)}, b"1234"),
    "huge shape": safetensors_bytes({"a": tensor("U8", [1 << 62] * 1000, 0, 4)}, b"1234"),
    "unknown dtype": safetensors_bytes({"a": tensor("Q3", [4], 0, 4)}, b"1234"),
    "no shape": safetensors_bytes({"a": {"dtype": "U8", "data_offsets": [0, 4]}}, b"1234"),
    "bool shape": safetensors_bytes({"a": tensor("U8", [True], 0, 1)}, b"1234"),
    "metadata not strings": safetensors_bytes({"__metadata__": {"x": 1}}),
}


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_safetensors_names_the_file(tmp_path, content):
    file = tmp_path / "bad.safetensors"
    file.write_bytes(content)
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        safetensors_io.read_safetensors_header(file)
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        safetensors_io.index_checkpoint(tmp_path)


def test_well_formed_header_is_read(tmp_path):
    file = tmp_path / "ok.safetensors"
    header = {"__metadata__": {"k": "v"}, "a": tensor("F4", [4], 0, 2), "b": tensor("U8", [0, 5], 2, 2)}
    file.write_bytes(safetensors_bytes(header, b"12"))
    read = safetensors_io.read_safetensors_header(file)
    assert read.tensors == {"a": ("F4", [4]), "b": ("U8", [0, 5])} and read.metadata == {"k": "v"}


def test_what_safetensors_refuses_is_a_checkpoint_error(tmp_path):
    """A gap between tensors passes the header checks; safetensors' own refusal is wrapped."""
    file = tmp_path / "gap.safetensors"
    file.write_bytes(safetensors_bytes({"a": tensor("U8", [2], 2, 4)}, b"1234"))
    with pytest.raises(CheckpointError, match="gap.safetensors: cannot read tensor 'a'"):
        with ExitStack() as stack:
            safetensors_io.TensorReader(safetensors_io.index_checkpoint(file), stack).read("a")


def test_fifos_are_refused_without_blocking(tmp_path):
    directory = tmp_path / "model"
    write_model(directory, "deepseek", torch.bfloat16)
    os.mkfifo(directory / "zz-extra.safetensors")
    with pytest.raises(CheckpointError, match="zz-extra.safetensors: not a regular file"):
        safetensors_io.index_checkpoint(directory)
    with pytest.raises(CheckpointError, match="zz-extra.safetensors: not a regular file"):
        safetensors_io.index_checkpoint(directory / "zz-extra.safetensors")  # a single-file checkpoint
    assert main(["convert", str(directory), str(tmp_path / "out"), "--format", "bf16"]) == 1
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a regular file"):
        safetensors_io.index_checkpoint(tmp_path)


def test_fifo_shard_named_by_the_index_is_refused(tmp_path):
    directory = tmp_path / "model"
    write_model(directory, "deepseek", torch.bfloat16, shards=2)
    shard = directory / "model-00002-of-00002.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(
        CheckpointError, match="model-00002-of-00002.safetensors, which is not a regular file"
    ):
        safetensors_io.index_checkpoint(directory)


def test_index_naming_a_missing_shard(tmp_path):
    directory = tmp_path / "model"
    write_model(directory, "deepseek", torch.bfloat16, shards=2)
    (directory / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="names the shard .*model-00001-of-00002.safetensors"):
        safetensors_io.index_checkpoint(directory)


def test_index_entry_absent_from_its_shard(tmp_path):
    directory = tmp_path / "model"
    write_model(directory, "deepseek", torch.bfloat16, shards=2)
    index = directory / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    key = "model.layers.1.mlp.experts.0.gate_proj.weight"
    shard = content["weight_map"][key]
    content["weight_map"][key] = next(f for f in set(content["weight_map"].values()) if f != shard)
    index.write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match=f"holds no tensor '{key}', though the index names it"):
        convert.convert_checkpoint(directory, tmp_path / "out", "BF16", progress=False)


def test_malformed_shard_behind_an_index_names_the_shard(tmp_path):
    directory = tmp_path / "model"
    write_model(directory, "deepseek", torch.bfloat16, shards=2)
    shard = directory / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = (len(data)).to_bytes(8, "little")  # the header length now runs past the end
    shard.write_bytes(bytes(data))
    assert main(["convert", str(directory), str(tmp_path / "out"), "--format", "mxfp4", "--quiet"]) == 1
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: not a valid safetensors"):
        convert.convert_checkpoint(directory, tmp_path / "out", "MXFP4", progress=False)


# ---- index files ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        {"weight_map": ["a.safetensors"]},
        {"weight_map": None},
        {"weight_map": 7},
        {"weight_map": {"a": 1}},
        {"weight_map": {"a": ["a.safetensors"]}},
        {"weight_map": {"a": ""}},
        {"metadata": {}},
        [1, 2],
        "text",
    ],
    ids=repr,
)
def test_malformed_weight_map_names_the_index(tmp_path, content):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        safetensors_io.index_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "entry", ["../outside/x.safetensors", "sub/../../x.safetensors", "/etc/passwd", ".."]
)
def test_index_entries_stay_inside_the_directory(tmp_path, entry):
    directory = tmp_path / "model"
    directory.mkdir()
    (tmp_path / "outside").mkdir()
    save_file({"a": torch.zeros(2)}, str(tmp_path / "outside" / "x.safetensors"))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": entry}}))
    with pytest.raises(CheckpointError, match=f"entry '{entry}' is not a file inside"):
        safetensors_io.index_checkpoint(directory)


def test_symlinked_shards_are_read(tmp_path):
    """A Hugging Face cache: the shards are symlinks into a directory beside the checkpoint."""
    (tmp_path / "blobs").mkdir()
    save_file({"a": torch.zeros(2)}, str(tmp_path / "blobs" / "0123abcd"))
    directory = tmp_path / "snapshot"
    directory.mkdir()
    (directory / "sub").mkdir()
    (directory / "sub" / "model.safetensors").symlink_to("../../blobs/0123abcd")
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "./sub/model.safetensors"}})
    )
    assert safetensors_io.index_checkpoint(directory) == {"a": directory / "sub" / "model.safetensors"}


def test_index_read_is_bounded(tmp_path, monkeypatch):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "a.safetensors"}, "padding": "x" * 200}))
    monkeypatch.setattr(safetensors_io, "MAX_JSON_BYTES", 100)
    with pytest.raises(CheckpointError, match="index.json: larger than 100 bytes"):
        safetensors_io.index_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "layers",
    [[], {"1": {"file": "../x.safetensors", "experts": 4, "hidden": 8, "intermediate": 8}}, {"1": 5}],
)
def test_malformed_manifest_names_the_manifest(tmp_path, layers):
    (tmp_path / "kt_manifest.json").write_text(json.dumps({"format": "BF16", "layers": layers}))
    with pytest.raises(CheckpointError, match="kt_manifest.json"):
        checkpoint.read_converted_layer(tmp_path, 1, 4, "BF16")


def test_fifo_manifest_is_refused(tmp_path):
    os.mkfifo(tmp_path / "kt_manifest.json")
    with pytest.raises(CheckpointError, match="kt_manifest.json: not a regular file"):
        checkpoint.read_manifest(tmp_path)


# ---- kt-kernel convert ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The small checkpoint of test_convert: MoE layers 1 and 2, DeepSeek naming, BF16."""
    directory = tmp_path_factory.mktemp("model") / "deepseek"
    write_model(directory, "deepseek", torch.bfloat16)
    return directory


@pytest.mark.parametrize("layers", ["0-99999999", "1-99999999", "99999999999999999999", "2,5-9000000000"])
def test_layer_range_beyond_the_model_is_quick(tmp_path, model, capsys, layers):
    start = time.monotonic()
    assert main(["convert", str(model), str(tmp_path / "out"), "--format", "bf16", "--layers", layers]) == 1
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hold no routed experts (MoE layers: 1-2)" in err, err
    assert not (tmp_path / "out").exists()


def test_unparsable_layers_is_a_usage_error(tmp_path, model, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(model), str(tmp_path / "out"), "--format", "bf16", "--layers", "1-x"])
    assert exit_info.value.code == 2 and "--layers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "failure",
    [OSError(errno.ENOSPC, "No space left on device"), SafetensorError("IoError: No space left on device")],
    ids=["OSError", "SafetensorError"],
)
def test_full_disk_is_one_line_naming_the_file(tmp_path, model, monkeypatch, capsys, failure):
    real_write = convert.write_safetensors

    def fill_the_disk(tensors, path, metadata):
        if "layer_002" in path.name:
            path.write_bytes(b"the first blocks")
            raise failure
        real_write(tensors, path, metadata)

    monkeypatch.setattr(convert, "write_safetensors", fill_the_disk)
    out = tmp_path / "out"
    assert main(["convert", str(model), str(out), "--format", "mxfp4", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"cannot write {out / 'layer_002.safetensors'}" in err and "No space left on device" in err
    assert sorted(p.name for p in out.iterdir()) == [
        ".kt_manifest.lock",
        "kt_manifest.json",
        "layer_001.safetensors",
    ]
    assert list(checkpoint.read_manifest(out)["layers"]) == ["1"]


def test_full_disk_while_writing_the_manifest(tmp_path, model, monkeypatch, capsys):
    real_write_text = Path.write_text

    def full(self, *args, **kwargs):
        if self.name.startswith(".kt_manifest.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    out = tmp_path / "out"
    assert main(["convert", str(model), str(out), "--format", "bf16", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write {out / 'kt_manifest.json'}" in err
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))


def test_full_disk_on_a_real_device(tmp_path, model, monkeypatch, capsys):
    """/dev/full: every write fails with ENOSPC."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    real_write = convert.write_safetensors
    monkeypatch.setattr(convert, "write_safetensors", lambda t, path, m: real_write(t, Path("/dev/full"), m))
    assert main(["convert", str(model), str(tmp_path / "out"), "--format", "int8", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "layer_001.safetensors" in err and "No space left" in err


def test_stale_temporary_files_of_dead_runs_only_are_removed(tmp_path, model):
    out = tmp_path / "out"
    out.mkdir()
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
        files = {
            "dead": out / f".layer_001.safetensors.{int(dead.stdout)}.tmp",
            "dead manifest": out / f".kt_manifest.json.{int(dead.stdout)}.tmp",
            "alive": out / f".layer_002.safetensors.{alive.pid}.tmp",
            "not ours": out / ".notes.123.tmp",
        }
        for file in files.values():
            file.write_bytes(b"in progress")
        convert.convert_checkpoint(model, out, "BF16", layers=[1], progress=False)
        alive.kill()
    assert [name for name, file in files.items() if file.exists()] == ["alive", "not ours"]


# Conversions in a child process, each quantize call slowed down so that the runs take a moment:
# long enough to be killed mid-layer, or to overlap with another run.
SLOW_CONVERT = """
import sys, time
from kt_kernel import formats
from kt_kernel.__main__ import main
real = formats.WeightFormat.quantize
formats.WeightFormat.quantize = lambda *args, **kwargs: time.sleep(0.02) or real(*args, **kwargs)
sys.exit(main(sys.argv[1:]))
"""
LAYERS = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Path:
    """LAYERS MoE layers of 4 experts, H = I = 64, DeepSeek naming, BF16."""
    directory = tmp_path_factory.mktemp("stack")
    generator = torch.Generator().manual_seed(5)
    named = {
        f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight": torch.randn(64, 64, generator=generator).to(
            torch.bfloat16
        )
        for layer in range(LAYERS)
        for e in range(4)
        for p in ("gate", "up", "down")
    }
    save_file(named, str(directory / "model.safetensors"))
    return directory


def slow_convert(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_CONVERT, "convert", *args, "--quiet"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_concurrent_runs_into_one_directory_land_all_layers(tmp_path, stack):
    out = tmp_path / "out"
    half = LAYERS // 2
    runs = [slow_convert(str(stack), str(out), "--format", "mxfp4", "--layers", f"{a}-{b}") for a, b in
            ((0, half - 1), (half, LAYERS - 1))]  # fmt: skip
    for run in runs:
        _, err = run.communicate(timeout=50)
        assert run.returncode == 0, err
    manifest = checkpoint.read_manifest(out)
    assert list(manifest["layers"]) == [str(layer) for layer in range(LAYERS)]
    for layer in range(LAYERS):
        assert checkpoint.read_converted_layer(out, layer, 4, "MXFP4")["gate"].shape == (4, 64, 32)
    assert not list(out.glob(".*.tmp"))


def test_resume_after_sigkill_is_byte_identical(tmp_path, stack):
    killed = tmp_path / "killed"
    run = slow_convert(str(stack), str(killed), "--format", "int4")
    try:
        while not (killed / "layer_000.safetensors").exists():
            assert run.poll() is None, run.communicate()
            time.sleep(0.005)
        run.send_signal(signal.SIGKILL)
    finally:
        run.communicate(timeout=30)
    assert run.returncode == -signal.SIGKILL
    manifest = checkpoint.read_manifest(killed)  # None when killed before its first write
    assert manifest is None or len(manifest["layers"]) < LAYERS  # it was killed mid-run

    assert main(["convert", str(stack), str(killed), "--format", "int4", "--resume", "--quiet"]) == 0
    fresh = tmp_path / "fresh"
    assert main(["convert", str(stack), str(fresh), "--format", "int4", "--quiet"]) == 0
    assert files_of(killed) == files_of(fresh)
    assert sorted(files_of(fresh)) == [".kt_manifest.lock", "kt_manifest.json"] + [
        f"layer_{layer:03d}.safetensors" for layer in range(LAYERS)
    ]


def test_written_files_are_deterministic(tmp_path, stack):
    """Layer files do not depend on the process (safetensors' save_file orders metadata by chance)."""
    code = "import sys; from kt_kernel.__main__ import main; sys.exit(main(['convert', *sys.argv[1:]]))"
    for name in ("a", "b"):
        args = [str(stack), str(tmp_path / name), "--format", "bf16", "--layers", "3", "--quiet"]
        subprocess.run([sys.executable, "-c", code, *args], check=True, cwd=REPO)
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")
    layer = tmp_path / "a" / "layer_003.safetensors"
    metadata = safetensors_io.read_safetensors_header(layer).metadata
    assert metadata == {"experts": "4", "format": "BF16", "layer": "3"}
    source = load_file(stack / "model.safetensors")["model.layers.3.mlp.experts.1.gate_proj.weight"]
    assert torch.equal(load_file(layer)["blk.3.ffn_gate_exps.weight"][1], source)


# ---- non-finite weights ---------------------------------------------------------------------


@pytest.mark.parametrize("method", [*FORMATS, "AMXINT4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_refuses_non_finite_weights(method, bad, dtype):
    weight = torch.randn(4, 128).to(dtype)
    weight[2, 77] = bad
    with pytest.raises(ValueError, match=rf"holds {bad} at index \[2, 77\]: NaN and Inf cannot be quantized"):
        quant.quantize(method, weight)


@pytest.mark.parametrize("fmt", FORMATS)
def test_convert_refuses_a_nan_expert_naming_the_key(tmp_path, model, capsys, fmt):
    source = tmp_path / "model"
    source.mkdir()
    named = load_file(model / "model-00001-of-00001.safetensors")
    key = "model.layers.2.mlp.experts.3.down_proj.weight"
    named[key][5, 7] = float("nan")
    save_file(named, str(source / "model.safetensors"))
    assert main(["convert", str(source), str(tmp_path / "out"), "--format", fmt.lower(), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and f"tensor '{key}' cannot be converted" in err and "nan at index [5, 7]" in err
    )


def test_convert_refuses_an_inf_in_fused_experts(tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    gate_up = torch.randn(2, 64, 32)
    gate_up[1, 40, 3] = float("inf")  # row 40 of 2I = 64: the up half
    save_file(
        {
            "model.layers.0.mlp.experts.gate_up_proj": gate_up,
            "model.layers.0.mlp.experts.down_proj": torch.randn(2, 32, 32),
        },
        str(source / "model.safetensors"),
    )
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.experts.gate_up_proj' \(expert 1, up\)"):
        convert.convert_checkpoint(source, tmp_path / "out", "BF16", progress=False)


# ---- KT_KERNEL_CPUINFO ----------------------------------------------------------------------


def test_missing_cpuinfo_override_is_an_import_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KT_KERNEL_CPUINFO", str(tmp_path / "missing"))
    with pytest.raises(ImportError, match=r"cannot read '.*missing', the file KT_KERNEL_CPUINFO names"):
        read_cpuinfo()


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "too large"])
def test_cpuinfo_override_must_be_a_small_regular_file(monkeypatch, tmp_path, kind):
    path = tmp_path / "cpuinfo"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = Path("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    else:
        with open(path, "wb") as f:
            f.truncate(load.MAX_CPUINFO_BYTES + 1)  # sparse: no disk used
    monkeypatch.setenv("KT_KERNEL_CPUINFO", str(path))
    reason = "larger than" if kind == "too large" else "not a regular file"
    with pytest.raises(ImportError, match=f"KT_KERNEL_CPUINFO names .*{reason}"):
        read_cpuinfo()


def test_proc_cpuinfo_is_read_though_its_size_is_zero(monkeypatch):
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo")
    monkeypatch.delenv("KT_KERNEL_CPUINFO", raising=False)
    text, source = read_cpuinfo()
    assert source == "/proc/cpuinfo" and "flags" in text


def test_import_with_missing_cpuinfo_override_fails(tmp_path):
    result = run_python("import kt_kernel", env={"KT_KERNEL_CPUINFO": str(tmp_path / "nope")})
    assert result.returncode != 0
    assert "ImportError: kt_kernel: cannot read" in result.stderr and "KT_KERNEL_CPUINFO" in result.stderr
