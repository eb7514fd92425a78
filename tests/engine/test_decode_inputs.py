"""A decode step's inputs come from the device, not the host: a graph step moves its rows on by one
token (`shared/kernels/decode_advance.py`), field for field what `ForwardBatch.build` packs for the
same rows one token further, padding rows left as they were; and every input id of -1 is taken from
the token table the sampling step wrote (`shared/kernels/token_table.py`). Both on the torch path and
on the Triton kernels (interpreted on CPU, compiled on CUDA)."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from shared.engine.batch import ChunkItem, ForwardBatch, Mode
from shared.engine.kv.cache import KVCache, KVConfig
from shared.kernels.decode_advance import DecodeRows, advance_rows
from shared.kernels.token_table import take_tokens
from tests.engine.engine_testutil import tiny_config
from tests.engine.test_engine_decode import FIELDS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, WIDTH, ROWS = 4, 6, 5  # a 6-page table: position 24 is past it


def cache() -> KVCache:
    kv = KVConfig(page_size=PAGE, num_pages=64, max_requests=4, device=DEVICE)
    return KVCache(tiny_config("SSFS"), kv)


def batch_at(kv: KVCache, starts: list[int], token: int = 7) -> ForwardBatch:
    """A decode batch padded to ROWS rows: request i on slot i at position starts[i], pages 10i.."""
    items = [ChunkItem(i, s, [token], [10 * i + p for p in range(WIDTH)]) for i, s in enumerate(starts)]
    return ForwardBatch.build(items, Mode.DECODE, kv, pad_to=ROWS, table_width=WIDTH)


def advance(kv: KVCache, batch: ForwardBatch, backend: str) -> torch.Tensor:
    rows = DecodeRows(**{f.name: getattr(batch, f.name) for f in fields(DecodeRows)})
    return advance_rows(
        rows, page_size=kv.page_size, window=kv.ring_len, skip_slot=kv.scratch_slot, backend=backend
    )


# Within a page, onto the next page, onto the ring's wrap (W = 8).
STARTS = [[0, 5, 9, 2], [3, 7, 15, 22], [22, 1, 19, 6]]


@pytest.mark.parametrize("starts", STARTS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_next_steps_fields_are_the_hosts(starts, backend):
    kv = cache()
    got = batch_at(kv, starts)
    sampled_at = got.sample_positions.clone()
    assert torch.equal(advance(kv, got, backend), sampled_at), "the positions this step samples at"
    want = batch_at(kv, [s + 1 for s in starts], token=-1)  # the next inputs: from the token table
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_position_past_the_block_table_stores_nothing(backend):
    kv = cache()
    batch = batch_at(kv, [23, 4])  # 24 would be page 6 of a 6-page table; 5 is page 11 (slot 1), offset 1
    advance(kv, batch, backend)
    assert batch.full_store[:2].tolist() == [-1, 11 * PAGE + 1] and batch.positions[:2].tolist() == [24, 5]


def test_decode_rows_are_checked_by_name():
    kv = cache()
    batch = batch_at(kv, [0])
    rows = {f.name: getattr(batch, f.name) for f in fields(DecodeRows)}
    with pytest.raises(ValueError, match="ring_pos must have 1 dims and 5 rows"):
        advance_rows(
            DecodeRows(**{**rows, "ring_pos": rows["ring_pos"][:3]}), page_size=4, window=8, skip_slot=4
        )
    with pytest.raises(ValueError, match="page_size and window must be >= 1"):
        advance_rows(DecodeRows(**rows), page_size=0, window=8, skip_slot=4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pending_inputs_come_from_the_token_table(backend):
    table = torch.tensor([40, 41, 42, 43, 44], dtype=torch.int64, device=DEVICE)
    ids = torch.tensor([5, -1, 6, -1, -1, 0], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([9, 3, 9, 0, 3, 4], dtype=torch.int32, device=DEVICE)  # 9: never read (a host token)
    got = take_tokens(ids, slots, table, backend=backend)
    assert got.tolist() == [5, 43, 6, 40, 43, 0]
    assert ids.tolist() == [5, -1, 6, -1, -1, 0], "the batch's own ids are left as they are"


def test_take_tokens_refuses_bad_arguments_by_name():
    table = torch.zeros(4, dtype=torch.int64)
    ids = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"ids must be \[T\] int64"):
        take_tokens(ids.int(), torch.zeros(3, dtype=torch.int32), table)
    with pytest.raises(ValueError, match=r"slots must be \[T=3\]"):
        take_tokens(ids, torch.zeros(2, dtype=torch.int32), table)
    with pytest.raises(ValueError, match="table must be a contiguous"):
        take_tokens(ids, torch.zeros(3, dtype=torch.int32), table.int())
