"""The stream path (submit_forward / sync_forward with a cuda_stream) through the stand-in CUDA runtime
of tests/fake_cuda: one FIFO thread per stream handle runs the copies and host functions in order.

It proves ordering and logic on a machine without a GPU; tests/test_gpu.py runs the same path on a
real one. CPU tensors plus a cuda_stream take the stream path, with KT_KERNEL_CUDART naming the
stand-in: every output below is read by a copy queued on the stream, as a GPU kernel would read it."""

from __future__ import annotations

import textwrap
import time
import warnings

import pytest
import torch

from kt_kernel import KTMoEWrapper
from kt_kernel.stream_path import BUFFERS

from conftest import run_python
from moe_reference import make_problem, moe_wrapper

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="torch has CUDA here: tests/test_gpu.py runs the real runtime instead"
)

E, K, H, I = 8, 4, 128, 64


@pytest.fixture(autouse=True)
def nothing_pending():
    yield
    KTMoEWrapper.flush_deferred()


def layer(method: str = "BF16", layer_idx: int = 0, seed: int = 0, **options) -> tuple[KTMoEWrapper, object]:
    problem = make_problem(E, K, H, I, 6, seed=seed)
    moe = moe_wrapper(E, K, H, I, method=method, layer_idx=layer_idx, **options)
    moe.load_weights_from_tensors(problem.gate, problem.up, problem.down)
    return moe, problem


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    problem = make_problem(E, K, H, I, tokens, seed=seed)
    return problem.hidden, problem.ids, problem.weights


def test_submit_returns_before_the_task_starts_and_the_stream_runs_it_in_order(fake):
    moe, p = layer()
    expected = moe.forward(p.hidden, p.ids, p.weights)
    stream = fake.stream()
    fake.hold(stream)
    moe.submit_forward(p.hidden, p.ids, p.weights, stream)
    assert fake.executed(stream) == 0 and fake.queued(stream) == 4  # x, ids, weights copies + host function
    out = moe.sync_forward(p.hidden, stream)
    assert fake.queued(stream) == 6  # + the host function that waits + the output copy
    assert moe._stream.layer.outstanding == 1
    seen = fake.read(out, stream)
    fake.release(stream)
    fake.drain(stream)
    assert fake.executed(stream) == 7 and moe._stream.layer.outstanding == 0
    assert torch.equal(seen, expected)
    moe.close()


