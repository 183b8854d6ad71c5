"""A plain-PyTorch reference of the MoE expert forward, and random problems to feed it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def moe_wrapper(experts: int, top_k: int, hidden: int, inter: int, **overrides):
    """A KTMoEWrapper with the tests' defaults (2 threads, BF16); keywords override them."""
    from kt_kernel import KTMoEWrapper

    args = dict(
        layer_idx=0, num_experts=experts, num_experts_per_tok=top_k, hidden_size=hidden,
        moe_intermediate_size=inter, gpu_experts_mask=None, cpuinfer_threads=2, threadpool_count=1,
        weight_path=None, chunked_prefill_size=512, method="BF16",
    )  # fmt: skip
    args.update(overrides)
    return KTMoEWrapper(**args)


@dataclass
class MoEProblem:
    gate: torch.Tensor  # [E, I, H] fp32
    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]
    hidden: torch.Tensor  # [T, H] bf16
    ids: torch.Tensor  # [T, K] int64
    weights: torch.Tensor  # [T, K] fp32

    @property
    def shape(self) -> tuple[int, int, int, int]:
        experts, inter, hidden = self.gate.shape
        return experts, self.ids.shape[1], hidden, inter


def random_routing(
    tokens: int, experts: int, top_k: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k distinct experts per token, uniformly at random; weights = softmax of normal logits."""
    ids = torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :top_k]
    weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
    return ids.reshape(tokens, top_k).to(torch.int64), weights.reshape(tokens, top_k)


def make_problem(experts: int, top_k: int, hidden: int, inter: int, tokens: int, seed: int = 0) -> MoEProblem:
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(experts, inter, hidden, generator=g) / hidden**0.5
    up = torch.randn(experts, inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    hidden_states = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids, weights = random_routing(tokens, experts, top_k, g)
    return MoEProblem(gate, up, down, hidden_states, ids, weights)


def reference_forward(
    p: MoEProblem, skip: torch.Tensor | None = None, slot_map: torch.Tensor | None = None
) -> torch.Tensor:
    """fp64 reference from the bf16-rounded weights; the SwiGLU output is rounded to bf16 like the
    engine's activations. Id -1 and experts in `skip` contribute nothing; slot p uses expert slot_map[p]."""
    gate, up, down = (w.to(torch.bfloat16).double() for w in (p.gate, p.up, p.down))
    x = p.hidden.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for slot in p.ids.unique().tolist():
        if slot < 0 or (skip is not None and bool(skip[slot])):
            continue
        source = int(slot_map[slot]) if slot_map is not None else slot
        token, k = (p.ids == slot).nonzero(as_tuple=True)
        xt = x[token]
        act = (F.silu(xt @ gate[source].T) * (xt @ up[source].T)).to(torch.bfloat16).double()
        out.index_add_(0, token, p.weights[token, k].double()[:, None] * (act @ down[source].T))
    return out


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 output: within ~2 bf16 ulps of each value plus a small fraction of the output's scale."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    scale = ref.pow(2).mean().sqrt().item() if ref.numel() else 0.0
    err = (out.double() - ref).abs()
    bound = ref.abs() / 128 + 1e-2 * scale + 1e-6
    worst = (err - bound).max().item() if err.numel() else -1.0
    assert worst <= 0, f"max error {err.max().item():.3g} exceeds bound (output rms {scale:.3g})"
