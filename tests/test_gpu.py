"""The stream path on a real GPU: CUDA tensors on a CUDA stream, CUDA graphs (the overlap with GPU
work is a figure of `python -m kt_kernel bench --gpu`, not a test).

Skipped where torch has no CUDA device; ci/gpu_check.sh runs it on a machine with one. The same logic
is tested without a GPU, through a stand-in runtime, in tests/test_stream_path.py."""

from __future__ import annotations

import threading

import pytest
import torch

from kt_kernel import KTMoEWrapper, generate_gpu_experts_masks
from kt_kernel.stream_path import BUFFERS

from moe_reference import make_problem, moe_wrapper, random_routing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA device")

E, K, H, I = 16, 4, 256, 128
THREADS = 4


def make_layer(layer_idx: int, method: str = "BF16", hidden: int = H, inter: int = I) -> KTMoEWrapper:
    p = make_problem(E, K, hidden, inter, tokens=1, seed=layer_idx)
    moe = moe_wrapper(E, K, hidden, inter, layer_idx=layer_idx, cpuinfer_threads=THREADS, method=method)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    return moe


def routing(tokens: int, seed: int, hidden: int = H) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids, weights = random_routing(tokens, E, K, g)
    return torch.randn(tokens, hidden, generator=g).to(torch.bfloat16), ids, weights


@pytest.fixture(scope="module")
def layers():
    made = [make_layer(i) for i in range(4)]
    yield made
    for moe in made:
        moe.close()


@pytest.mark.parametrize("tokens", [1, 8, 300])
@pytest.mark.parametrize("method", ["BF16", "MXFP4"])
def test_cuda_tensors_match_the_cpu_path_bit_for_bit(method, tokens):
    moe = make_layer(0, method)
    x, ids, weights = routing(tokens, 1)
    expected = moe.forward(x, ids, weights)
    stream = torch.cuda.current_stream()
    moe.submit_forward(x.cuda(), ids.to(torch.int32).cuda(), weights.cuda(), stream.cuda_stream)
    out = moe.sync_forward(x.cuda(), stream.cuda_stream)
    assert out.is_cuda
    assert torch.equal(out.cpu(), expected)  # .cpu() is ordered on the stream: no synchronize needed
    moe.close()


def test_float32_inputs_and_a_torch_stream_object():
    moe = make_layer(0)
    x, ids, weights = routing(5, 2)
    expected = moe.forward(x, ids, weights)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        moe.submit_forward(x.float().cuda(), ids.cuda(), weights.double().cuda(), side)
        out = moe.sync_forward(None, side).cpu()
    assert torch.equal(out, expected)
    moe.close()


def test_two_layers_in_flight(layers):
    inputs = [routing(6, 10 + i) for i in range(2)]
    expected = [moe.forward(*call) for moe, call in zip(layers, inputs, strict=False)]
    for moe, (x, ids, weights) in zip(layers, inputs, strict=False):
        moe.submit_forward(x.cuda(), ids.cuda(), weights.cuda())
    outs = [moe.sync_forward().clone() for moe in layers[:2]]
    for out, want in zip(outs, expected, strict=True):
        assert torch.equal(out.cpu(), want)


def test_cuda_graph_of_four_layers_replays_as_eager(layers):
    tokens = 4
    KTMoEWrapper.set_capture_batch_sizes([tokens])
    static_x = torch.zeros(tokens, H, dtype=torch.bfloat16, device="cuda")
    static_ids = torch.zeros(tokens, K, dtype=torch.int32, device="cuda")
    static_w = torch.zeros(tokens, K, dtype=torch.float32, device="cuda")

    def four_layers():
        y = static_x
        for moe in layers:
            moe.submit_forward(y, static_ids, static_w)
            y = y + moe.sync_forward(y)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: allocations happen outside the capture
            four_layers()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = four_layers()
    for replay in range(100):
        x, ids, weights = routing(tokens, 100 + replay)
        static_x.copy_(x)
        static_ids.copy_(ids)
        static_w.copy_(weights)
        graph.replay()
        got = static_y.cpu()
        want = four_layers().cpu()  # eager, same inputs
        assert torch.equal(got, want), f"replay {replay}"


def test_cuda_graph_replays_across_live_expert_placement(layers):
    """sglang-kt's dynamic expert update: masks changed in place between replays of one graph; every
    replay computes with the mask of that moment (the host function reads it when it runs)."""
    tokens = 4
    KTMoEWrapper.set_capture_batch_sizes([tokens])
    x, ids, weights = (t.cuda() for t in routing(tokens, 7))

    def four_layers():
        outputs = []
        for moe in layers:
            moe.submit_forward(x, ids, weights)
            outputs.append(moe.sync_forward())
        return outputs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        four_layers()  # warm-up: allocations happen outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = [out.clone() for out in four_layers()]
    try:
        for step in range(20):
            freq = torch.rand(len(layers), E, generator=torch.Generator().manual_seed(step))
            for moe, mask in zip(layers, generate_gpu_experts_masks(freq, len(layers) * E // 3), strict=True):
                moe.gpu_experts_mask.copy_(mask)
            graph.replay()
            got = [out.cpu() for out in static]
            want = [moe.forward(x.cpu(), ids.cpu(), weights.cpu()) for moe in layers]
            for layer_idx, (g, w) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(g, w), f"step {step}, layer {layer_idx}: not the mask of that moment"
    finally:
        for moe in layers:
            moe.gpu_experts_mask.copy_(torch.zeros(E, dtype=torch.bool))


def test_a_bad_expert_id_is_raised_by_a_later_sync_and_the_output_is_nan():
    moe = make_layer(0)
    x, ids, weights = routing(3, 4)
    ids[0, 0] = E + 5
    moe.submit_forward(x.cuda(), ids.cuda(), weights.cuda())
    raised = False
    try:  # raised here if the stream ran the host function before this sync queued its own
        moe.sync_forward()
    except ValueError:
        raised = True
    key = (threading.get_ident(), 3, H, x.cuda().device)
    out = BUFFERS._outputs[key][BUFFERS._turns[key] ^ 1].cpu()  # the sync's output, once the stream ran
    assert torch.isnan(out.float()).all()
    if not raised:
        x, ids, weights = routing(3, 5)
        with pytest.raises(ValueError, match="outside"):
            moe.submit_forward(x.cuda(), ids.cuda(), weights.cuda())
            moe.sync_forward()
    torch.cuda.synchronize()
    moe.close()
