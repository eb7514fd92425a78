"""The inline KV transfer: chunks out of a held prefill request, into a decode reservation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.transfer.base import KVLayout, mismatches
from shared.transfer.inline import apply_chunk, begin_receive, extract_chunks
from tests.engine.engine_testutil import W, random_tokens
from tests.engine.test_engine_handoff import GREEDY, copy_kv, engines, run_to_end

ONE = SamplingParams(temperature=0.0, max_tokens=1)


def _prefilled(prefill: Engine, prompt: list[int]):  # type: ignore[no-untyped-def]
    p = prefill.add_request(prompt, ONE, hold_kv=True)
    while not p.finished:
        prefill.step()
    prefill.flush()
    return p


@pytest.mark.parametrize("n", [3, W, 3 * W + 5])
def test_round_trip_equals_a_direct_copy(n):
    prefill, decode, other = engines("SSFS")
    prompt = random_tokens(n, seed=n)
    p = _prefilled(prefill, prompt)
    d, ref = decode.reserve(prompt, GREEDY), other.reserve(prompt, GREEDY)
    assert d is not None and ref is not None and d.pages == ref.pages and d.slot == ref.slot
    begin_receive(decode.cache, d.slot)
    for chunk in extract_chunks(prefill.cache, p.pages, p.slot, n, max_chunk_bytes=700):
        apply_chunk(decode.cache, d.pages, d.slot, chunk)
    copy_kv(prefill, p, other, ref, history=True)
    npg = decode.cache.pages_needed(n)
    for name in ("k_pages", "v_pages"):
        a, b = getattr(decode.cache, name), getattr(other.cache, name)
        # Only the prompt's tokens are shipped; the page tail past L is never read.
        flat_a = a[:, torch.tensor(d.pages[:npg])].flatten(1, 2)[:, :n]
        flat_b = b[:, torch.tensor(ref.pages[:npg])].flatten(1, 2)[:, :n]
        assert torch.equal(flat_a, flat_b)
    for name in ("k_ring", "v_ring", "ring_pos"):
        assert torch.equal(getattr(decode.cache, name)[:, d.slot], getattr(other.cache, name)[:, ref.slot])
    prefill.release(p)
    decode.admit_prefilled(d, p.output[0])
    run_to_end(decode)
    [want] = engines("SSFS")[2].generate([prompt], GREEDY)
    assert d.output == want.output


def _bytes(prefill: Engine, n: int) -> tuple[int, int]:
    p = _prefilled(prefill, random_tokens(n, seed=n))
    chunks = list(extract_chunks(prefill.cache, p.pages, p.slot, n))
    prefill.release(p)
    return sum(c.nbytes for c in chunks if not c.window), sum(c.nbytes for c in chunks if c.window)


def test_window_bytes_do_not_grow_with_the_prompt():
    prefill, _, _ = engines("SSFS")
    full2, win2 = _bytes(prefill, 2 * W)
    full8, win8 = _bytes(prefill, 8 * W)
    assert win2 == win8 > 0
    assert full8 == 4 * full2


def test_chunk_size_limit_respected_and_no_window_without_history():
    prefill, _, _ = engines("SSFS")
    p = _prefilled(prefill, random_tokens(5 * W))
    chunks = list(extract_chunks(prefill.cache, p.pages, p.slot, 5 * W, max_chunk_bytes=1000))
    assert chunks and all(c.nbytes <= 1000 for c in chunks)
    assert not any(c.window for c in extract_chunks(prefill.cache, p.pages, p.slot, 5 * W, window=False))
    prefill.release(p)
    prefill.check_idle_integrity()


def test_layout_mismatches_name_every_field():
    a = KVLayout.of(engines("SSFS")[0].cache, "m", "w1")
    b = KVLayout.of(engines("SSSS")[0].cache, "n", "w2")
    got = mismatches(a, b)
    assert [g.split(":")[0] for g in got] == ["model_name", "layer_types", "weights"]
    assert mismatches(a, KVLayout.from_pb(a.to_pb())) == []


def test_a_mismatch_shows_a_peers_field_cut_short():
    a = KVLayout.of(engines("SSFS")[0].cache, "m", "w")
    b = KVLayout.from_pb(a.to_pb())
    huge = dataclasses.replace(b, model_name="x" * 3_000_000)
    (line,) = mismatches(huge, a)
    assert line.startswith("model_name: 'xxx") and len(line) < 200


@pytest.mark.gpu
def test_staging_and_applying_a_prompts_kv_on_cuda_never_waits_for_the_device():
    from invariants.testing import no_host_sync
    from shared.engine.engine import EngineConfig
    from shared.engine.kv.cache import KVConfig
    from shared.transfer.inline import stage
    from tests.engine.engine_testutil import tiny_config, tiny_model

    kv = KVConfig(page_size=4, num_pages=64, max_requests=4, device="cuda")
    prefill = Engine(tiny_model(tiny_config("SSFS")).cuda(), kv, EngineConfig(max_batch_tokens=16))
    n = 3 * W + 5
    p = _prefilled(prefill, random_tokens(n))
    want = list(extract_chunks(prefill.cache, p.pages, p.slot, n))  # warm: pinned blocks, kernels
    with no_host_sync():
        staged = stage(prefill.cache, p.pages, p.slot, n)
    prefill.release(p)  # at once: the gather runs before anything later on the stream
    staged.wait()
    assert list(staged.chunks()) == want
    decode = Engine(tiny_model(tiny_config("SSFS")).cuda(), kv, EngineConfig(max_batch_tokens=16))
    d = decode.reserve(random_tokens(n), GREEDY)
    assert d is not None
    for chunk in want:  # warm: pinned blocks
        apply_chunk(decode.cache, d.pages, d.slot, chunk)
    with no_host_sync():  # decode's receive path, applied while its steps run
        begin_receive(decode.cache, d.slot)
        for chunk in want:
            apply_chunk(decode.cache, d.pages, d.slot, chunk)
    from shared.transfer.inline import ChunkAssembler, apply_batch

    kv = ChunkAssembler(
        KVLayout.of(decode.cache, "m", "w"), n, window=True, pin=True
    )  # on decode's gRPC thread
    batches = [b for c in want for b in kv.add(c.layer, c.window, c.token_start, c.token_count, c.k, c.v)]
    with no_host_sync():  # the batched path: pinned batches, one index copy per layer
        begin_receive(decode.cache, d.slot)
        for batch in [*batches, *kv.finish()]:
            apply_batch(decode.cache, d.pages, d.slot, batch)


def _receive_both_ways(n: int, window: bool, max_batch_bytes: int = 16 << 20):  # type: ignore[no-untyped-def]
    """A prompt's chunks applied one by one into one decode cache and, joined by a ChunkAssembler into
    batches (one per layer unless `max_batch_bytes` cuts them), into another (same reservation): both
    caches, and the reservation."""
    from shared.transfer.inline import ChunkAssembler, apply_batch

    prefill, per_chunk, batched = engines("SSFS")
    prompt = random_tokens(n, seed=n)
    p = _prefilled(prefill, prompt)
    a, b = per_chunk.reserve(prompt, GREEDY), batched.reserve(prompt, GREEDY)
    assert a is not None and b is not None and a.pages == b.pages and a.slot == b.slot
    chunks = list(extract_chunks(prefill.cache, p.pages, p.slot, n, window=window, max_chunk_bytes=700))
    begin_receive(per_chunk.cache, a.slot)
    for chunk in chunks:
        apply_chunk(per_chunk.cache, a.pages, a.slot, chunk)
    begin_receive(batched.cache, b.slot)
    kv = ChunkAssembler(
        KVLayout.of(batched.cache, "m", "w"), n, window=window, max_batch_bytes=max_batch_bytes
    )
    batches = [x for c in chunks for x in kv.add(c.layer, c.window, c.token_start, c.token_count, c.k, c.v)]
    batches += kv.finish()
    layers = len(batched.cache.full_layers) + (len(batched.cache.sliding_layers) if window else 0)
    largest_chunk = max(len(c.k) for c in chunks)
    assert all(x.k.numel() * x.k.element_size() <= max(max_batch_bytes, largest_chunk) for x in batches)
    if n * len(chunks[0].k) // chunks[0].token_count > max_batch_bytes:
        assert len(batches) > layers, "batches cut at the cap"
    else:
        assert len(batches) == layers <= len(chunks)  # one batch per layer
    for batch in batches:
        apply_batch(batched.cache, b.pages, b.slot, batch)
    prefill.release(p)
    return per_chunk, batched, a, b


@pytest.mark.parametrize(("window", "cap"), [(True, 16 << 20), (False, 16 << 20), (True, 2000)])
@pytest.mark.parametrize("n", [3, W, 3 * W + 5])
def test_batched_receive_equals_applying_each_chunk(n, window, cap):
    per_chunk, batched, a, b = _receive_both_ways(n, window, cap)
    for name in ("k_pages", "v_pages", "k_ring", "v_ring", "ring_pos"):
        assert torch.equal(getattr(per_chunk.cache, name), getattr(batched.cache, name)), name
    batched.admit_prefilled(b, 0, history=window)
    per_chunk.admit_prefilled(a, 0, history=window)
    run_to_end(batched)
    run_to_end(per_chunk)
    assert a.output == b.output


def _chunk_fields(chunk):  # type: ignore[no-untyped-def]
    return chunk.layer, chunk.window, chunk.token_start, chunk.token_count, chunk.k, chunk.v


def test_a_malformed_or_incomplete_stream_is_refused_where_it_is_read_and_ends_there():
    from shared.transfer.inline import ChunkAssembler

    prefill, decode, _ = engines("SSFS")
    n = 2 * W
    p = _prefilled(prefill, random_tokens(n))
    chunks = list(extract_chunks(prefill.cache, p.pages, p.slot, n, max_chunk_bytes=700))
    prefill.release(p)
    layout = KVLayout.of(decode.cache, "m", "w")
    full = next(c for c in chunks if not c.window)
    assert full.token_start == 0 and full.token_count < n, "a layer of several chunks"
    second = next(c for c in chunks if c.layer == full.layer and c.token_start > 0)
    window = next(c for c in chunks if c.window)
    wrong = {
        "layer kind": [(full.layer, True, *_chunk_fields(full)[2:])],
        "no such layer": [(99, False, *_chunk_fields(full)[2:])],
        "past the prompt": [(full.layer, False, n, *_chunk_fields(full)[3:])],
        "bytes short": [(*_chunk_fields(full)[:4], full.k[:-1], full.v)],
        "no tokens": [(full.layer, False, 0, 0, b"", b"")],
        "a gap": [_chunk_fields(second)],
        "a repeat": [_chunk_fields(full), _chunk_fields(full)],
        "window history not asked for": [_chunk_fields(window)],
    }
    for why, sent in wrong.items():
        kv = ChunkAssembler(layout, n, window=why != "window history not asked for")
        with pytest.raises(ValueError):
            for fields in sent:
                kv.add(*fields)
        with pytest.raises(ValueError, match="earlier chunk"):  # nothing of this request after it
            kv.add(*_chunk_fields(full))
        with pytest.raises(ValueError, match="earlier chunk"):
            kv.finish()
    kv = ChunkAssembler(layout, n, window=True)
    for c in chunks[:-1]:  # the stream ends one chunk short
        kv.add(*_chunk_fields(c))
    with pytest.raises(ValueError, match=f"layers \\[{chunks[-1].layer}\\] short of the prompt's {n} tokens"):
        kv.finish()
    kv = ChunkAssembler(layout, n, window=False)
    for c in chunks:
        if not c.window:
            kv.add(*_chunk_fields(c))
    assert kv.finish() == [], "without window history the full layers are the whole stream"
