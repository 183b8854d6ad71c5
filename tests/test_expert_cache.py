"""mmap_experts_dir (kt_kernel.expert_cache, src/core/packed_file.h): a layer's packed experts are
written at its first load and mapped at the later ones, computing bit for bit what packing gives on
every build and format; a file is used only under its key, and one that is not what its name
promises is packed and written again with a warning; a cache that cannot be written falls back to
anonymous memory; two processes filling one cache take turns."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_convert import write_model
from test_fp8 import write_model_dir
from test_gguf_file import write_layer as write_gguf
from test_gguf_kernels import gguf_tensor
from test_gpt_oss_checkpoint import ALPHA, LIMIT
from test_gpt_oss_checkpoint import write_checkpoint as write_gpt_oss
from test_int4_sources import write_layer as write_gptq
from test_nvfp4 import GLOBAL, write_modelopt
from test_nvfp4 import expert_weights as nvfp4_weights

from kt_kernel import convert, expert_cache, formats, quant
from kt_kernel.expert_weights import prepare, subpool_slice

from conftest import REPO, skip_unless_cpu_runs
from moe_reference import moe_wrapper, random_routing


def mapped(moe) -> bool:
    return all(sp.engine.mapped for sp in moe._subpools)


def packed_files(cache: Path) -> list[Path]:
    return sorted(cache.glob(f"*{expert_cache.SUFFIX}"))


def forward(moe, experts: int, hidden: int, tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids, weights = random_routing(tokens, experts, moe.num_experts_per_tok, g)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    return moe.forward(x, ids, weights)


# ---- the engine: saved, mapped, computing the same on every build ---------------------------------

E, K, H, I = 6, 2, 256, 128
BUILDS = ["avx2", "avx512", "amx", "amx_emulated"]
ENGINE_METHODS = ["BF16", "INT8", "INT4", "INT4-zeros-biases", "MXFP4", "FP8", "GGUF"]


def build_module(variant: str):
    skip_unless_cpu_runs("avx512" if variant == "amx_emulated" else variant)
    try:
        return importlib.import_module(f"kt_kernel._kt_kernel_{variant}")
    except ModuleNotFoundError:
        pytest.skip(f"the {variant} build is not installed (amx_emulated: KT_KERNEL_AMX_EMULATION=ON)")


def engine_tensors(method: str, g: torch.Generator):
    """(format, engine.load's arguments, its zero points, the slot map, biases or None)."""
    fmt = formats.get(method.split("-")[0])
    weights, scales, zeros = {}, {}, {}
    for name, n, k in (("gate", I, H), ("up", I, H), ("down", H, I)):
        w = torch.randn(E, n, k, generator=g) / k**0.5
        if method == "GGUF":  # factored scales held indexed where they fit: the held layouts
            values, scale = gguf_tensor(E, n, k, 32, g, factored=True)
        elif method == "BF16":
            values, scale = w.to(torch.bfloat16), None
        else:
            values, scale = quant.quantize(fmt.name, w)
        weights[f"{name}_proj"], scales[f"{name}_scale"] = values, scale
        if "zeros" in method:
            zeros[f"{name}_zeros"] = torch.randint(-8, 9, scale.shape, generator=g, dtype=torch.int8)
    slots = torch.tensor([5, 4, 3, 2, 1, 0])
    canonical, slot_map = prepare(fmt, weights, scales, slots, E, H, I, zeros or None)
    sliced, zero_points = subpool_slice(fmt, canonical, 0, I, I)
    biases = [torch.randn(E, rows, generator=g) for rows in (I, I, H)] if "biases" in method else None
    return fmt, sliced, zero_points, slot_map, biases


def run(engine, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids, weights = random_routing(tokens, E, K, g)
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    out = torch.empty(tokens, H, dtype=torch.bfloat16)
    engine.submit(x.view(torch.int16), ids, weights, out.view(torch.int16))
    engine.sync()
    return out


def read_back(engine, projection: str, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, k = (H, I) if projection == "down" else (I, H)
    values, scales = torch.zeros(rows, 4 * k, dtype=torch.uint8), torch.zeros(rows, 4 * k, dtype=torch.uint8)
    engine.unpack(projection, expert, 0, rows, 0, k, values.data_ptr(), 4 * k, scales.data_ptr(), 4 * k)
    return values, scales


@pytest.mark.parametrize("method", ENGINE_METHODS)
@pytest.mark.parametrize("variant", BUILDS)
def test_a_mapped_engine_computes_what_the_packed_one_does(tmp_path, variant, method):
    module = build_module(variant)
    fmt, sliced, zero_points, slot_map, biases = engine_tensors(method, torch.Generator().manual_seed(1))
    packed = module.MoEEngine(E, K, H, I, fmt.name, 2, [3])  # expert 3 on the GPU: packed all the same
    packed.load(*sliced, slot_map, **zero_points)
    if biases is not None:
        packed.set_biases(*biases)
    path = str(tmp_path / "engine.ktpacked")
    packed.save_packed(path, b'{"meta": 1}')
    view = module.MoEEngine(E, K, H, I, fmt.name, 2, [3])
    assert view.map_packed(path, True) == ("", b'{"meta": 1}')
    assert view.mapped and not packed.mapped
    for tokens, seed in ((1, 0), (7, 1), (40, 2)):  # decode and prefill
        assert torch.equal(run(view, tokens, seed), run(packed, tokens, seed))
    for projection in ("gate", "down"):  # write-back reads the mapped weights
        mine, theirs = read_back(view, projection, 4), read_back(packed, projection, 4)
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    if biases is not None:
        out = torch.empty(E, I)
        assert view.biases("up", out) and torch.equal(out, biases[1])
    # A later part of a load (an expert handed back) copies the mapped weights first: slot 1 now
    # holds source 0.
    one = [None if t is None else t[:1].contiguous() for t in sliced]
    zeros_of_one = {n: z[:1].contiguous() for n, z in zero_points.items()}
    for engine in (view, packed):
        engine.load(*one, torch.tensor([-1, 0, -1, -1, -1, -1]), **zeros_of_one)
    assert not view.mapped
    assert torch.equal(run(view, 9, 3), run(packed, 9, 3))


def corrupt(path: Path, offset: int, value: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value)


def flip(path: Path, offset: int, count: int = 2) -> None:
    """Every bit of ``count`` bytes at ``offset`` inverted: certainly other bytes."""
    with open(path, "rb") as f:
        f.seek(offset)
        old = f.read(count)
    corrupt(path, offset, bytes(b ^ 0xFF for b in old))


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda p: os.truncate(p, os.path.getsize(p) - 4096), "truncated"),
        (lambda p: os.truncate(p, 100), "shorter than a header"),
        (lambda p: corrupt(p, 0, b"XX"), "magic"),
        (lambda p: corrupt(p, 8, (99).to_bytes(4, "little")), "layout version 99"),
        (lambda p: flip(p, 100, 1), "header checksum mismatch"),
        (lambda p: flip(p, 3 * 4096 + 10), "content checksum mismatch"),
    ],
    ids=["truncated", "short", "magic", "version", "header", "content"],
)
def test_a_damaged_file_is_refused_with_its_reason(tmp_path, damage, reason):
    module = build_module("avx2")
    fmt, sliced, zero_points, slot_map, _ = engine_tensors("INT8", torch.Generator().manual_seed(2))
    packed = module.MoEEngine(E, K, H, I, fmt.name, 2, [])
    packed.load(*sliced, slot_map, **zero_points)
    path = tmp_path / "engine.ktpacked"
    packed.save_packed(str(path), b"")
    damage(path)
    view = module.MoEEngine(E, K, H, I, fmt.name, 2, [])
    found, meta = view.map_packed(str(path), True)
    assert reason in found and meta == b""
    assert not view.mapped
    with pytest.raises(RuntimeError, match="not loaded"):
        run(view, 1, 0)


