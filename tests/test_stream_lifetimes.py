"""The stream path as a real client and a careless one call it, through the stand-in CUDA runtime
(tests/fake_stream.py): CUDA graphs replayed across live expert-placement updates (sglang-kt's
dynamic expert update), and buffers that live in stream order whatever the caller does (close, gc,
clear_buffer_cache, flush_deferred, two threads on one stream). tests/test_gpu.py runs the graph
case on a real GPU."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from kt_kernel import KTMoEWrapper, generate_gpu_experts_masks, stream_path
from kt_kernel.stream_path import BUFFERS

from moe_reference import make_problem, moe_wrapper

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="torch has CUDA here: tests/test_gpu.py runs the real runtime instead"
)

E, K, H, I, T = 16, 4, 128, 64, 3


@pytest.fixture(autouse=True)
def nothing_pending():
    yield
    try:
        KTMoEWrapper.flush_deferred()
    except RuntimeError:
        pass


def stack(deferred: list[int], **options) -> tuple[list[KTMoEWrapper], list]:
    """Layers with their problems (T tokens each); deferred[i]: layer i's max_deferred_experts_per_token."""
    layers, problems = [], []
    for i, d in enumerate(deferred):
        p = make_problem(E, K, H, I, T, seed=40 + i)
        moe = moe_wrapper(E, K, H, I, layer_idx=i, max_deferred_experts_per_token=d, **options)
        moe.load_weights_from_tensors(p.gate, p.up, p.down)
        layers.append(moe)
        problems.append(p)
    return layers, problems


def direct(layers, problems) -> list[torch.Tensor]:
    outputs = []
    for moe, p in zip(layers, problems, strict=True):
        outputs.append(moe.forward(p.hidden, p.ids, p.weights))
    return outputs


def capture(fake, layers, problems, stream) -> tuple[int, list[torch.Tensor]]:
    """A graph of the stack's calls on `stream`, and the tensors each replay writes its outputs to."""
    KTMoEWrapper.set_capture_batch_sizes([T])
    for moe, p in zip(layers, problems, strict=True):  # warm-up outside the capture, as SGLang's runner
        moe.submit_forward(p.hidden, p.ids, p.weights, stream)
        moe.sync_forward(p.hidden, stream)
    fake.drain(stream)
    fake.capture_begin(stream)
    seen = []
    for moe, p in zip(layers, problems, strict=True):
        moe.submit_forward(p.hidden, p.ids, p.weights, stream)
        seen.append(fake.read(moe.sync_forward(p.hidden, stream), stream))
    return fake.capture_end(stream), seen


