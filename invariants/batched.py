"""The deferral behind `invariants.batched_checks()`: a block's checks become one launch per kind.

Inside a block (per thread and device) a Checker that would launch the fused kernel for a WARN check
records it instead; the outermost block's end launches every recorded check of one kind (operation,
dtypes, tile) as ONE kernel over a table of their tensors (`kernels/check_rows.launch_grouped`). A
step with a window check per sliding layer then pays one kernel's ramp and tail instead of one per
layer. STRICT checks, checks through an index and float bounds launch at once, as outside a block.
"""

from __future__ import annotations

from typing import Protocol

from invariants.blocks import Blocks

__all__ = ["depth", "enter", "leave", "note_pending"]


class _Flushable(Protocol):
    def flush(self) -> None: ...

    def discard(self) -> None: ...


_blocks: Blocks[_Flushable] = Blocks()
depth, enter, leave, note_pending = _blocks.depth, _blocks.enter, _blocks.leave, _blocks.note
