"""One set of worker threads for every layer of a process, as upstream's CPUInfer: layers take
turns on it in submit order, any number of them may be in flight, and 48 layers start no more
threads than one."""

from __future__ import annotations

import torch

from conftest import run_python
from moe_reference import make_problem, moe_wrapper, reference_forward


def test_48_layers_start_cpuinfer_threads_threads_once():
    code = """
import os, torch
from kt_kernel import KTMoEWrapper
def threads():
    return len(os.listdir("/proc/self/task"))
def layer(i, **kw):
    args = dict(layer_idx=i, num_experts=8, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=32,
                gpu_experts_mask=None, cpuinfer_threads=3, threadpool_count=1, weight_path=None,
                chunked_prefill_size=512, method="BF16")
    moe = KTMoEWrapper(**(args | kw))
    moe.load_weights_from_tensors(torch.randn(8, 32, 64), torch.randn(8, 32, 64), torch.randn(8, 64, 32))
    return moe
before = threads()
layers = [layer(i) for i in range(48)]
x = torch.randn(256, 64).bfloat16()
ids = torch.randint(0, 8, (256, 1)).repeat(1, 2)
ids[:, 1] = (ids[:, 0] + 1) % 8
for moe in layers:
    moe.submit_forward(x, ids, torch.rand(256, 2))
for moe in layers:
    moe.sync_forward()
print(threads() - before)
split = [layer(48 + i, cpuinfer_threads=2, threadpool_count=2) for i in range(4)]  # another configuration
print(threads() - before)
"""
    result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3", "5"], result.stdout


def test_layers_in_flight_at_once_sync_in_any_order():
    problems = [make_problem(experts=6, top_k=2, hidden=96, inter=64, tokens=40, seed=s) for s in range(3)]
    layers = []
    for p in problems:
        moe = moe_wrapper(6, 2, 96, 64)
        moe.load_weights_from_tensors(p.gate, p.up, p.down)
        layers.append(moe)
    for moe, p in zip(layers, problems, strict=True):
        moe.submit_forward(p.hidden, p.ids, p.weights)
    outputs = {i: layers[i].sync_forward() for i in (2, 0, 1)}  # not the submit order
    for i, p in enumerate(problems):
        ref = reference_forward(p)
        assert ((outputs[i].double() - ref).norm() / ref.norm()).item() < 0.01
    # The same again through forward(): the pool holds no state between calls.
    assert torch.equal(
        layers[1].forward(problems[1].hidden, problems[1].ids, problems[1].weights), outputs[1]
    )
