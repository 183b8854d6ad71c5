"""skip_gpu_expert_cpu_copy=True: the experts gpu_experts_mask marks at load are left out of CPU
memory; one the mask hands back later is read from weight_path at the next submit, or is a clear
error when the weights came from tensors."""

from __future__ import annotations

import json

import pytest
import torch
from test_fp8 import write_model_dir

from conftest import run_python
from moe_reference import make_problem, moe_wrapper

E, K, H, I = 8, 2, 128, 64
ON_GPU = torch.tensor([True, True, False, False, True, False, False, True])


def routed_to(problem, experts: list[int]):
    """The problem's calls, routed only to `experts` (the mask skips the rest anyway)."""
    ids = torch.tensor(experts)[torch.arange(problem.ids.numel()) % len(experts)].view_as(problem.ids)
    return problem.hidden, ids, problem.weights


def hf_dir(tmp_path, problem) -> str:
    tensors = {}
    for e in range(E):
        projections = (problem.gate, problem.up, problem.down)
        for name, weights in zip(("gate_proj", "up_proj", "down_proj"), projections, strict=True):
            tensors[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = weights[e].to(torch.bfloat16)
    write_model_dir(tmp_path / "model", tensors)
    return str(tmp_path / "model")


def test_from_tensors_gpu_experts_are_left_out_and_handing_one_back_is_an_error():
    p = make_problem(E, K, H, I, 5)
    lean = moe_wrapper(E, K, H, I, gpu_experts_mask=ON_GPU, skip_gpu_expert_cpu_copy=True)
    full = moe_wrapper(E, K, H, I, gpu_experts_mask=ON_GPU)
    for moe in (lean, full):
        moe.load_weights_from_tensors(p.gate, p.up, p.down)
    call = routed_to(p, list(range(E)))  # GPU experts in the routing are skipped, as by default
    assert torch.equal(lean.forward(*call), full.forward(*call))
    h13, h2 = torch.empty(2 * I, H, dtype=torch.bfloat16), torch.empty(H, I, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not in CPU memory"):
        lean.submit_write_weight_scale_to_buffer(1, 0, [h13.data_ptr()], None, [h2.data_ptr()], None)
    # Expert 2 is a CPU expert: it writes back.
    lean.submit_write_weight_scale_to_buffer(1, 2, [h13.data_ptr()], None, [h2.data_ptr()], None)
    lean.gpu_experts_mask[1] = False
    with pytest.raises(RuntimeError, match=r"experts \[1\] are not in CPU memory"):
        lean.forward(*call)
    lean.gpu_experts_mask[1] = True  # back to what is in memory: the layer goes on
    assert torch.equal(lean.forward(*call), full.forward(*call))


def test_from_a_checkpoint_an_expert_handed_back_is_read_at_the_next_submit(tmp_path):
    p = make_problem(E, K, H, I, 6)
    path = hf_dir(tmp_path, p)
    slot_map = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])
    lean = moe_wrapper(E, K, H, I, gpu_experts_mask=ON_GPU, skip_gpu_expert_cpu_copy=True, weight_path=path)
    full = moe_wrapper(E, K, H, I, gpu_experts_mask=ON_GPU, weight_path=path)
    for moe in (lean, full):
        moe.load_weights(slot_map)
    call = routed_to(p, list(range(E)))
    assert torch.equal(lean.forward(*call), full.forward(*call))
    for moe in (lean, full):
        moe.gpu_experts_mask[[0, 4]] = False
    out = lean.forward(*call)
    assert torch.equal(out, full.forward(*call))
    assert not torch.equal(out, moe_wrapper_forward_with_mask(p, path, slot_map, call))


def moe_wrapper_forward_with_mask(p, path, slot_map, call):
    """The layer's output with the load-time mask (experts 0 and 4 still on the GPU)."""
    moe = moe_wrapper(E, K, H, I, gpu_experts_mask=ON_GPU, weight_path=path)
    moe.load_weights(slot_map)
    return moe.forward(*call)


RSS_SCRIPT = """
import gc, json, sys, torch
sys.path.insert(0, "tests")
from moe_reference import moe_wrapper

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

E, H, I = 32, 1024, 1024
mask = torch.arange(E) < 24  # 24 of 32 experts on the GPU
gate, up, down = (torch.randn(E, n, k).to(torch.bfloat16) for n, k in ((I, H), (I, H), (H, I)))
before = rss_mib()
moe = moe_wrapper(E, 4, H, I, gpu_experts_mask=mask, skip_gpu_expert_cpu_copy={skip})
moe.load_weights_from_tensors(gate, up, down)
gc.collect()
print(json.dumps({{"packed_mib": rss_mib() - before}}))
"""


def test_resident_memory_holds_only_the_cpu_experts():
    figures = {}
    for skip in (False, True):
        result = run_python(RSS_SCRIPT.format(skip=skip))
        assert result.returncode == 0, result.stderr
        figures[skip] = json.loads(result.stdout.splitlines()[-1])["packed_mib"]
    # 32 experts of 6 MiB: about 192 MiB packed by default, about 48 MiB (8 CPU experts) without the GPU ones.
    assert figures[False] > 150, figures
    assert figures[True] < 0.45 * figures[False], figures
