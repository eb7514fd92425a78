"""A greedy graph step moves the decode inputs on by itself (`shared/engine/decode_advance.py`): what the
argmax kernel (interpreted on CPU, compiled on CUDA) or its torch fallback leaves in a decode batch
is, field for field, what `ForwardBatch.build` packs for the same rows one token further; padding rows
are left as they were; and the engine then uploads nothing on a steady greedy step."""

from __future__ import annotations

import pytest
import torch

from shared.engine.batch import ChunkItem, ForwardBatch, Mode
from shared.engine.decode_advance import DecodeAdvance
from shared.engine.decode_batch import DecodeBatcher
from shared.engine.kv.cache import KVCache, KVConfig
from shared.kernels.argmax import argmax_rows
from tests.engine.engine_testutil import random_tokens, tiny_config
from tests.engine.test_engine_decode import FIELDS, greedy, make

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, WIDTH, ROWS = 4, 6, 5  # a 6-page table: position 24 is past it


def cache() -> KVCache:
    kv = KVConfig(page_size=PAGE, num_pages=64, max_requests=4, device=DEVICE)
    return KVCache(tiny_config("SSFS"), kv)


def batch_at(kv: KVCache, starts: list[int]) -> ForwardBatch:
    """A decode batch padded to ROWS rows: request i on slot i at position starts[i], pages 10i.."""
    items = [ChunkItem(i, s, [7], [10 * i + p for p in range(WIDTH)]) for i, s in enumerate(starts)]
    return ForwardBatch.build(items, Mode.DECODE, kv, pad_to=ROWS, table_width=WIDTH)


def advance(kv: KVCache, batch: ForwardBatch, how: str, splits: int = 1) -> torch.Tensor:
    """Settle a greedy step on `batch`'s real rows and move them one token on, as the runner does."""
    logits = torch.randn(batch.num_real, 300, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    step = DecodeAdvance(batch, kv.page_size, kv.ring_len)
    if how == "torch":
        return argmax_rows(logits, backend="torch", feed_out=batch.input_ids, advance=step)
    launch = {"num_splits": splits, "block": 64}
    return argmax_rows(logits, backend="triton", feed_out=batch.input_ids, advance=step, **launch)


# Within a page, onto the next page, onto the ring's wrap (W = 8).
STARTS = [[0, 5, 9, 2], [3, 7, 15, 22], [22, 1, 19, 6]]


@pytest.mark.parametrize("starts", STARTS)
@pytest.mark.parametrize(("how", "splits"), [("torch", 1), ("triton", 1), ("triton", 3)])
def test_the_next_steps_inputs_are_the_hosts(starts, how, splits):
    kv = cache()
    got = batch_at(kv, starts)
    tokens = advance(kv, got, how, splits)
    want = batch_at(kv, [s + 1 for s in starts])
    want.input_ids[: len(starts)] = tokens
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


@pytest.mark.parametrize("how", ["torch", "triton"])
def test_a_position_past_the_block_table_stores_nothing(how):
    kv = cache()
    batch = batch_at(kv, [23, 4])  # 24 would be page 6 of a 6-page table; 5 is page 11 (slot 1), offset 1
    advance(kv, batch, how)
    assert batch.full_store[:2].tolist() == [-1, 11 * PAGE + 1] and batch.positions[:2].tolist() == [24, 5]


def test_a_decode_advance_wants_a_decode_batch():
    kv = cache()
    items = [ChunkItem(0, 0, [1, 2, 3], [0])]
    with pytest.raises(ValueError, match="decode batch"):
        DecodeAdvance(ForwardBatch.build(items, Mode.EXTEND, kv), kv.page_size, 8)
    with pytest.raises(ValueError, match="page_size and window"):
        DecodeAdvance(batch_at(kv, [0]), 0, 8)
    small = batch_at(kv, [0])
    with pytest.raises(ValueError, match="advance must be a decode batch of at least 6 rows"):
        argmax_rows(torch.zeros(6, 10, device=DEVICE), advance=DecodeAdvance(small, PAGE, 8))


def test_a_steady_greedy_step_uploads_nothing(monkeypatch):
    eng = make()
    reqs = [eng.add_request(random_tokens(n, seed=n), greedy(12)) for n in (5, 9, 19)]
    while not all(len(r.output) >= 2 for r in reqs):
        eng.step()
    uploads = []
    inner = DecodeBatcher._upload_static

    def counted(self, rows, graphs, **kw):
        out = inner(self, rows, graphs, **kw)
        uploads.append(kw["advanced"])
        return out

    monkeypatch.setattr(DecodeBatcher, "_upload_static", counted)
    raw = {size: t.clone() for size, t in eng.runner.graphs.raw.items()}
    copies = []
    monkeypatch.setattr("shared.engine.decode_batch._upload", lambda *a: copies.append(a))
    for _ in range(3):
        eng.step()
    assert uploads == [True] * 3 and not copies, "steady greedy steps: the device moved its own inputs"
    assert any(not torch.equal(raw[s], eng.runner.graphs.raw[s]) for s in raw), "and they did move"
    monkeypatch.undo()
    while not eng.idle:
        eng.step()
    eager = make(graphs=False).generate([r.prompt for r in reqs], greedy(12))
    assert [r.output for r in reqs] == [r.output for r in eager]
