"""load_weights() reads and packs a layer a part of its experts at a time (loading.LOAD_PARTS):
the engines end up with what one load of the whole layer gives them, zero points that only some
parts have included; a part that fails leaves the layer unloaded, not half old and half new; and
the memory a load needs beyond the packed layer is about one part."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_fp8 import expert_tensors, write_model_dir
from test_int4_sources import reference, write_layer

from kt_kernel import checkpoint, loading

from moe_reference import make_problem, moe_wrapper

E, K, H, I = 4, 2, 256, 128


@pytest.mark.parametrize("asymmetric", [{2, 3}, {0}], ids=["zero-points-arrive-late", "zero-points-first"])
def test_parts_give_what_a_whole_load_gives(tmp_path, monkeypatch, asymmetric):
    monkeypatch.setattr(loading, "LOAD_PARTS", E)  # one expert per part
    full = write_layer(tmp_path / "model", "gptq", 32, asymmetric=asymmetric)
    slot_map = torch.tensor([3, 0, 3, 1])  # expert 2 unused: its part is not read
    in_parts = moe_wrapper(E, K, H, I, method="GPTQ_INT4", weight_path=str(tmp_path / "model"))
    in_parts.load_weights(slot_map)
    tensors = checkpoint.read_layer(tmp_path / "model", 0, E, "GPTQ_INT4")
    assert "gate_zeros" in tensors  # the whole layer has zero points, some of them 0
    whole = moe_wrapper(E, K, H, I, method="GPTQ_INT4")
    whole.load_weights_from_tensors(
        tensors.pop("gate"), tensors.pop("up"), tensors.pop("down"), slot_map, **tensors
    )
    p = make_problem(E, K, H, I, tokens=9, seed=3)
    out = in_parts.forward(p.hidden, p.ids, p.weights)
    assert torch.equal(out, whole.forward(p.hidden, p.ids, p.weights))
    ref = reference(p, [w[slot_map] for w in full])
    assert ((out.double() - ref).norm() / ref.norm()).item() < 0.005


def test_parts_must_share_their_scale_groups():
    from kt_kernel import quant
    from kt_kernel._native import ext

    engine = ext.MoEEngine(E, K, H, I, "INT4", 1, [])
    g = torch.Generator().manual_seed(0)

    def part(group: int) -> list[torch.Tensor]:
        tensors = []
        for n, k in ((I, H), (I, H), (H, I)):
            values, scales = quant.quantize("INT4", torch.randn(E, n, k, generator=g), group_size=group)
            tensors += [values, scales]
        return tensors

    values, scales = torch.empty(1, 16, dtype=torch.uint8), torch.empty(1, 4)

    def read_back() -> None:  # raises while a slot is not packed
        engine.unpack("gate", 3, 0, 1, 0, 32, values.data_ptr(), 16, scales.data_ptr(), 4)

    engine.unload()
    engine.load(*part(32), torch.tensor([0, 1, -1, -1]))
    with pytest.raises(ValueError, match="scale groups of the parts before it"):
        engine.load(*part(64), torch.tensor([-1, -1, 2, 3]))
    with pytest.raises(RuntimeError, match="not loaded"):
        read_back()
    engine.load(*part(32), torch.tensor([-1, -1, 2, 3]))  # the layer completes
    read_back()


def test_the_checkpoint_is_indexed_once_per_load(tmp_path, monkeypatch):
    """Not once per part: a big model's index holds ~100k tensor names (0.45 s to sort out here)."""
    monkeypatch.setattr(loading, "LOAD_PARTS", E)
    write_layer(tmp_path / "model", "gptq", 32)
    calls = []
    index = checkpoint.index_checkpoint
    monkeypatch.setattr(checkpoint, "index_checkpoint", lambda path: calls.append(path) or index(path))
    moe_wrapper(E, K, H, I, method="GPTQ_INT4", weight_path=str(tmp_path / "model")).load_weights()
    assert len(calls) == 1