def test_a_file_of_another_engine_is_refused(tmp_path):
    module = build_module("avx2")
    fmt, sliced, zero_points, slot_map, _ = engine_tensors("INT8", torch.Generator().manual_seed(3))
    packed = module.MoEEngine(E, K, H, I, fmt.name, 2, [])
    packed.load(*sliced, slot_map, **zero_points)
    path = str(tmp_path / "engine.ktpacked")
    packed.save_packed(path, b"")
    assert "not INT4" in module.MoEEngine(E, K, H, I, "INT4", 2, []).map_packed(path)[0]
    assert "another number of experts" in module.MoEEngine(E + 1, K, H, I, "INT8", 2, []).map_packed(path)[0]
    assert "another hidden" in module.MoEEngine(E, K, H, 2 * I, "INT8", 2, []).map_packed(path)[0]
    with pytest.raises(RuntimeError, match="File exists"):
        packed.save_packed(path, b"")  # never over a file: the cache writes a new name and renames it


# ---- the wrapper: every kind of checkpoint -------------------------------------------------------


class Source:
    """A checkpoint and the wrapper arguments that load one of its layers."""

    def __init__(self, path: Path, method: str, shape: tuple[int, int, int, int], layer: int = 0, **options):
        self.path, self.method, self.shape, self.layer, self.options = path, method, shape, layer, options

    def load(self, cache: Path | None, **overrides):
        args = dict(layer_idx=self.layer, method=self.method, weight_path=str(self.path))
        args["mmap_experts_dir"] = cache
        moe = moe_wrapper(*self.shape, **(args | self.options | overrides))
        moe.load_weights()
        return moe


