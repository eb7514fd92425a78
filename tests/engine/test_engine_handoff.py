"""Disaggregation in one process: a prefill engine computes a prompt's KV and first token, holds it;
the KV is copied into pages and a window a decode engine reserved; decode continues from there and
produces what one colocated engine produces. Without the window history, bounded replay rebuilds it."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.kv.cache import KVConfig
from shared.engine.request import Request
from shared.engine.sampling import SamplingParams
from tests.engine.engine_testutil import W, random_tokens, tiny_config, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def engines(layout: str = "SSFS") -> tuple[Engine, Engine, Engine]:
    cfg = tiny_config(layout)

    def make(pages: int) -> Engine:
        kv = KVConfig(page_size=4, num_pages=pages, max_requests=4)
        return Engine(tiny_model(cfg), kv, EngineConfig(max_batch_tokens=16))

    return make(64), make(96), make(96)  # prefill, decode, colocated reference


def copy_kv(src: Engine, s: Request, dst: Engine, d: Request, *, history: bool) -> None:
    """What a transfer backend moves: full layers' pages for the whole prompt, the rings' last W."""
    n = dst.cache.pages_needed(len(s.prompt))
    sp, dp = torch.tensor(s.pages[:n]), torch.tensor(d.pages[:n])
    dst.cache.k_pages[:, dp] = src.cache.k_pages[:, sp]
    dst.cache.v_pages[:, dp] = src.cache.v_pages[:, sp]
    if history:
        for name in ("k_ring", "v_ring", "ring_pos"):
            getattr(dst.cache, name)[:, d.slot] = getattr(src.cache, name)[:, s.slot]


def run_to_end(engine: Engine) -> None:
    while not engine.idle:
        engine.step()


@pytest.mark.parametrize("history", [True, False])
@pytest.mark.parametrize("layout", ["SSFS", "SSSS", "FSFS"])
def test_decode_continues_from_transferred_kv_like_one_engine(layout, history):
    prefill, decode, colocated = engines(layout)
    prompt = random_tokens(3 * W + 5, seed=11)
    [want] = colocated.generate([prompt], GREEDY)

    p = prefill.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    d = decode.reserve(prompt, GREEDY)
    assert d is not None
    while not p.finished:
        prefill.step()
    prefill.flush()
    assert p.finish_reason == "length" and prefill.cache.pages.owned_by(p.rid), "held for the transfer"
    copy_kv(prefill, p, decode, d, history=history)
    prefill.release(p)
    prefill.check_idle_integrity()
    assert prefill.idle

    decode.admit_prefilled(d, p.output[0], history=history)
    run_to_end(decode)
    assert d.output == want.output
    decode.check_idle_integrity()


def test_a_reservation_that_never_gets_its_kv_is_released_once():
    _, decode, _ = engines()
    d = decode.reserve(random_tokens(20), GREEDY)
    assert d is not None and not decode.idle, "a reservation holds pages"
    decode.release(d)
    decode.release(d)
    assert decode.idle and d.finish_reason == "abort"
    decode.check_idle_integrity()


def test_reserve_refuses_what_the_pool_cannot_hold():
    _, decode, _ = engines()
    held = [decode.reserve(random_tokens(20, seed=i), GREEDY) for i in range(4)]
    assert all(held) and decode.reserve(random_tokens(20), GREEDY) is None  # four window slots
    for d in held:
        decode.release(d)
    decode.check_idle_integrity()
