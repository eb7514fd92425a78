"""`invariants.concurrent_checks`: the contract, without a GPU (the CUDA path: the _gpu twin).

The CUDA block's bookkeeping (depth per thread and device, one join at the outermost end, an exception
still joining) is exercised against a stand-in Checker registered for cuda:0; no CUDA call is made.
"""

from __future__ import annotations

import threading

import pytest
import torch

import invariants
from invariants import (
    Invariant,
    InvariantViolation,
    Severity,
    api,
    concurrent,
    concurrent_checks,
    expect,
    levels,
)
from shared.engine.batch import ForwardBatch, Mode
from shared.engine.kv.cache import KVCache, KVConfig
from shared.engine.runner import ModelRunner
from tests.engine.engine_testutil import random_tokens, tiny_config, tiny_model
from tests.engine.test_engine_parity import Seq

GUARD = Invariant("test_concurrent_checks.guard", Severity.GUARD, "a guard checked inside a block")
CUDA0 = torch.device("cuda", 0)


class StandInBranch:
    """What a block asks of a Checker's side-stream branch that forked inside it: join()."""

    def __init__(self, fail_join: bool = False) -> None:
        self.joins = 0
        self.fail_join = fail_join

    def join(self) -> None:
        self.joins += 1
        if self.fail_join:
            raise RuntimeError("join failed")


def fork(branch: StandInBranch) -> None:
    """What a CUDA check inside a block does besides launching on the side stream."""
    concurrent.note_fork(CUDA0, branch)


def test_on_cpu_checks_inside_behave_as_outside():
    with levels("warn"):
        with concurrent_checks("cpu"):
            expect(GUARD, torch.tensor([True, False, False]))
        [v] = invariants.checker("cpu").poll()
    assert (v.new_hits, v.total) == (2, 2)
    with (
        levels("strict"),
        concurrent_checks("cpu"),
        pytest.raises(InvariantViolation, match=r"^invariant-check FAILED \[test_concurrent_checks.guard\]$"),
    ):
        expect(GUARD, torch.tensor([False]))  # raised at once, inside the block


def test_on_cpu_the_block_is_one_shared_no_op():
    assert concurrent_checks("cpu") is concurrent_checks(torch.device("cpu"))
    with concurrent_checks("cpu"), concurrent_checks("cpu"):
        assert concurrent.depth(torch.device("cpu")) == 0


def test_blocks_nest_and_only_the_outermost_joins():
    branch, other = StandInBranch(), StandInBranch()
    with concurrent_checks(CUDA0):
        assert concurrent.depth(CUDA0) == 1
        fork(branch)
        with concurrent_checks(CUDA0):
            assert concurrent.depth(CUDA0) == 2
            fork(branch)  # forking again: still one join
            fork(other)  # any Checker's branch, not only the process's
        assert (concurrent.depth(CUDA0), branch.joins, other.joins) == (1, 0, 0)
    assert (concurrent.depth(CUDA0), branch.joins, other.joins) == (0, 1, 1)
    with concurrent_checks(CUDA0):  # a later block is a new outermost one, with nothing forked yet
        pass
    assert branch.joins == 1


def test_an_exception_inside_still_joins_and_propagates():
    branch = StandInBranch()
    with pytest.raises(ValueError, match="mid-step"), concurrent_checks(CUDA0), concurrent_checks(CUDA0):
        fork(branch)
        raise ValueError("mid-step")
    assert (concurrent.depth(CUDA0), branch.joins) == (0, 1)


def test_a_failed_join_is_raised_but_never_hides_the_blocks_own_error():
    failing, fine = StandInBranch(fail_join=True), StandInBranch()
    with pytest.raises(RuntimeError, match="join failed"), concurrent_checks(CUDA0):
        fork(failing)
        fork(fine)
    assert fine.joins == 1  # the others are joined all the same
    with pytest.raises(ValueError, match="mid-step") as info, concurrent_checks(CUDA0):
        fork(failing)
        raise ValueError("mid-step")
    assert "join failed" in " ".join(getattr(info.value, "__notes__", []))
    assert concurrent.depth(CUDA0) == 0


def test_at_off_nothing_is_built_launched_created_or_joined():
    with levels("off"), concurrent_checks(CUDA0):
        expect(GUARD, lambda: pytest.fail("the predicate was built at OFF"))
    # No Checker (its slab would be device memory), nothing forked, so nothing to join.
    assert api._checkers == {} and concurrent.leave(CUDA0) == []


def test_blocks_are_per_thread_and_per_device():
    seen: list[int] = []
    branch = StandInBranch()
    with concurrent_checks(CUDA0):
        fork(branch)
        other = threading.Thread(target=lambda: seen.append(concurrent.depth(CUDA0)))
        other.start()
        other.join()
        with concurrent_checks(torch.device("cuda", 1)):
            pass  # another device's block ends: it joins nothing of cuda:0's
        assert branch.joins == 0
    assert seen == [0] and branch.joins == 1


def test_a_cpu_checker_has_no_side_stream_and_joins_nothing():
    checker = invariants.Checker("cpu")
    assert checker.side_stream is None
    checker.join()


def test_the_runner_still_checks_every_sliding_layer_in_its_block():
    # The rings' positions are now stored after the block: the check must still see the history
    # as it was before the step (no false hit while decoding), and miss nothing when it is gone.
    cfg = tiny_config("SSFS")  # three sliding layers
    cache = KVCache(cfg, KVConfig(page_size=4, num_pages=64, max_requests=4))
    runner = ModelRunner(tiny_model(cfg), cache)
    seqs = [Seq(cache, i, random_tokens(30, seed=i)) for i in range(3)]
    checker = invariants.checker("cpu")
    with levels("warn"):
        runner.forward(ForwardBatch.build([s.chunk(12) for s in seqs], Mode.EXTEND, cache), None)
        for _ in range(3):
            runner.forward(ForwardBatch.build([s.chunk(1) for s in seqs], Mode.DECODE, cache), None)
        assert checker.poll() == []
        seqs[1].window.clear()
        runner.forward(ForwardBatch.build([s.chunk(1) for s in seqs], Mode.DECODE, cache), None)
        [v] = checker.poll()
    assert (v.name, v.rows, v.new_hits) == ("swa.history_present", (seqs[1].window.slot,), 3)