def test_a_part_that_fails_leaves_the_layer_unloaded(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "LOAD_PARTS", E)
    good, _ = expert_tensors("model.", 0, per_channel=False, seed=1)
    write_model_dir(tmp_path / "good", good)
    bad = dict(good)
    key = f"model.layers.0.mlp.experts.{E - 1}.down_proj.weight"  # in the last part
    bad[key] = bad[key].clone()
    bad[key].view(torch.uint8)[0, 0] = 0x7F  # NaN
    write_model_dir(tmp_path / "bad", bad)
    moe = moe_wrapper(E, K, H, 384, method="FP8", weight_path=str(tmp_path / "good"))
    moe.load_weights()
    p = make_problem(E, K, H, 384, tokens=2, seed=4)
    moe.forward(p.hidden, p.ids, p.weights)
    moe.weight_path = str(tmp_path / "bad")
    with pytest.raises(ValueError, match="NaN"):
        moe.load_weights()
    # Not the new layer's first experts with the old one's last.
    with pytest.raises(RuntimeError, match="not loaded"):
        moe.forward(p.hidden, p.ids, p.weights)


def test_errors_name_the_layer_s_expert_not_the_part_s(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "LOAD_PARTS", E)
    tensors, _ = expert_tensors("model.", 0, per_channel=False, seed=3)
    tensors["model.layers.0.mlp.experts.3.down_proj.weight"].view(torch.uint8)[1, 2] = 0xFF  # NaN
    write_model_dir(tmp_path / "model", tensors)
    moe = moe_wrapper(E, K, H, 384, method="FP8", weight_path=str(tmp_path / "model"))
    with pytest.raises(ValueError, match=r"down_proj holds an FP8 NaN code .*first at index \[3, 1, 2\]"):
        moe.load_weights()


def test_an_expert_stored_in_another_quantized_type_is_refused(tmp_path):
    tensors, _ = expert_tensors("model.", 0, per_channel=False, seed=4)
    key = "model.layers.0.mlp.experts.2.gate_proj.weight"
    tensors[key] = torch.randn(384, H).to(torch.bfloat16)  # one expert in BF16 among FP8 ones
    del tensors[key + "_scale_inv"]
    write_model_dir(tmp_path / "model", tensors)
    moe = moe_wrapper(E, K, H, 384, method="FP8", weight_path=str(tmp_path / "model"))
    with pytest.raises(ValueError, match=rf"{key}' is stored as BF16, expert 0's gate as F8_E4M3"):
        moe.load_weights()


MEASURE = """
import sys, torch
from kt_kernel import KTMoEWrapper
moe = KTMoEWrapper(layer_idx=0, num_experts=32, num_experts_per_tok=2, hidden_size=1024,
                   moe_intermediate_size=512, gpu_experts_mask=torch.zeros(32, dtype=torch.bool),
                   cpuinfer_threads=2, threadpool_count=1, weight_path=sys.argv[1], chunked_prefill_size=64,
                   method="FP8")
def rss(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
before = rss("VmRSS")
moe.load_weights()
print((rss("VmHWM") - before) * 1024)
"""


def test_memory_beyond_the_packed_layer_is_about_a_part(tmp_path):
    """Peak RSS while loading a 48 MiB FP8 layer in 16 parts: about one layer and a part (loading it
    whole took 2.2-2.5 layers)."""
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("under AddressSanitizer the resident memory is its allocator's (quarantine, shadow)")
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for e in range(32):
        for name, n, k in (("gate_proj", 512, 1024), ("up_proj", 512, 1024), ("down_proj", 1024, 512)):
            key = f"model.layers.0.mlp.experts.{e}.{name}.weight"
            tensors[key] = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
            tensors[key + "_scale_inv"] = torch.rand(n // 128, k // 128, generator=g) + 0.5
    write_model_dir(tmp_path / "model", tensors)
    del tensors
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path / "model")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    layer_bytes = 32 * 3 * 512 * 1024
    assert int(result.stdout) < 1.6 * layer_bytes, f"{int(result.stdout) / layer_bytes:.2f} layers"