def placements(layers, steps: int) -> list[list[torch.Tensor]]:
    """Per step, each layer's GPU-expert mask: different experts move each step."""
    masks = []
    for step in range(steps):
        freq = torch.rand(len(layers), E, generator=torch.Generator().manual_seed(step))
        masks.append(list(generate_gpu_experts_masks(freq, num_gpu_experts=len(layers) * E // 3)))
    return masks


@pytest.mark.parametrize(
    "deferred, options",
    [
        ([0, 0, 0], {}),
        ([2, 1, 0], {}),
        ([0, 0, 0], {"threadpool_count": 2}),
        ([1, 0, 0], {"threadpool_count": 2}),
    ],
    ids=["plain", "deferred", "subpools", "deferred+subpools"],
)
def test_a_replayed_graph_computes_with_the_mask_of_that_moment(fake, deferred, options):
    layers, problems = stack(deferred, **options)
    stream = fake.stream()
    try:
        graph, seen = capture(fake, layers, problems, stream)
        for step, masks in enumerate(placements(layers, 4)):
            for moe, mask in zip(layers, masks, strict=True):
                if step % 2:
                    moe.gpu_experts_mask.copy_(mask)  # sglang-kt's update: in place
                else:
                    moe.gpu_experts_mask = mask  # assigned through the attribute
            fake.replay(graph, stream)
            fake.drain(stream)
            replayed = [s.clone() for s in seen]
            expected = direct(layers, problems)
            for layer_idx, (got, want) in enumerate(zip(replayed, expected, strict=True)):
                assert torch.equal(got, want), f"step {step}, layer {layer_idx}: not the mask of that moment"
        # The masks of the last step are not those of the capture: a stale mask would fail above.
        assert any(not torch.equal(m, torch.zeros(E, dtype=torch.bool)) for m in masks)
    finally:
        KTMoEWrapper.set_capture_batch_sizes([])
        for moe in layers:
            moe.close()


def test_a_replay_with_skipped_experts_follows_the_mask_and_never_reads_a_missing_expert(fake):
    """skip_gpu_expert_cpu_copy: experts masked at load are not in CPU memory. A replay may move
    experts that are packed; one that hands an unpacked expert to the CPU gives NaN and an error,
    never a result computed without it (a replay runs no Python to load it)."""
    at_load = torch.zeros(E, dtype=torch.bool)
    at_load[:4] = True  # never packed
    layers, problems = stack([0], gpu_experts_mask=at_load.clone(), skip_gpu_expert_cpu_copy=True)
    (moe,), (p,) = layers, problems
    stream = fake.stream()
    try:
        graph, (seen,) = capture(fake, layers, problems, stream)
        moved = at_load.clone()
        moved[4:8] = True  # packed experts go to the GPU
        moe.gpu_experts_mask.copy_(moved)
        fake.replay(graph, stream)
        fake.drain(stream)
        replayed = seen.clone()
        assert torch.equal(replayed, moe.forward(p.hidden, p.ids, p.weights))
        handed_back = moved.clone()
        handed_back[0] = False  # expert 0 was never packed
        moe.gpu_experts_mask.copy_(handed_back)
        fake.replay(graph, stream)
        fake.drain(stream)
        assert torch.isnan(seen.float()).all()
        moe.gpu_experts_mask.copy_(moved)
        moe.submit_forward(p.hidden, p.ids, p.weights, stream)
        with pytest.raises(ValueError, match="not in CPU memory|not packed|unpacked"):
            moe.sync_forward(p.hidden, stream)
        fake.drain(stream)
    finally:
        KTMoEWrapper.set_capture_batch_sizes([])
        moe.close()


def test_flush_deferred_before_the_stream_ran_drops_them_safely_and_the_layer_goes_on(fake):
    layers, problems = stack([1, 2])  # the last layer defers: a stack a careless caller wrote
    stream = fake.stream()
    fake.hold(stream)
    for moe, p in zip(layers, problems, strict=True):
        moe.submit_forward(p.hidden, p.ids, p.weights, stream)
        moe.sync_forward(p.hidden, stream)
    deferring = weakref.ref(layers[-1]._deferred.stream_call.slot)
    with pytest.raises(RuntimeError, match="dropped"):
        KTMoEWrapper.flush_deferred()
    gc.collect()
    assert deferring() is not None  # the deferring call's slot, until the stream has run
    churn = [torch.full((T, H), 7.0, dtype=torch.bfloat16) for _ in range(64)]  # reuse freed memory
    fake.release(stream)
    fake.drain(stream)
    assert all(bool((c == 7).all()) for c in churn)
    last, p = layers[-1], problems[-1]
    KTMoEWrapper.flush_deferred()
    out = last.forward(p.hidden, p.ids, p.weights)  # no wedge: the direct path works at once
    assert out.shape == (T, H)
    KTMoEWrapper.flush_deferred()
    BUFFERS.retired.collect()
    assert deferring() is None  # freed once the stream ran past it
    for moe in layers:
        moe.close()


def test_close_gc_and_clear_while_work_is_queued_free_nothing_the_stream_still_uses(fake):
    layers, problems = stack([0])
    (moe,), (p,) = layers, problems
    expected = moe.forward(p.hidden, p.ids, p.weights)
    stream = fake.stream()
    fake.hold(stream)
    moe.submit_forward(p.hidden, p.ids, p.weights, stream)  # submitted, never synced
    queued = weakref.ref(moe._stream.call.slot)
    with pytest.warns(RuntimeWarning, match="NaN"):
        moe.close()
    del moe, layers
    gc.collect()
    KTMoEWrapper.clear_buffer_cache()
    assert queued() is not None
    churn = [torch.full((T, H), 3.0, dtype=torch.bfloat16) for _ in range(64)]
    fake.release(stream)
    fake.drain(stream)
    assert all(bool((c == 3).all()) for c in churn)
    KTMoEWrapper.clear_buffer_cache()  # the stream has run: what it used is freed now
    assert queued() is None
    again = moe_wrapper(E, K, H, I)  # the same weights: the buffers come back on demand
    again.load_weights_from_tensors(p.gate, p.up, p.down)
    again.submit_forward(p.hidden, p.ids, p.weights, stream)
    seen = fake.read(again.sync_forward(p.hidden, stream), stream)
    fake.drain(stream)
    assert torch.equal(seen, expected)
    again.close()


def test_a_closed_layers_queued_sync_gives_nan_never_an_old_output(fake):
    layers, problems = stack([0])
    (moe,), (p,) = layers, problems
    stream = fake.stream()
    moe.submit_forward(p.hidden, p.ids, p.weights, stream)
    first = fake.read(moe.sync_forward(p.hidden, stream), stream)
    fake.drain(stream)
    assert torch.isfinite(first.float()).all()
    fake.hold(stream)
    moe.submit_forward(p.hidden, p.ids, p.weights, stream)
    out = moe.sync_forward(p.hidden, stream)
    seen = fake.read(out, stream)
    with pytest.warns(RuntimeWarning, match="NaN"):
        moe.close()
    fake.release(stream)
    fake.drain(stream)
    assert torch.isnan(seen.float()).all()


def test_two_threads_with_their_own_layers_on_one_stream_each_get_their_own_outputs(fake):
    layers, problems = stack([0, 0, 0])
    a, b = layers[0], layers[2]  # layers 0 and 2: once the same device output (layer parity)
    pa, pb = problems[0], problems[2]
    want_a, want_b = a.forward(pa.hidden, pa.ids, pa.weights), b.forward(pb.hidden, pb.ids, pb.weights)
    stream = fake.stream()
    fake.hold(stream)
    a_synced, b_synced = threading.Event(), threading.Event()
    seen_a, seen_b = [], []

    def call(moe, p) -> torch.Tensor:
        moe.submit_forward(p.hidden, p.ids, p.weights, stream)
        return moe.sync_forward(p.hidden, stream)

    def drive_a() -> None:  # syncs, lets b sync twice, then reads its output (a fixed interleaving)
        for _ in range(10):
            out = call(a, pa)
            a_synced.set()
            b_synced.wait()
            b_synced.clear()
            seen_a.append(fake.read(out, stream))

    def drive_b() -> None:
        for _ in range(10):
            a_synced.wait()
            a_synced.clear()
            call(b, pb)
            seen_b.append(fake.read(call(b, pb), stream))
            b_synced.set()

    threads = [threading.Thread(target=drive_a), threading.Thread(target=drive_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    fake.release(stream)
    fake.drain(stream)
    assert len(seen_a) == len(seen_b) == 10
    for got in seen_a:
        assert torch.equal(got, want_a), "layer 0's output overwritten by the other thread's layer"
    for got in seen_b:
        assert torch.equal(got, want_b)
    for moe in layers:
        moe.close()


@pytest.mark.parametrize("bad", [2.7, True, "4", 0, -1, 2**62, None])
def test_capture_batch_sizes_are_ints_in_range(bad):
    with pytest.raises(ValueError, match="ints from 1 to 65536") as error:
        KTMoEWrapper.set_capture_batch_sizes([1, bad])
    assert repr(bad) in str(error.value)
    assert KTMoEWrapper.get_capture_batch_sizes() == []


def test_a_stream_buffer_that_cannot_be_allocated_is_a_memory_error_naming_its_size(fake, monkeypatch):
    layers, problems = stack([0])
    (moe,), (p,) = layers, problems

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (stand-in)")

    monkeypatch.setattr(stream_path.torch, "empty", no_memory)
    BUFFERS.clear()
    with pytest.raises(MemoryError, match=rf"{T * H * 2} bytes"):
        moe.submit_forward(p.hidden, p.ids, p.weights, fake.stream())
    monkeypatch.undo()
    stream = fake.stream()
    moe.submit_forward(p.hidden, p.ids, p.weights, stream)  # the layer goes on
    moe.sync_forward(p.hidden, stream)
    fake.drain(stream)
    moe.close()