# nvfp4: held as GGUF with E4M3 scale bytes and a factor per matrix, each expert's its own.
# gguf-low-bits: 2- and 3-bit value planes, 4- and 6-bit (biased) multiples.
CASES = [*formats.FORMATS, "gguf-k-quants", "gguf-low-bits", "gptq-zero-points", "gpt-oss-biases", "nvfp4"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each case's checkpoint, written once for the module: converted ones from one BF16 model."""
    made: dict[str, Source] = {}

    def get(case: str) -> Source:
        if case in made:
            return made[case]
        root = tmp_path_factory.mktemp(case)
        if case in formats.FORMATS:
            model = root / "hf"
            write_model(model, "deepseek", torch.bfloat16)
            convert.convert_checkpoint(model, root / "out", case, progress=False)
            made[case] = Source(root / "out", case, (4, 2, 160, 96), layer=1)
        elif case == "gguf-k-quants":
            write_gguf(root / "model.gguf", {"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K"})
            made[case] = Source(root / "model.gguf", "GGUF", (4, 2, 512, 256))
        elif case == "gguf-low-bits":
            write_gguf(root / "model.gguf", {"gate": "Q2_K", "up": "Q3_K", "down": "Q2_K"})
            made[case] = Source(root / "model.gguf", "GGUF", (4, 2, 512, 256))
        elif case == "nvfp4":
            scales = [GLOBAL * (1 + e / 7) for e in range(8)]
            write_modelopt(root, nvfp4_weights(3), global_scales=scales)
            made[case] = Source(root, "NVFP4", (8, 2, 256, 96))
        elif case == "gptq-zero-points":
            write_gptq(root / "model", "gptq", 32, asymmetric={1, 2}, inter=256)
            made[case] = Source(root / "model", "GPTQ_INT4", (4, 2, 256, 256))
        else:
            write_gpt_oss(root)
            options = {"swiglu_limit": LIMIT, "swiglu_alpha": ALPHA}
            made[case] = Source(root, "MXFP4", (32, 4, 96, 64), layer=1, **options)
        return made[case]

    return get


@pytest.mark.parametrize("pools", [1, 2], ids=["one-subpool", "two-subpools"])
@pytest.mark.parametrize("case", CASES)
def test_a_mapped_layer_computes_what_a_packed_one_does(tmp_path, sources, case, pools):
    source = sources(case)
    cache = tmp_path / "cache"
    first = source.load(cache, threadpool_count=pools)
    assert not mapped(first) and len(packed_files(cache)) == pools
    second = source.load(cache, threadpool_count=pools)
    assert mapped(second)
    plain = source.load(None, threadpool_count=pools)
    if case == "nvfp4":  # held as E4M3 scale bytes and a factor per matrix, which the file must carry
        experts, _, hidden, inter = source.shape
        held = sum(sp.engine.packed_bytes() for sp in plain._subpools)
        assert plain.weight_format == "GGUF" and held <= experts * 3 * (hidden * inter * 0.5625 + 4 * pools)
    experts, _, hidden, _ = source.shape
    for tokens in (1, 9, 40):
        expected = forward(plain, experts, hidden, tokens)
        assert torch.equal(forward(second, experts, hidden, tokens), expected)
        assert torch.equal(forward(first, experts, hidden, tokens), expected)
    assert second._weights.scale_groups == plain._weights.scale_groups
    assert second._weights.zero_points == plain._weights.zero_points
    if plain._weights.bias_table is None:
        assert second._weights.bias_table is None
    else:
        assert second._weights.bias_table.keys() == plain._weights.bias_table.keys()
        table = second._weights.bias_table
        assert all(torch.equal(table[n], b) for n, b in plain._weights.bias_table.items())


def test_write_back_reads_mapped_weights(tmp_path, sources):
    source = sources("INT4")
    cache = tmp_path / "cache"
    source.load(cache)
    moe, plain = source.load(cache), source.load(None)
    assert mapped(moe)
    sizes = plain.write_buffer_nbytes(1)
    assert moe.write_buffer_nbytes(1) == sizes
    buffers = {}
    for name, wrapper in (("mapped", moe), ("plain", plain)):
        b = {k: torch.zeros(max(v, 1), dtype=torch.uint8) for k, v in sizes.items()}
        wrapper.submit_write_weight_scale_to_buffer(
            1, 2, [b["w13_weight"].data_ptr()], [b["w13_scale"].data_ptr()], [b["w2_weight"].data_ptr()],
            [b["w2_scale"].data_ptr()],
        )  # fmt: skip
        buffers[name] = b
    assert all(torch.equal(buffers["mapped"][k], buffers["plain"][k]) for k in sizes)


# ---- the key -----------------------------------------------------------------------------------

EK, KK, HK, IK = 8, 2, 128, 64
ON_GPU = torch.tensor([True, True, False, False, True, False, False, True])


@pytest.fixture
def model(tmp_path) -> Path:
    """A BF16 Hugging Face model of two MoE layers."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in (0, 1):
        for e in range(EK):
            for name, n, k in (("gate_proj", IK, HK), ("up_proj", IK, HK), ("down_proj", HK, IK)):
                key = f"model.layers.{layer}.mlp.experts.{e}.{name}.weight"
                tensors[key] = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    write_model_dir(tmp_path / "model", tensors)
    return tmp_path / "model"


def key_wrapper(path: Path, cache: Path | None, **overrides):
    return moe_wrapper(EK, KK, HK, IK, weight_path=str(path), mmap_experts_dir=cache, **overrides)


def swap_two_experts_in_the_header(file: Path) -> None:
    """Experts 0 and 1 of layer 0's gate swapped by their header's data offsets: the same size, the
    same mtime, other weights."""
    data = bytearray(file.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    a, b = (f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in (0, 1))
    offsets_a, offsets_b = header[a]["data_offsets"], header[b]["data_offsets"]
    header[a]["data_offsets"], header[b]["data_offsets"] = offsets_b, offsets_a
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    status = file.stat()
    data[8 : 8 + length] = text + b" " * (length - len(text))
    file.write_bytes(bytes(data))
    os.utime(file, ns=(status.st_atime_ns, status.st_mtime_ns))


def touch(file: Path) -> None:
    status = file.stat()
    os.utime(file, ns=(status.st_atime_ns, status.st_mtime_ns + 1000))


CHANGES = {
    "layer": ({"layer_idx": 1}, None),
    "slot map": ({}, torch.tensor([1, 0, 2, 3, 4, 5, 6, 7])),
    "experts left out": ({"gpu_experts_mask": ON_GPU, "skip_gpu_expert_cpu_copy": True}, None),
    "subpool split": ({"threadpool_count": 2}, None),
    "source mtime": ("touch", None),
    "source header": ("swap", None),
    "code": ("code", None),
    "cache version": ("version", None),
}


@pytest.mark.parametrize("change", CHANGES)
def test_each_key_field_invalidates(model, tmp_path, monkeypatch, change):
    cache = tmp_path / "cache"
    options, slot_map = CHANGES[change]
    key_wrapper(model, cache).load_weights()
    assert len(packed_files(cache)) == 1
    if options == "touch":
        touch(model / "model.safetensors")
    elif options == "swap":
        swap_two_experts_in_the_header(model / "model.safetensors")
    elif options == "code":
        monkeypatch.setattr(expert_cache, "code_identity", lambda: {"python": "another version"})
    elif options == "version":
        monkeypatch.setattr(expert_cache, "CACHE_VERSION", expert_cache.CACHE_VERSION + 1)
    options = options if isinstance(options, dict) else {}
    files = 2 if options.get("threadpool_count") == 2 else 1
    changed = key_wrapper(model, cache, **options)
    changed.load_weights(slot_map)
    assert not mapped(changed) and len(packed_files(cache)) == 1 + files
    again = key_wrapper(model, cache, **options)
    again.load_weights(slot_map)
    assert mapped(again)
    plain = key_wrapper(model, None, **options)
    plain.load_weights(slot_map)
    assert torch.equal(forward(again, EK, HK, 9), forward(plain, EK, HK, 9))


def test_a_truncated_file_is_packed_again_with_a_warning(model, tmp_path):
    cache = tmp_path / "cache"
    key_wrapper(model, cache).load_weights()
    (file,) = packed_files(cache)
    os.truncate(file, file.stat().st_size // 2)
    moe = key_wrapper(model, cache)
    with pytest.warns(RuntimeWarning, match=r"cannot be used \(.*truncated"):
        moe.load_weights()
    assert not mapped(moe) and file.stat().st_size > 0
    again = key_wrapper(model, cache)
    again.load_weights()
    assert mapped(again) and torch.equal(forward(again, EK, HK, 5), forward(moe, EK, HK, 5))


def test_a_file_under_another_key_s_name_is_not_used(model, tmp_path):
    cache = tmp_path / "cache"
    key_wrapper(model, cache).load_weights()
    key_wrapper(model, cache, layer_idx=1).load_weights()
    layer0, layer1 = packed_files(cache)
    layer1.write_bytes(layer0.read_bytes())  # layer 0's weights under layer 1's name
    moe = key_wrapper(model, cache, layer_idx=1)
    with pytest.warns(RuntimeWarning, match="written for another key"):
        moe.load_weights()
    plain = key_wrapper(model, None, layer_idx=1)
    plain.load_weights()
    assert not mapped(moe) and torch.equal(forward(moe, EK, HK, 5), forward(plain, EK, HK, 5))


def test_weights_changed_on_disk_are_found_on_request(model, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    key_wrapper(model, cache).load_weights()
    (file,) = packed_files(cache)
    flip(file, 2 * 4096 + 3)
    key_wrapper(model, cache).load_weights()  # mapped: only the header is checked by default
    monkeypatch.setenv(expert_cache.VERIFY_ENV, "1")
    moe = key_wrapper(model, cache)
    with pytest.warns(RuntimeWarning, match="content checksum mismatch"):
        moe.load_weights()
    assert not mapped(moe)


# ---- GPU experts left out, and handed back --------------------------------------------------------


def test_experts_left_out_then_handed_back(model, tmp_path):
    cache = tmp_path / "cache"
    options = dict(gpu_experts_mask=ON_GPU.clone(), skip_gpu_expert_cpu_copy=True)
    key_wrapper(model, cache, **options).load_weights()
    lean = key_wrapper(model, cache, **options)
    lean.load_weights()
    full = key_wrapper(model, None, gpu_experts_mask=ON_GPU.clone())
    full.load_weights()
    assert mapped(lean)
    assert torch.equal(forward(lean, EK, HK, 9), forward(full, EK, HK, 9))
    for moe in (lean, full):
        moe.gpu_experts_mask[[0, 4]] = False  # handed back: read and packed, the layer copied off the file
    assert torch.equal(forward(lean, EK, HK, 9), forward(full, EK, HK, 9))
    assert not mapped(lean)


# ---- where the cache cannot be written -----------------------------------------------------------


def test_bad_directories_are_clear_errors(tmp_path, model):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="must be a directory"):
        key_wrapper(model, tmp_path / "file")
    with pytest.raises(TypeError, match="must be a path"):
        key_wrapper(model, 3)
    with pytest.raises(ValueError, match="non-empty"):
        key_wrapper(model, "")
    with pytest.warns(RuntimeWarning, match="cannot be made"):
        moe = key_wrapper(model, tmp_path / "file" / "cache")
    assert moe.mmap_experts_dir is None
    moe.load_weights()


FULL_DISK = """
import resource, signal, sys, warnings
sys.path.insert(0, "tests")
from moe_reference import moe_wrapper
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
moe = moe_wrapper(8, 2, 128, 64, weight_path=sys.argv[1], mmap_experts_dir=sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))  # as if the disk filled up
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    moe.load_weights()
print(len(caught), caught[0].category.__name__, caught[0].message)
"""


def test_a_full_disk_leaves_nothing_and_falls_back(model, tmp_path):
    cache = tmp_path / "cache"
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(model), str(cache)], capture_output=True, text=True, cwd=REPO,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("1 RuntimeWarning mmap_experts_dir: cannot write " + str(cache))
    assert "File too large" in result.stdout
    assert sorted(p.suffix for p in cache.iterdir()) == [".lock"]  # nothing half-written


READ_ONLY = """
import json, sys, torch, warnings
sys.path.insert(0, sys.argv[3])
from moe_reference import moe_wrapper
moe = moe_wrapper(8, 2, 128, 64, weight_path=sys.argv[1], mmap_experts_dir=sys.argv[2])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    moe.load_weights()
print(json.dumps([str(w.message) for w in caught]))
"""


def test_a_read_only_directory_falls_back_and_maps_what_it_holds(model, tmp_path):
    """Root writes anywhere: as root, the launch runs without capabilities (setpriv)."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: a read-only directory cannot be made")
        prefix = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]
    cache = tmp_path / "cache"
    cache.mkdir()

    def load() -> list[str]:
        cache.chmod(0o555)
        result = subprocess.run(
            [*prefix, sys.executable, "-c", READ_ONLY, str(model), str(cache), str(REPO / "tests")],
            capture_output=True, text=True, cwd=REPO, timeout=300,
        )  # fmt: skip
        cache.chmod(0o755)
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout)

    warned = load()
    assert len(warned) == 1 and "cannot write" in warned[0] and str(cache) in warned[0]
    assert list(cache.iterdir()) == []
    key_wrapper(model, cache).load_weights()  # filled by a writer
    for file in cache.iterdir():
        file.chmod(0o444)
    assert load() == []  # mapped, locked on the lock file opened read-only


