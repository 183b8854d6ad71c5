"""A layer's direct path: CPU tensors, no CUDA stream. ``submit`` starts the engines on the caller's
inputs and returns; ``sync`` waits and returns a new output tensor; an exception between the two
(a KeyboardInterrupt, say) leaves nothing running that writes memory nobody holds."""

from __future__ import annotations

from typing import Any

import torch

from . import deferred
from .arguments import check_call_inputs, require_expert_ids

#: Calls of up to this many tokens (decode) allocate the next call's output ahead (submit).
_SPARE_OUTPUT_MAX_TOKENS = 16


class DirectForward:
    """One layer's direct path: its engines, the call in flight and the output it owns."""

    def __init__(self, layer: Any, own: deferred.DeferredExperts | None, layer_idx: int, num_experts: int,
                 hidden: int, top_k: int) -> None:  # fmt: skip
        self.layer, self.own = layer, own
        self.layer_idx, self.num_experts, self.hidden, self.top_k = layer_idx, num_experts, hidden, top_k
        self.out: torch.Tensor | None = None  # the output of the call in flight (the engines write it)
        self.adds: torch.Tensor | deferred.DeferredExperts | None = None  # what that call adds
        self.interrupted = False  # an exception cut a call short: the next submit checks the engines
        # A decode call allocates the next call's output while its engines run: with the caches cold
        # from the call before, torch.empty_like costs tens of microseconds before the call starts.
        self._spare_out: torch.Tensor | None = None
        self._spare_tokens = -1  # the tokens _spare_out is for

    @property
    def busy(self) -> bool:
        return self.out is not None

    def submit(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               gpu_mask_address: int) -> None:  # fmt: skip
        """Start the call: the inputs are read before this returns."""
        if self.interrupted:  # a call an interrupt may have left behind mid-way: finish it, drop it
            self.interrupted = False
            self._drop_orphaned_call()
        x, ids, weights = check_call_inputs(hidden_states, topk_ids, topk_weights, self.hidden, self.top_k)
        tokens = x.shape[0]
        out = self._spare_out if self._spare_tokens == tokens else None
        if out is None:
            out = torch.empty_like(x)
        self._spare_out = None
        deferred_ids, own = None, self.own
        if own is not None and tokens > 0:
            # Refused before anything starts: a call that fails half-way (its deferred part) would
            # leave the engines writing memory nobody holds.
            deferred.ready_for_next_call(own, self.layer_idx)
            require_expert_ids(ids, self.num_experts)
            ids, deferred_ids = deferred.split_routing(
                ids, weights, self.top_k - own.per_token, self.num_experts
            )
        # Once the engines write `out`, whatever is raised (a refused pass, or a KeyboardInterrupt the
        # moment the submit returns), the call is waited for before `out` can be freed.
        try:
            if tokens > 0:
                # check_call_inputs made them contiguous with the engine's dtypes and shapes. The
                # engines compare the mask with the one they hold (a memcmp) and update on change.
                self.layer.submit_addresses(
                    x.data_ptr(), tokens, ids.data_ptr(), weights.data_ptr(), out.data_ptr(), gpu_mask_address
                )
            if 0 < tokens <= _SPARE_OUTPUT_MAX_TOKENS:
                self._spare_out, self._spare_tokens = torch.empty_like(x), tokens
            # Taken once this call is on its way, so a refused call leaves them for the next one.
            self.adds = deferred.take_pending(self, own, tokens)
            if deferred_ids is not None:  # queued behind the call above: runs while the caller goes on
                deferred.start(own, x, deferred_ids, weights)
            self.out = out  # the engines write it until sync
        except BaseException:
            if self.out is not out:
                self.interrupted = True
                adds, self.adds = self.adds, None
                self._drop_orphaned_call(adds)
            raise

    def sync(self, cuda_stream: object = None) -> torch.Tensor:
        """Wait for the call in flight and return its output (plus the deferred experts it adds).
        Interrupted before the engines were waited for, the call stays in flight (its output held)
        for a later sync, or for drop()."""
        out = self.out
        synced = out.shape[0] == 0
        try:
            if not synced:
                self.layer.sync()  # with subpools: also sums their partial outputs into out
                synced = True
            adds = self.adds
            if isinstance(adds, deferred.DeferredExperts):
                adds = adds.collect()
            if adds is not None:  # the deferred experts of the call before
                out = (out.float() + adds.float()).to(torch.bfloat16)
        finally:
            if synced or not self.layer.pending:
                self.out, self.adds = None, None
        return out

    def _drop_orphaned_call(self, adds: torch.Tensor | deferred.DeferredExperts | None = None) -> None:
        """Wait for the engines' call and for the deferred experts it took (`adds`), and drop both."""
        try:
            if self.layer.pending:
                self.layer.sync()
            if isinstance(adds, deferred.DeferredExperts):
                adds.collect()  # frees that layer for its next call
        except (RuntimeError, ValueError):
            pass  # the call's own error: it is dropped with it

    def drop(self) -> None:
        """Wait for the call in flight and forget it (its output, and the deferred experts it took,
        are lost: the caller has given up on the call). The output is let go only after the wait: the
        engines write it until then (ASan: a use after free in down_task when it went first)."""
        self._drop_orphaned_call(self.adds)
        self.out, self.adds = None, None

    def close(self) -> None:
        """Wait for a call in flight (its output is never read)."""
        if self.out is not None and self.out.shape[0] > 0:
            self.layer.sync()
        self.out, self.adds, self._spare_out = None, None, None

    def release_scratch(self) -> None:
        self._spare_out, self._spare_tokens = None, -1
