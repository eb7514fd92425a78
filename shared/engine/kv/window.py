"""RequestWindow: one request's sliding-window history, the last W tokens of K/V of every SWA layer.

The rings live in KVCache; a RequestWindow is the request's slot in them. Before sliding layers read
their history, `swa.history_present` is checked through `invariants.expect`: no host sync, attributed
to the request slots. A batch's forward checks every sliding layer's ring at once before the first
one is read (`check_windows`: one kernel a step, not one per layer beside attention, which WARN
would pay on every step); `window_buffer` checks one layer's, for a caller that reads one layer.
"""

from __future__ import annotations

import torch

from invariants import expect, predicates
from shared.engine.kv.cache import KVCache
from shared.engine.kv.invariants import SWA_HISTORY_PRESENT

__all__ = ["RequestWindow", "check_windows", "free_windows", "ring_store_index", "window_buffer"]


def check_windows(cache: KVCache, slots: torch.Tensor, context_lens: torch.Tensor) -> None:
    """Check that every sliding layer's ring of each slot holds its last W positions (`context_lens[r]`
    tokens of slot `slots[r]`): one check over the stacked rings of all layers, before any is read."""
    if cache.sliding_layers and slots.numel():
        _expect_history(cache.ring_pos, slots, context_lens)


def window_buffer(
    cache: KVCache, layer: int, slots: torch.Tensor, context_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rings sliding `layer` reads, after checking each slot holds its last W positions.

    `context_lens[r]` is the number of tokens of slot `slots[r]` whose K/V must already be in the
    ring (the tokens before the chunk being computed).
    """
    i = cache.kind_index[layer]
    _expect_history(cache.ring_pos_l[i], slots, context_lens)
    return cache.k_ring_l[i], cache.v_ring_l[i]


def _expect_history(pos: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor) -> None:
    """`swa.history_present` over `pos` (one layer's slot table, or all layers' stacked), by slot."""
    expect(
        SWA_HISTORY_PRESENT, lambda: predicates.window_positions(pos, context_lens, index=slots), rows=slots
    )


def ring_store_index(slot: int, start: int, count: int, window: int) -> tuple[list[int], list[int]]:
    """Where a chunk of positions [start, start+count) goes in the ring: only its last W tokens.

    Returns (token offsets within the chunk, flat ring indices slot*W + p % W).
    """
    first = max(start, start + count - window)
    positions = range(first, start + count)
    return [p - start for p in positions], [slot * window + p % window for p in positions]


class RequestWindow:
    """A request's slot in the sliding-window rings (allocated on creation, freed once)."""

    def __init__(self, cache: KVCache, owner: int) -> None:
        self.cache = cache
        self.owner = owner
        self.slot = cache.slots.alloc(owner, 1)[0]
        self._freed = False

    def buffer(self, layer: int, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This request's ring of `layer` ([W, Hkv, D] each), checked to hold `context_len` tokens."""
        dev = self.cache.device
        slots = torch.tensor([self.slot], dtype=torch.int32, device=dev)
        lens = torch.tensor([context_len], dtype=torch.int32, device=dev)
        k, v = window_buffer(self.cache, layer, slots, lens)
        return k[self.slot], v[self.slot]

    def clear(self) -> None:
        """Forget the history (it must then be transferred or rebuilt by bounded replay)."""
        self.cache.forget_windows([self.slot])

    def free(self) -> None:
        """Forget the history and give the slot back; idempotent."""
        free_windows(self.cache, [self])


def free_windows(cache: KVCache, windows: list[RequestWindow]) -> None:
    """Free many windows at once (a batch that finishes together): their rings forgotten in one
    launch, before their slots can be handed out again, and the slots freed in one pass."""
    live = [w for w in dict.fromkeys(windows) if not w._freed]
    if not live:
        return
    cache.forget_windows([w.slot for w in live])
    cache.slots.free_many([(w.owner, [w.slot]) for w in live])
    for w in live:
        w._freed = True


def replay_start(context_len: int, layer_types: tuple[str, ...], window: int) -> int:
    """First position a bounded replay must recompute to rebuild every ring exactly.

    A ring needs its layer's input at the last W positions. A sliding layer's output at p needs its
    input at p-W+1..p; a full layer reads the pages the prompt already filled, so it needs only p.
    Walking down from the top, each sliding layer below the topmost widens the span by W-1: the
    replay is bounded by the layout (W + (S-1)(W-1) tokens for S sliding layers), never by the
    prompt. Tokens before the start are never needed: their rings would only feed masked keys.
    """
    sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    if not sliding or context_len == 0:
        return context_len
    need = context_len - window  # the topmost sliding layer's own ring
    for layer in reversed(range(sliding[-1])):
        if layer_types[layer] == "sliding_attention":
            need -= window - 1
    return max(need, 0)
