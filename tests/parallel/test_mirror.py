"""The engines of tensor parallelism (shared/engine/mirror.py), in one process: a follower driven by
`follow` on a thread makes rank 0's engine calls and so reaches rank 0's state (the same requests,
tokens, pages and window slots), and one whose next forward differs from rank 0's stops, naming
both. (Each engine here holds the whole model: the forwards meet in no collective, which is what
lets the follower's divergence be provoked; tests/parallel/test_tp_services.py runs real ranks.)"""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from shared.engine.engine import EngineConfig, Later
from shared.engine.kv.cache import KVConfig
from shared.engine.mirror import FollowerEngine, LeaderEngine, PlanMismatch, follow
from shared.engine.request import Request
from shared.engine.sampling import SamplingParams
from shared.serving.api.model_source import random_model_config, random_transformer
from tests.engine.engine_testutil import W, random_tokens

KV = KVConfig(page_size=4, num_pages=64, max_requests=3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _pair(leader_cfg: EngineConfig, follower_cfg: EngineConfig):  # type: ignore[no-untyped-def]
    model = random_transformer(random_model_config({"layers": "SSFS", "window": W}), seed=3).eval()
    ours, theirs = mp.Pipe(duplex=True)
    follower = FollowerEngine(model, KV, follower_cfg, link=theirs)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            follow(follower)
        except BaseException as e:
            failure.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    leader = LeaderEngine(model, KV, leader_cfg, links=[ours])
    return leader, follower, thread, failure


def test_a_follower_reaches_rank_0s_state_call_by_call() -> None:
    cfg = EngineConfig(max_batch_tokens=8, max_running=3)
    leader, follower, thread, failure = _pair(cfg, cfg)
    theirs: dict[int, Request] = {}

    class Remembered(dict):  # type: ignore[type-arg]  # the follower's requests, kept past their end
        def __setitem__(self, rid: int, req: Request) -> None:
            theirs[rid] = req
            super().__setitem__(rid, req)

    follower.requests = Remembered()
    prompts = [random_tokens(n, seed=n) for n in (3, 2 * W + 1, W)]
    first = leader.add_request(prompts[0], GREEDY)
    leader.step()
    doomed = leader.add_request(random_tokens(W + 2, seed=9), GREEDY)
    leader.step()
    leader.abort(doomed)  # named by its id: the follower aborts its own
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        leader.add_request([], GREEDY)  # refused on both: the follower carries on
    done = leader.generate(prompts[1:], GREEDY)
    while not first.finished or leader.in_flight:
        leader.step()
    leader.free_finished()
    leader.close()
    thread.join(10)
    assert not failure and not thread.is_alive()
    for req in [first, doomed, *done]:
        twin = theirs[req.rid]
        assert (twin.output, twin.finish_reason) == (req.output, req.finish_reason)
    assert doomed.finish_reason == "abort" and first.finish_reason == "length"
    assert not follower.requests  # every request finished, and forgotten there
    assert follower.idle and leader.idle
    for pool in ("pages", "slots"):
        assert getattr(follower.cache, pool).num_free == getattr(leader.cache, pool).num_free, pool


def test_a_follower_whose_plan_differs_stops_naming_both_plans() -> None:
    leader, _, thread, failure = _pair(EngineConfig(max_batch_tokens=8), EngineConfig(max_batch_tokens=16))
    leader.add_request(random_tokens(12, seed=1), GREEDY)
    leader.step()  # rank 0 runs 8 of the prompt's tokens; the follower would run all 12
    thread.join(10)
    assert len(failure) == 1 and isinstance(failure[0], PlanMismatch)
    with pytest.raises(
        PlanMismatch, match=r"\(0, \d+, 12\),\)\) is not rank 0's \('extend', \(\(0, \d+, 8\),"
    ):
        raise failure[0]
    leader.close()


def _role(engine, tag: str) -> str:  # type: ignore[no-untyped-def]
    """An op: which engine ran it, with the caller's tag."""
    return f"{type(engine).__name__}:{tag}"


def test_ops_run_on_every_rank_and_their_results_come_back_in_order() -> None:
    cfg = EngineConfig(max_batch_tokens=8)
    leader, _, thread, failure = _pair(cfg, cfg)
    assert leader.on_ranks(_role, "a") == ["LeaderEngine:a", "FollowerEngine:a"]
    first, second = leader.on_ranks_later(_role, "b"), leader.on_ranks_later(_role, "c")
    assert first.results[0] == "LeaderEngine:b"  # rank 0's at once
    assert leader.collect(second, block=True) and leader.collect(first)
    assert (first.results, second.results) == (
        ["LeaderEngine:b", "FollowerEngine:b"],
        ["LeaderEngine:c", "FollowerEngine:c"],
    )
    leader.close()
    thread.join(10)
    assert not failure


class _Gate(Later):
    """A result that arrives once its event is set (a transfer still running on the follower)."""

    def __init__(self, event: threading.Event, value: str) -> None:
        self.event, self.value = event, value

    def poll(self) -> tuple[bool, str]:
        return (True, self.value) if self.event.is_set() else (False, "")


GATES: dict[str, threading.Event] = {}


def _later(engine, tag: str):  # type: ignore[no-untyped-def]
    """An op whose follower's result comes later, when GATES[tag] is set; rank 0's at once."""
    if isinstance(engine, LeaderEngine):
        return f"leader:{tag}"
    return _Gate(GATES.setdefault(tag, threading.Event()), f"follower:{tag}")


def test_a_result_still_to_come_arrives_later_and_does_not_hold_back_the_calls_after_it() -> None:
    cfg = EngineConfig(max_batch_tokens=8)
    leader, _, thread, failure = _pair(cfg, cfg)
    slow = leader.on_ranks_later(_later, "slow")
    # The follower carries on with rank 0's calls while the first result is outstanding.
    req = leader.add_request(random_tokens(5, seed=1), GREEDY)
    while not req.finished:
        leader.step()
    assert leader.on_ranks(_role, "after") == ["LeaderEngine:after", "FollowerEngine:after"]
    assert not leader.collect(slow) and slow.results[0] == "leader:slow"
    GATES["slow"].set()
    assert leader.collect(slow, block=True)
    assert slow.results == ["leader:slow", "follower:slow"]
    leader.close()
    thread.join(10)
    assert not failure
