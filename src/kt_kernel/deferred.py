"""Deferred experts (``max_deferred_experts_per_token`` > 0): the queue from one layer to the next.

A layer's call may leave its lowest-scored experts running on a twin of its engines after it
returns; the next call of the same thread's stack adds their output to its own. Per thread (a stack
of layers is driven by one thread; two stacks on two threads never see each other's work) the chain
holds the layer whose last call's deferred experts that thread's next call adds.

This module performs every transition of the hand-off (start, hand-over, collect, drop, close;
docs/design.md draws them) and is the only one that takes LOCK, which guards every layer's deferred
state and the chains.
"""

from __future__ import annotations

import threading

import torch

LOCK = threading.Lock()
_chains = threading.local()


def _pending() -> DeferredExperts | None:
    """The deferred experts this thread's next call adds (None: none)."""
    return getattr(_chains, "pending", None)


def _set_pending(experts: DeferredExperts | None) -> None:
    _chains.pending = experts


def after_fork_in_child() -> None:
    global LOCK
    LOCK = threading.Lock()  # another thread of the parent may have held it at the fork


def split_routing(
    expert_ids: torch.Tensor, expert_scores: torch.Tensor, protected_k: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(immediate_ids, deferred_ids), as upstream: an expert among some token's ``protected_k``
    highest-scored ones runs now for every token routed to it; the others are deferred. Entries not in
    a split are -1 there (as are -1 entries in both)."""
    protected_k = max(0, min(int(protected_k), expert_ids.shape[-1]))
    valid = expert_ids != -1
    # The last slot soaks up ids out of range, which stay in a split for the engine to report (on a
    # CUDA device an index out of range is a device-side assert, not an error).
    E = num_experts
    in_range = (expert_ids >= 0) & (expert_ids < E)
    protected = torch.zeros(E + 1, dtype=torch.bool, device=expert_ids.device)
    protected[E] = True
    if protected_k:
        top = torch.topk(expert_scores.masked_fill(~valid, float("-inf")), protected_k, dim=-1).indices
        chosen = torch.gather(expert_ids, -1, top)
        protected[torch.where((chosen >= 0) & (chosen < E), chosen, E).reshape(-1)] = True
    now = protected[torch.where(in_range, expert_ids, E)] & valid
    none = torch.full_like(expert_ids, -1)
    return torch.where(now, expert_ids, none), torch.where(valid & ~now, expert_ids, none)


class DeferredExperts:
    """One layer's deferred experts: the twin engines they run on and the call in flight."""

    def __init__(self, layer_idx: int, layer, per_token: int) -> None:
        self.layer_idx = layer_idx
        self.layer = layer  # the twin of the layer's engines: same weights and threads
        self.per_token = per_token  # max_deferred_experts_per_token
        self.out: torch.Tensor | None = None  # the direct-path call in flight, if any (under LOCK)
        self.closed_out: torch.Tensor | None = None  # its output, kept by close() for its taker
        self.taker = None  # the direct path whose call took them to add
        self.stream_call = None  # on a CUDA stream: the call whose deferred experts the next adds

    def tokens(self) -> int:
        out = self.out if self.out is not None else self.closed_out
        return out.shape[0]

    def collect(self) -> torch.Tensor:
        with LOCK:
            return self.collect_locked()

    def collect_locked(self) -> torch.Tensor:
        """Wait for the deferred call and return its output (kept by close() if the layer was closed
        meanwhile)."""
        out, self.out = self.out, None
        if out is None:
            out, self.closed_out = self.closed_out, None
            return out
        self.layer.sync()
        return out


def take_pending(
    taker, own: DeferredExperts | None, tokens: int, on_stream: bool = False
) -> torch.Tensor | DeferredExperts | None:
    """What a call of ``taker`` (a layer's call path; its deferred experts are ``own``) adds to its
    output: the
    deferred experts of this thread's last call, collected now if they are its own, which this call is
    about to replace (on a stream: left for the caller to take)."""
    layer_idx = taker.layer_idx
    with LOCK:
        experts = _pending()
        if experts is None:
            return None
        if on_stream != (experts.stream_call is not None):
            raise RuntimeError(
                f"layer {experts.layer_idx}'s deferred experts are pending on the "
                f"{'stream' if experts.stream_call is not None else 'direct'} path and this call takes "
                "the other: calls with deferred experts must all be on a CUDA stream or none"
            )
        if on_stream:
            if experts.layer_idx > layer_idx or experts.stream_call.tokens != tokens:
                raise RuntimeError(
                    f"layer {experts.layer_idx}'s deferred experts ({experts.stream_call.tokens} tokens) "
                    f"are pending and layer {layer_idx} starts a new pass or has {tokens} tokens: on a "
                    "stream, give the last layer max_deferred_experts_per_token=0"
                )
            return experts
        if experts.layer_idx > layer_idx:
            raise RuntimeError(
                f"layer {experts.layer_idx}'s deferred experts are still pending and layer {layer_idx} "
                "starts a new pass: add KTMoEWrapper.flush_deferred() to the last layer's output, or "
                "give the last layer max_deferred_experts_per_token=0"
            )
        if experts.tokens() != tokens:
            raise RuntimeError(
                f"layer {experts.layer_idx}'s deferred experts are for {experts.tokens()} tokens, this "
                f"call has {tokens}: flush them first (KTMoEWrapper.flush_deferred())"
            )
        _set_pending(None)
        if experts is own:
            return experts.collect_locked()
        experts.taker = taker
        return experts


def flush() -> torch.Tensor | None:
    """Wait for the deferred experts no later call of this thread's stack has taken yet and return
    their output (None if there are none); on a CUDA stream such experts are dropped, with a
    RuntimeError saying so."""
    with LOCK:
        experts = _pending()
        _set_pending(None)
        if experts is None:
            return None
        if experts.stream_call is not None:
            call, experts.stream_call = experts.stream_call, None
            call.path.drop_deferred(call)  # waited for on the stream; their slot freed after
            raise RuntimeError(
                f"layer {experts.layer_idx}'s deferred experts were queued on a CUDA stream and are "
                "dropped: give the last layer of a stack on a stream max_deferred_experts_per_token=0"
            )
        return experts.collect_locked()


def ready_for_next_call(own: DeferredExperts, layer_idx: int) -> None:
    """Before a direct call of the layer whose deferred experts are ``own``: refuse it while a later
    layer's call in flight still adds them; drop them where the call that took them was dropped."""
    with LOCK:
        if own.out is None or _pending() is own:
            return
        taker = own.taker
        if taker is not None and taker.adds is own:
            raise RuntimeError(
                f"layer {layer_idx}'s deferred experts of its last call are being added by layer "
                f"{taker.layer_idx}'s call, which has not been synced: sync it before calling this layer "
                "again"
            )
        own.collect_locked()  # the call that took them was dropped (interrupted): drop them


def start(own: DeferredExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """A direct call's deferred experts start on the twin engines (queued behind the call) and become
    what this thread's next call adds."""
    with LOCK:
        own.out = torch.empty_like(x)  # held before the engines write it
        try:
            own.layer.submit_addresses(x.data_ptr(), x.shape[0], ids.data_ptr(), weights.data_ptr(),
                                       own.out.data_ptr())  # fmt: skip
        except BaseException:
            if not own.layer.pending:
                own.out = None
            raise
        _set_pending(own)


def hand_over_on_stream(taken: DeferredExperts | None, own: DeferredExperts | None, call) -> None:
    """Once a stream call is queued: the deferred experts it adds (``taken``) are no longer pending,
    and its own (where it deferred some) are what this thread's next call adds."""
    with LOCK:
        if taken is not None:
            taken.stream_call = None
            if _pending() is taken:
                _set_pending(None)
        if own is not None and call.deferred:
            own.stream_call = call
            _set_pending(own)


def close(own: DeferredExperts):
    """The layer of ``own`` closes: nobody adds its pending experts now; a direct call of theirs that a
    later call took is waited for and kept for that call. Returns the stream call whose deferred
    experts no later call adds (for the stream path to drop), or None."""
    with LOCK:
        deferring, own.stream_call = own.stream_call, None
        if _pending() is own:
            _set_pending(None)
        if own.out is not None:
            own.closed_out = own.collect_locked()
    return deferring


def release_scratch(own: DeferredExperts) -> None:
    """The twin engines' scratch buffers, unless a deferred call of theirs is in flight."""
    with LOCK:
        if own.out is None:
            own.layer.release_scratch()