@pytest.mark.parametrize("method", ["BF16", "INT8", "INT4", "MXFP4", "FP8"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_results_are_bit_equal_to_the_direct_path(fake, method, tokens):
    moe, _ = layer(method)
    x, ids, weights = routing(tokens, seed=tokens)
    expected = moe.forward(x, ids, weights)
    stream = fake.stream()
    # fp32 activations, int32 ids (widened on the host), fp64 weights: converted as on the direct path.
    moe.submit_forward(x.float(), ids.to(torch.int32), weights.double(), stream)
    seen = fake.read(moe.sync_forward(x, stream), stream)
    fake.drain(stream)
    assert torch.equal(seen, expected)
    assert torch.equal(moe.forward(x, ids, weights), expected)  # the direct path after the stream path
    moe.close()


def test_the_caller_never_waits_for_the_cpu_task(fake):
    big = make_problem(E, K, 512, 512, 2000, seed=7)  # a task of a good fraction of a second on two cores
    moe = moe_wrapper(E, K, 512, 512)
    moe.load_weights_from_tensors(big.gate, big.up, big.down)
    x, ids, weights = big.hidden, big.ids, big.weights
    stream = fake.stream()
    moe.submit_forward(x, ids, weights, stream)
    out = moe.sync_forward(x, stream)
    while not (fake.executed(stream) == 4 and fake.queued(stream) == 1):
        time.sleep(0.001)  # until the host function that waits for the task has started
    assert moe._stream.layer.outstanding == 1  # answered while that host function waits
    moe._stream.layer.rethrow_error()
    assert fake.queued(stream) == 1, "the task ended before the queries: make it longer"
    seen = fake.read(out, stream)
    fake.drain(stream)
    assert torch.equal(seen, moe.forward(x, ids, weights))
    moe.close()


def test_four_layers_in_flight(fake):
    layers = [layer(layer_idx=i, seed=i) for i in range(4)]
    expected = [moe.forward(p.hidden, p.ids, p.weights) for moe, p in layers]
    stream = fake.stream()
    fake.hold(stream)
    for moe, p in layers:
        moe.submit_forward(p.hidden, p.ids, p.weights, stream)
    # Layers 0 and 2 share a device output (per batch size and layer parity): each is read in
    # stream order before the next sync of its parity overwrites it.
    seen = [fake.read(moe.sync_forward(None, stream), stream) for moe, _ in layers]
    fake.release(stream)
    fake.drain(stream)
    for got, want in zip(seen, expected, strict=True):
        assert torch.equal(got, want)
    for moe, _ in layers:
        moe.close()


def run_stack(layers, problems, stream=None, fake=None) -> list[torch.Tensor]:
    outputs = []
    for moe, p in zip(layers, problems, strict=True):
        moe.submit_forward(p.hidden, p.ids, p.weights, stream)
        out = moe.sync_forward(p.hidden, stream)
        outputs.append(out if stream is None else fake.read(out, stream))
    return outputs


def test_deferred_experts_across_layers_match_the_direct_path(fake):
    made = [
        layer(layer_idx=i, seed=10 + i, max_deferred_experts_per_token=d) for i, d in enumerate([2, 1, 2, 0])
    ]
    layers, problems = [m for m, _ in made], [p for _, p in made]
    for p in problems:
        p.hidden, p.ids, p.weights = (
            p.hidden[:2],
            p.ids[:2],
            p.weights[:2],
        )  # few tokens: something is deferred
    expected = run_stack(layers, problems)
    immediate = [moe_wrapper(E, K, H, I, layer_idx=i) for i in range(4)]
    for moe, p in zip(immediate, problems, strict=True):
        moe.load_weights_from_tensors(p.gate, p.up, p.down)
    assert not all(torch.equal(a, b) for a, b in zip(expected, run_stack(immediate, problems), strict=True))
    stream = fake.stream()
    fake.hold(stream)  # every layer queued before any runs
    seen = run_stack(layers, problems, stream, fake)
    fake.release(stream)
    fake.drain(stream)
    for got, want in zip(seen, expected, strict=True):
        assert torch.equal(got, want)
    for moe in layers + immediate:
        moe.close()


def test_one_layer_with_deferred_experts_adds_its_own_last_call(fake):
    moe, p = layer(max_deferred_experts_per_token=2)
    calls = [routing(2, seed) for seed in (20, 21, 22)]
    expected = [moe.forward(*call) for call in calls]
    KTMoEWrapper.flush_deferred()
    stream = fake.stream()
    seen = []
    for x, ids, weights in calls:
        moe.submit_forward(x, ids, weights, stream)
        seen.append(fake.read(moe.sync_forward(x, stream), stream))
    fake.drain(stream)
    for got, want in zip(seen, expected, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="stream"):  # its last deferred experts are still pending
        moe.load_weights_from_tensors(p.gate, p.up, p.down)
    moe.close()


def test_deferred_experts_pending_on_one_path_refuse_the_other(fake):
    first, p0 = layer(layer_idx=0, max_deferred_experts_per_token=2)
    second, p1 = layer(layer_idx=1, seed=1)
    first.forward(p0.hidden[:2], p0.ids[:2], p0.weights[:2])  # direct path: deferred experts pending
    with pytest.raises(RuntimeError, match="all be on a CUDA stream or none"):
        second.submit_forward(p1.hidden[:2], p1.ids[:2], p1.weights[:2], fake.stream())
    first.close(), second.close()


def test_buffers_per_batch_size_and_capture_sizes(fake):
    KTMoEWrapper.set_capture_batch_sizes([1, 4])
    try:
        assert KTMoEWrapper.get_capture_batch_sizes() == [1, 4]
        moe, _ = layer(layer_idx=3)
        stream = fake.stream()
        outs = []
        for tokens in (4, 4, 1, 4):
            x, ids, weights = routing(tokens, tokens)
            moe.submit_forward(x, ids, weights, stream)
            outs.append(moe.sync_forward(x, stream))
        fake.drain(stream)
        # A pair of outputs per (thread, batch size), used in turn.
        assert outs[0] is not outs[1] and outs[3] is outs[0] and outs[2].shape == (1, H)
        assert BUFFERS._free[(1, H, K)] and BUFFERS._free[(4, H, K)]  # made ahead for the capture sizes
        moe.close()
        KTMoEWrapper.clear_buffer_cache()
        assert not BUFFERS._free and not BUFFERS._outputs
    finally:
        KTMoEWrapper.set_capture_batch_sizes([])


def test_an_error_of_the_cpu_task_is_raised_by_a_later_sync_and_its_output_is_nan(fake):
    moe, p = layer()
    stream = fake.stream()
    bad = p.ids.clone()
    bad[1, 2] = E + 3
    fake.hold(stream)  # else this sync could already raise: the stream may run before it
    moe.submit_forward(p.hidden, bad, p.weights, stream)
    seen = fake.read(moe.sync_forward(p.hidden, stream), stream)
    fake.release(stream)
    fake.drain(stream)
    assert torch.isnan(seen.float()).all()
    moe.submit_forward(p.hidden, p.ids, p.weights, stream)
    with pytest.raises(ValueError, match=r"topk_ids\[1, 2\] = 11 is outside"):
        moe.sync_forward(p.hidden, stream)
    fake.drain(stream)
    moe.submit_forward(p.hidden, p.ids, p.weights, stream)  # the layer goes on
    seen = fake.read(moe.sync_forward(p.hidden, stream), stream)
    fake.drain(stream)
    assert torch.equal(seen, moe.forward(p.hidden, p.ids, p.weights))
    moe.close()


def test_work_on_the_layer_waits_until_the_stream_has_run_its_calls(fake):
    moe, p = layer()
    stream = fake.stream()
    fake.hold(stream)
    moe.submit_forward(p.hidden, p.ids, p.weights, stream)
    moe.sync_forward(p.hidden, stream)
    with pytest.raises(RuntimeError, match="queued on a CUDA stream"):
        moe.load_weights_from_tensors(p.gate, p.up, p.down)
    with pytest.raises(RuntimeError, match="queued on a CUDA stream"):
        moe.forward(p.hidden, p.ids, p.weights)  # the direct path would race the queued host functions
    fake.release(stream)
    fake.drain(stream)
    moe.load_weights_from_tensors(p.gate, p.up, p.down)
    moe.close()


def test_stream_argument_checks(fake):
    moe, p = layer()
    with pytest.raises(TypeError, match="cuda_stream"):
        moe.submit_forward(p.hidden, p.ids, p.weights, "stream")
    with pytest.raises(ValueError, match="not a stream handle"):
        moe.submit_forward(p.hidden, p.ids, p.weights, -1)
    with pytest.raises(ValueError, match="must be on"):
        moe.submit_forward(p.hidden, p.ids.to("meta"), p.weights, fake.stream())
    stream = fake.stream()
    moe.submit_forward(p.hidden, p.ids, p.weights, stream)
    with pytest.raises(ValueError, match="not the one submit_forward used"):
        moe.sync_forward(p.hidden, fake.stream())
    moe.sync_forward(p.hidden, stream)
    fake.drain(stream)
    moe.close()


def test_close_with_work_queued_neither_hangs_nor_crashes(fake):
    for sync_too in (False, True):
        moe, p = layer()
        stream = fake.stream()
        fake.hold(stream)
        moe.submit_forward(p.hidden, p.ids, p.weights, stream)
        if sync_too:
            moe.sync_forward(p.hidden, stream)
        with pytest.warns(RuntimeWarning, match="NaN"):
            moe.close()
        fake.release(stream)
        fake.drain(stream)  # the host functions of a closed layer do nothing
        with pytest.raises(RuntimeError, match="closed"):
            moe.submit_forward(p.hidden, p.ids, p.weights, stream)


def test_close_while_the_task_runs_waits_for_it(fake):
    moe, _ = layer()
    x, ids, weights = routing(300, 5)
    stream = fake.stream()
    moe.submit_forward(x, ids, weights, stream)
    moe.sync_forward(x, stream)
    with warnings.catch_warnings():  # whether its sync is still queued depends on the timing
        warnings.simplefilter("ignore", RuntimeWarning)
        moe.close()  # the task may be running on the workers now
    fake.drain(stream)


SCRIPT_HEAD = """
import ctypes, os, sys, torch
sys.path.insert(0, "tests")
from moe_reference import make_problem, moe_wrapper
fake = ctypes.CDLL(os.environ["KT_KERNEL_CUDART"])
fake.fake_stream_create.restype = ctypes.c_size_t
for name in ("hold", "release", "drain"):
    getattr(fake, "fake_stream_" + name).argtypes = [ctypes.c_size_t]
p = make_problem(8, 4, 128, 64, 6)
moe = moe_wrapper(8, 4, 128, 64)
moe.load_weights_from_tensors(p.gate, p.up, p.down)
expected = moe.forward(p.hidden, p.ids, p.weights)
stream = fake.fake_stream_create()
fake.fake_stream_hold(stream)
moe.submit_forward(p.hidden, p.ids, p.weights, stream)
out = moe.sync_forward(p.hidden, stream)
"""


def test_fork_with_work_queued(fake):
    script = SCRIPT_HEAD + textwrap.dedent("""
        pid = os.fork()
        if pid == 0:  # the stream's thread is not in the child: its queued work never runs here
            moe.close()
            os._exit(0)
        fake.fake_stream_release(stream)
        fake.fake_stream_drain(stream)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert torch.equal(out, expected)
        print("ok")
    """)
    result = run_python(script, {"KT_KERNEL_CUDART": fake.path}, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_interpreter_exit_with_work_queued(fake):
    result = run_python(SCRIPT_HEAD + "print('exiting')", {"KT_KERNEL_CUDART": fake.path}, timeout=120)
    assert result.returncode == 0 and "exiting" in result.stdout, result.stderr
    assert result.stderr == "", "no chatter at exit (nanobind leak reports, warnings)"


NO_RUNTIME_SCRIPT = """
import torch
from kt_kernel import KTMoEWrapper
from kt_kernel._native import ext
moe = KTMoEWrapper(0, 8, 2, 64, 64, None, 1, 1, None, 64, method="BF16")
moe.load_weights_from_tensors(torch.randn(8, 64, 64), torch.randn(8, 64, 64), torch.randn(8, 64, 64))
call = torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
expected = moe.forward(*call)
moe.submit_forward(*call, 7)  # CPU tensors and a stream, no CUDA anywhere: the direct path
assert torch.equal(moe.sync_forward(call[0], 7), expected)
assert "cudart" not in open("/proc/self/maps").read()
try:
    ext.cuda_runtime_path()
except RuntimeError as error:
    print(error)
"""


def test_without_cuda_nothing_cuda_is_loaded_and_a_stream_runs_directly():
    result = run_python(NO_RUNTIME_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert "no CUDA runtime loaded" in result.stdout and "KT_KERNEL_CUDART" in result.stdout


def test_a_cuda_runtime_that_cannot_be_loaded_is_a_clear_error(tmp_path):
    script = textwrap.dedent("""
        import torch
        from kt_kernel import KTMoEWrapper
        moe = KTMoEWrapper(0, 8, 2, 64, 64, None, 1, 1, None, 64, method="BF16")
        moe.load_weights_from_tensors(torch.randn(8, 64, 64), torch.randn(8, 64, 64), torch.randn(8, 64, 64))
        call = torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
        try:
            moe.submit_forward(*call, 7)
        except RuntimeError as error:
            print(error)
        print(torch.equal(moe.forward(*call), moe.forward(*call)))  # the layer goes on
    """)
    missing = tmp_path / "missing.so"
    result = run_python(script, {"KT_KERNEL_CUDART": str(missing)})
    assert result.returncode == 0, result.stderr
    assert f"cannot load the CUDA runtime {missing}" in result.stdout and "True" in result.stdout
