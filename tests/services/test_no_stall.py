"""One request never stalls the others: a 4 MB text (within the text limit of a 128k-context model,
refused for its token count once decode's worker thread has counted twice the context) and a 250 kB one
(tokenized whole, then refused) do not delay a concurrent stream's next token by more than one step's
worth plus a margin. Measured as a ratio to the step (the
stream's median gap before the text arrives), not as an absolute time."""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import grpc
import pytest

from shared.client.client import Client, GenerationError
from tests.services.service_testutil import ServerProcess, random_spec, stop_all, wait_pool_idle

pytestmark = pytest.mark.slow
MAX_GAP_IN_STEPS = 2.5  # the token due plus one step's worth, and a margin for a loaded CI machine


def test_a_4mb_text_does_not_delay_a_concurrent_stream() -> None:
    decode = ServerProcess(
        random_spec(max_context=131072), "--no-metrics", "--num-pages", "8300", "--max-running", "2",
        # A step mostly asleep, and one torch thread: the text's tokenizer takes a core of two, and the
        # test measures stalls (a thread holding the GIL, the event loop blocked), not a shared CPU.
        env={"PDSERVE_TEST_FAULTS": "step_delay:0.06", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        with Client(decode.target) as c:
            stream = c.generate([1, 2, 3], max_tokens=250, temperature=0.0, ignore_eos=True)
            arrivals: list[float] = []
            sent: list[float] = []
            answered: list[float] = []
            refused: list[GenerationError] = []

            def big() -> None:
                sent.append(time.monotonic())
                with Client(decode.target) as other:
                    for text in ("a" * 4_000_000, "b" * 250_000):
                        try:
                            other.complete(text, max_tokens=1)
                        except GenerationError as e:
                            refused.append(e)
                answered.append(time.monotonic())

            sender = threading.Thread(target=big)
            for chunk in stream:
                arrivals.extend([time.monotonic()] * max(len(chunk.token_ids), 1))
                if len(arrivals) == 20:
                    sender.start()
                if answered and sum(a > answered[0] for a in arrivals) >= 3:
                    stream.cancel()  # the stream went on past the texts' refusals: nothing more to see
            sender.join()
            wait_pool_idle(c)
        assert [e.code for e in refused] == [grpc.StatusCode.INVALID_ARGUMENT] * 2
        assert "over 262144 tokens" in refused[0].details, refused[0].details
        assert "250000 tokens" in refused[1].details, refused[1].details
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        step = statistics.median(gaps[:18])
        busy = [g for a, g in zip(arrivals[1:], gaps, strict=False) if sent[0] <= a <= answered[0] + step]
        assert answered[0] - sent[0] > 3 * step, "the text was refused too fast to have been tokenized"
        assert busy, "no token arrived while the text was being handled"
        worst = max(busy) / step
        assert worst <= MAX_GAP_IN_STEPS, f"a gap of {worst:.1f} steps (step {step * 1e3:.1f} ms)"
    finally:
        stop_all(decode)