# ---- two launches filling one cache -------------------------------------------------------------

FILL = """
import json, sys, warnings
sys.path.insert(0, "tests")
import torch
from moe_reference import make_problem, moe_wrapper
warnings.simplefilter("error")  # a launch that packs again or falls back fails
p = make_problem(8, 2, 128, 64, 9)
result = []
for layer in (0, 1):
    moe = moe_wrapper(8, 2, 128, 64, layer_idx=layer, weight_path=sys.argv[1], mmap_experts_dir=sys.argv[2])
    moe.load_weights()
    out = moe.forward(p.hidden, p.ids, p.weights)
    result.append([all(sp.engine.mapped for sp in moe._subpools), out.float().tolist()])
print(json.dumps(result))
"""


def test_two_launches_fill_one_cache_in_turn(model, tmp_path):
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_KERNEL_")}
    env["PYTHONPATH"] = str(REPO / "tests")
    launches = [
        subprocess.Popen(
            [sys.executable, "-c", FILL, str(model), str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )  # fmt: skip
        for _ in range(2)
    ]
    results = []
    for launch in launches:
        out, err = launch.communicate(timeout=300)
        assert launch.returncode == 0, err[-2000:]
        results.append(json.loads(out))
    assert [[r[1] for r in result] for result in results][0] == [r[1] for r in results[1]]
    assert len(packed_files(cache)) == 2 and not list(cache.glob("*.tmp*"))
    # Each layer was packed once: by one launch, while the other waited and then mapped it.
    for layer in (0, 1):
        assert sorted(result[layer][0] for result in results) == [False, True]


def test_stale_temporary_files_are_removed(model, tmp_path):
    cache = tmp_path / "cache"
    key_wrapper(model, cache).load_weights()
    (file,) = packed_files(cache)
    stale = file.with_name(file.name + ".tmp999-dead")
    stale.write_bytes(b"half")
    key_wrapper(model, cache).load_weights()
    assert not stale.exists()


# ---- filled ahead of a launch: python -m kt_kernel cache ----------------------------------------


def fill_command(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_KERNEL_")}
    return subprocess.run([sys.executable, "-m", "kt_kernel", "cache", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, check=False)  # fmt: skip


def test_the_cache_command_fills_what_a_launch_then_maps(model, tmp_path):
    cache = tmp_path / "cache"
    result = fill_command(str(model), "--dir", str(cache), "--threads", "2", "--threadpool-count", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 layers written, 0 already there" in result.stdout
    assert len(packed_files(cache)) == 4  # two layers, two subpools each
    for layer in (0, 1):
        launch = key_wrapper(model, cache, layer_idx=layer, threadpool_count=2)
        launch.load_weights()
        assert mapped(launch)
        plain = key_wrapper(model, None, layer_idx=layer, threadpool_count=2)
        plain.load_weights()
        assert torch.equal(forward(launch, EK, HK, 5), forward(plain, EK, HK, 5))
    again = fill_command(str(model), "--dir", str(cache), "--threads", "2", "--threadpool-count", "2")
    assert "0 layers written, 2 already there" in again.stdout, again.stderr[-3000:]
    one = fill_command(str(model), "--dir", str(tmp_path / "one"), "--layers", "1", "--threads", "1")
    assert "1 layers written" in one.stdout, one.stderr[-3000:]
    assert [f.name.startswith("layer0001") for f in packed_files(tmp_path / "one")] == [True]


def test_the_cache_command_names_what_it_cannot_fill(model, tmp_path):
    result = fill_command(str(model), "--dir", str(tmp_path / "cache"), "--layers", "5-7")
    assert result.returncode != 0 and "none of the layers asked for holds routed experts" in result.stderr
    result = fill_command(str(tmp_path / "nothing"), "--dir", str(tmp_path / "cache"))
    assert result.returncode != 0 and "neither a .gguf file nor a model directory" in result.stderr


def test_the_environment_turns_the_cache_on_for_a_client_that_does_not_pass_it(model, tmp_path, monkeypatch):
    """SGLang's integration builds the wrapper without mmap_experts_dir (its keyword set below):
    KT_KERNEL_MMAP_EXPERTS_DIR makes its second launch map what its first wrote."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(expert_cache.DIR_ENV, str(cache))

    def sglang_launch():
        from kt_kernel import KTMoEWrapper

        moe = KTMoEWrapper(
            layer_idx=0, num_experts=EK, num_experts_per_tok=KK, hidden_size=HK, moe_intermediate_size=IK,
            num_gpu_experts=0, cpuinfer_threads=2, threadpool_count=1, weight_path=str(model),
            chunked_prefill_size=512, method="BF16", max_deferred_experts_per_token=0,
        )  # fmt: skip
        moe.load_weights()
        return moe

    first = sglang_launch()
    assert not mapped(first) and len(packed_files(cache)) == 1 and first.mmap_experts_dir == str(cache)
    second = sglang_launch()
    assert mapped(second)
    assert torch.equal(forward(second, EK, HK, 6), forward(first, EK, HK, 6))
    monkeypatch.setenv(expert_cache.DIR_ENV, "")  # empty: no cache
    assert key_wrapper(model, None).mmap_experts_dir is None
