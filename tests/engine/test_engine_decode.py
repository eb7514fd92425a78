"""The incremental decode path (shared/engine/decode_batch.py, shared/engine/kv/page_table.py) builds
what the general `ForwardBatch.build` builds, step after step, through admission, finishing, aborts,
reservations and slot reuse, including what a graph step moved on by itself; and the engine's tokens
do not change with it."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine import decode_batch
from shared.engine.batch import ChunkItem, ForwardBatch, Mode
from shared.engine.engine import Engine, EngineConfig, InFlightStep
from shared.engine.kv.cache import KVConfig
from shared.engine.kv.page_table import PageTable
from shared.engine.request import Request
from shared.engine.sampling import SamplingParams
from tests.engine.engine_testutil import W, random_tokens, tiny_config, tiny_model
from tests.engine.test_engine_handoff import copy_kv

FIELDS = ("input_ids", "positions", "token_slots", "cu_q", "q_start", "ring_context", "slots", "block_table",
          "full_store", "ring_store", "ring_dst", "ring_pos", "last_index", "sample_positions")  # fmt: skip


class CheckedEngine(Engine):
    """Every decode batch the engine runs is compared with the general path's for the same rows: -1
    for an input the step in flight is still producing (taken from the token table on the device)."""

    checked = 0

    def _decode_batch(self, reqs: list[Request], prev: InFlightStep | None) -> ForwardBatch:
        batch = super()._decode_batch(reqs, prev)
        graphs, n = self.runner.graphs, len(reqs)
        rows, width = n, max(len(r.pages) for r in reqs)
        if graphs is not None and n <= graphs.sizes[-1] and width <= graphs.max_pages:
            rows, width = min(s for s in graphs.sizes if s >= n), graphs.max_pages
            assert batch.buffers is graphs.static[rows].buffers, "a graph fits: its static buffers"
        items = [
            ChunkItem(r.slot, r.num_scheduled, [r.output[-1] if r.output and not r.pending else -1], r.pages)
            for r in reqs
        ]
        want = ForwardBatch.build(items, Mode.DECODE, self.cache, pad_to=rows, table_width=width)
        assert (batch.mode, batch.num_seqs, batch.num_tokens, batch.max_q, batch.num_real) == (
            want.mode, want.num_seqs, want.num_tokens, want.max_q, want.num_real)  # fmt: skip
        for name in FIELDS:
            got, exp = getattr(batch, name), getattr(want, name)
            assert got.dtype == exp.dtype and torch.equal(got, exp), (
                f"{name}: {got.tolist()} != {exp.tolist()}"
            )
        self.checked += 1
        return batch


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def check_page_table(eng: Engine) -> None:
    """Every slot's row holds its owner's pages; free slots' rows (and the scratch slot's) hold none."""
    owners = {r.slot: r for r in [*eng.running, *eng.held] if r.window is not None}
    if eng._inflight is not None:
        owners.update({r.slot: r for r in eng._inflight.releases if r.window is not None})
    owners.update({r.slot: r for r in eng.kv._finished if r.window is not None})  # freed after the return
    table = eng.kv.page_table
    for slot in range(table.table.shape[0]):
        want = owners[slot].pages if slot in owners else []
        assert table.pages(slot) == want, f"slot {slot}"
        assert not table.table[slot, len(want) :].any(), f"slot {slot}: stale pages past its own"


def make(engine_cls=Engine, *, overlap: bool = True, graphs: bool = True, max_requests: int = 4) -> Engine:
    kv = KVConfig(page_size=4, num_pages=160, max_requests=max_requests)
    cfg = EngineConfig(max_batch_tokens=24, max_running=max_requests, overlap=overlap)
    eng = engine_cls(tiny_model(tiny_config("SSFS", vocab=97)), kv, cfg)
    if graphs:  # on CPU: the graphs' static buffers, read by the eager forward (nothing is captured)
        eng.runner.capture_decode_graphs([1, 2, 4], eng.cache.pages_needed(eng.max_context()))
    return eng


def drive(eng: Engine, seed: int, steps: int = 70) -> list[tuple[list[int], str | None]]:
    """A random mix: arrivals, stops, aborts (waiting, running, in flight), reservations released."""
    rng = random.Random(seed)
    reqs: list[Request] = []
    for _ in range(steps):
        if rng.random() < 0.35 and len(reqs) < 14:
            prompt = random_tokens(rng.randint(1, 3 * W), seed=rng.randint(0, 10**6))
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]), seed=rng.randint(0, 99), max_tokens=rng.randint(1, 14),
                stop_token_ids=tuple(rng.sample(range(97), rng.choice([0, 0, 3]))), ignore_eos=True,
            )  # fmt: skip
            reqs.append(eng.add_request(prompt, params))
        if rng.random() < 0.08 and reqs:
            victim = rng.choice(reqs)
            if not victim.finished:
                eng.abort(victim)
        if rng.random() < 0.05 and (held := eng.reserve(random_tokens(5), SamplingParams(max_tokens=3))):
            eng.step()
            eng.release(held)  # a transfer that failed: its slot and pages go back
        eng.step()
        check_page_table(eng)
    while not eng.idle:
        eng.step()
        check_page_table(eng)
    eng.check_idle_integrity()
    assert not eng.kv.page_table.table.any() and not eng.kv.page_table.num_pages.any()
    return [(r.output, r.finish_reason) for r in reqs]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("overlap", "graphs"), [(True, True), (False, True), (True, False)])
def test_incremental_decode_batches_equal_the_general_path(seed, overlap, graphs):
    eng = make(CheckedEngine, overlap=overlap, graphs=graphs)
    drive(eng, seed)
    assert eng.checked > 20, "the random mix decoded too little to compare"


def test_a_request_handed_in_as_another_leaves_takes_its_own_input():
    # The rows change but not their number: [a, b] in flight, then [b, c] with c admitted from a
    # transfer. Row 0's input is b's token in flight (row 1 of the step before), row 1's is c's first
    # token from the host: the steady-state shortcut (row i takes row i) must not be taken.
    eng, src = make(CheckedEngine), make()
    prompt = random_tokens(2 * W + 3, seed=3)
    p = src.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    while not p.finished:
        src.step()
    src.flush()
    c = eng.reserve(prompt, greedy(6))
    assert c is not None
    copy_kv(src, p, eng, c, history=True)
    src.release(p)
    a = eng.add_request(random_tokens(5, seed=1), greedy(3))
    b = eng.add_request(random_tokens(7, seed=2), greedy(9))
    while len(a.output) + a.pending < 3:
        eng.step()
    assert eng._inflight is not None and eng._inflight.reqs == [a, b], "a's last token is in flight"
    eng.admit_prefilled(c, p.output[0])
    checked = eng.checked
    eng.step()
    assert eng.checked == checked + 1 and eng._inflight.reqs == [b, c]
    while not eng.idle:
        eng.step()
    assert c.output == make().generate([prompt], greedy(6))[0].output
    eng.check_idle_integrity()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_steady_decode_step_uploads_nothing(monkeypatch, temperature):
    # Greedy or sampled: the graph step moved its rows on and its tokens went to the token table, so
    # the next step on the same rows finds everything on the device already.
    eng = make(CheckedEngine)
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=12, ignore_eos=True)
    reqs = [eng.add_request(random_tokens(n, seed=n), params) for n in (5, 9, 2 * W + 1)]
    while not all(r.output for r in reqs):
        eng.step()
    eng.step()
    rows, graphs = eng.decoder._rows, eng.runner.graphs
    assert rows is not None and rows.size == 4 and graphs.resident[4] is rows
    uploads = []
    upload = decode_batch._upload
    monkeypatch.setattr(decode_batch, "_upload", lambda *a: uploads.append(a) or upload(*a))
    for _ in range(3):
        checked = eng.checked
        eng.step()
        assert eng.decoder._rows is rows, "the same rows: laid out once"
        assert eng.checked == checked + 1, "the device holds what the general path builds"
    assert not uploads, "a steady step uploads nothing"
    monkeypatch.undo()
    eng.abort(reqs[0])  # a composition change lays the rows out again
    eng.step()
    assert eng.decoder._rows is not rows and eng.decoder._rows.size == 2
    while not eng.idle:
        eng.step()
    eng.check_idle_integrity()
    want = make().generate([r.prompt for r in reqs[1:]], params)
    assert [r.output for r in reqs[1:]] == [r.output for r in want]


def test_page_table_rows_follow_assign_and_clear():
    table = PageTable(3, 4)
    table.assign(1, [7, 2, 9])
    assert table.pages(1) == [7, 2, 9] and table.version == 1
    table.assign(1, [7, 2, 9, 4])  # a request grown by a page
    assert table.pages(1) == [7, 2, 9, 4] and table.pages(0) == []
    table.assign(1, [5])
    assert table.table[1].tolist() == [5, 0, 0, 0]
    table.clear(1)
    assert not table.table.any() and table.version == 4
    with pytest.raises(ValueError, match="do not fit"):
        table.assign(0, [1] * 5)
