"""An Abort by id while decode waits on a remote prefill ends the request at once: the client gets
finish_reason "abort" without waiting for the prompt to be computed, the Prefill call is cancelled
(prefill stops computing it), and both pools come back to idle."""

from __future__ import annotations

import threading
import time

from tests.services.service_testutil import remote_pair, wait_pool_idle

COMMON = ("--page-size", "4", "--max-running", "4", "--max-batch-tokens", "16")
STEP_S = 0.5  # every prefill step sleeps this long: a 64-token prompt takes 4 steps, ~2 s


def test_an_abort_during_remote_prefill_ends_the_request_at_once_and_cancels_the_prefill():
    env = {"PDSERVE_TEST_FAULTS": f"step_delay:{STEP_S}"}
    with remote_pair(*COMMON, prefill_env=env) as (c, info):
        result: dict[str, object] = {}

        def generate() -> None:
            done = c.complete(list(range(10, 74)), max_tokens=4, temperature=0.0, request_id="slow")
            result["reason"] = done.finish_reason

        t = threading.Thread(target=generate)
        t.start()
        deadline = time.monotonic() + 10
        while info.model_info().kv_pool.running == 0:  # prefill has started computing it
            assert time.monotonic() < deadline, "prefill never started"
            time.sleep(0.02)
        aborted_at = time.monotonic()
        assert c.abort("slow") is True
        t.join(timeout=10)
        assert result["reason"] == "abort"
        assert time.monotonic() - aborted_at < 2 * STEP_S, "ended at once, not when the prompt was done"
        wait_pool_idle(c)
        wait_pool_idle(info, timeout=3 * STEP_S)  # type: ignore[arg-type]  # the call was cancelled
        done = c.complete([1, 2, 3], max_tokens=2, temperature=0.0, ignore_eos=True)
        assert done.finish_reason == "length"
