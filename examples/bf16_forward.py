"""A BF16 MoE layer (Qwen3-30B-A3B expert shapes, 32 of its 128 experts) on the CPU: load, run, check."""

import time

import torch

import kt_kernel
from kt_kernel import KTMoEWrapper

E, K, H, I, T = 32, 8, 2048, 768, 16
torch.manual_seed(0)
gate = torch.randn(E, I, H) / H**0.5
up = torch.randn(E, I, H) / H**0.5
down = torch.randn(E, H, I) / I**0.5

moe = KTMoEWrapper(
    layer_idx=0,
    num_experts=E,
    num_experts_per_tok=K,
    hidden_size=H,
    moe_intermediate_size=I,
    gpu_experts_mask=None,
    cpuinfer_threads=2,
    threadpool_count=1,
    weight_path=None,
    chunked_prefill_size=512,
    method="BF16",
)
moe.load_weights_from_tensors(gate, up, down)

x = torch.randn(T, H).to(torch.bfloat16)
ids = torch.rand(T, E).argsort(dim=1)[:, :K]
weights = torch.softmax(torch.randn(T, K), dim=-1)
start = time.perf_counter()
out = moe.forward(x, ids, weights)
elapsed = time.perf_counter() - start

# The same computation in plain PyTorch, for comparison.
ref = torch.zeros(T, H)
for t in range(T):
    for k in range(K):
        e = ids[t, k]
        xt = x[t].float()
        act = torch.nn.functional.silu(gate[e].bfloat16().float() @ xt) * (up[e].bfloat16().float() @ xt)
        ref[t] += weights[t, k] * (down[e].bfloat16().float() @ act.bfloat16().float())
rel = ((out.float() - ref).norm() / ref.norm()).item()
print(
    f"build {kt_kernel.__cpu_variant__}: {T} tokens in {elapsed * 1e3:.2f} ms, "
    f"relative error vs PyTorch {rel:.2e}"
)
