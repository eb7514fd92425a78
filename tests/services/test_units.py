"""Small pieces: stop strings and held-back text, PDSERVE_* flags and --device, a service that exits at
start-up, an idle scheduler."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from decode_service.config import ServiceConfig, parse_args
from decode_service.output import OutputProcessor
from prefill_service.config import parse_args as parse_prefill_args
from shared.client.client import Client
from shared.client.up import Services
from shared.serving.api.model_source import load_served_model
from shared.serving.runtime import StartupError, resolve_device
from tests.services.service_testutil import ServerProcess, random_spec

TOK = load_served_model(random_spec(layers="F")).tokenizer


def ids(text: str) -> list[int]:
    assert TOK is not None
    return TOK.encode(text)


def test_stop_string_across_tokens_cuts_before_it() -> None:
    out = OutputProcessor(TOK, ["lo w"])
    steps = [out.feed(ids(c)) for c in "hello world"]
    text = "".join(s.text for s in steps)
    assert text == "hel"
    assert next(i for i, s in enumerate(steps) if s.stopped) == 6  # the token that completes "lo w"
    assert out.num_tokens == 7 and steps[-1].token_ids == []  # nothing after the stop counts


def test_earliest_stop_wins_and_later_tokens_are_dropped() -> None:
    out = OutputProcessor(TOK, ["d", "b"])
    step = out.feed(ids("abcd-more"))
    assert (step.text, step.stopped, step.token_ids) == ("a", True, ids("ab"))
    assert out.feed(ids("x")).stopped and out.num_tokens == 2


def test_text_is_held_back_only_as_long_as_it_could_start_a_stop() -> None:
    out = OutputProcessor(TOK, ["xyz"])
    assert out.feed(ids("abcx")).text == "ab"  # the last len("xyz") - 1 characters wait
    assert out.feed(ids("y")).text == "c"
    assert out.feed(ids("q")).text == "x"
    assert out.flush() == "yq"


def test_no_stop_strings_no_holding() -> None:
    out = OutputProcessor(TOK)
    assert out.feed(ids("abc")).text == "abc" and out.flush() == ""
    assert OutputProcessor(None, []).feed([1, 2]).token_ids == [1, 2]


def test_flags_default_from_pdserve_env() -> None:
    env = {
        "PDSERVE_PORT": "7001",
        "PDSERVE_MAX_QUEUE": "3",
        "PDSERVE_DRAIN_TIMEOUT": "2.5",
        "PDSERVE_MODEL": "m",
    }
    cfg = parse_args([], env=env)
    assert (cfg.port, cfg.max_queue, cfg.drain_timeout, cfg.model) == (7001, 3, 2.5, "m")
    assert parse_args(["--port", "9"], env=env).port == 9  # a flag beats the environment
    assert parse_args([], env={}) == ServiceConfig()
    with pytest.raises(ValueError):
        ServiceConfig(page_size=0)


def test_disaggregation_flags_and_the_prefill_config() -> None:
    env = {"PDSERVE_WINDOW_HISTORY": "false", "PDSERVE_PREFILL_TARGET": "p:1", "PDSERVE_PAGE_SIZE": "8"}
    cfg = parse_args([], env=env)
    assert (cfg.window_history, cfg.prefill_target, cfg.local_prefill_max_tokens) == (False, "p:1", 0)
    assert parse_args(["--window-history"], env=env).window_history is True
    assert parse_args(["--no-window-history"], env={}).window_history is False
    assert parse_args([], env={}).mixed_steps is False  # prompts first, then graph-captured decode steps
    assert parse_args([], env={"PDSERVE_MIXED_STEPS": "true"}).mixed_steps is True
    with pytest.raises(ValueError):
        ServiceConfig(prefill_timeout=0)
    pcfg = parse_prefill_args([], env=env)
    assert (pcfg.port, pcfg.page_size) == (50052, 8)


def test_gemm_tuning_is_on_unless_a_flag_or_the_environment_turns_it_off() -> None:
    assert parse_args([], env={}).tune_gemms is True
    assert parse_args(["--no-tune-gemms"], env={}).tune_gemms is False
    assert parse_args([], env={"PDSERVE_TUNE_GEMMS": "false"}).tune_gemms is False
    with pytest.raises(ValueError, match="not a boolean: 'sometimes'"):
        parse_args([], env={"PDSERVE_TUNE_GEMMS": "sometimes"})


def test_gemm_flag_takes_auto_cublas_or_skinny_and_names_itself_otherwise() -> None:
    assert parse_args([], env={}).gemm == "auto"
    assert parse_args(["--gemm", "cublas"], env={}).gemm == "cublas"
    assert parse_args([], env={"PDSERVE_GEMM": "skinny"}).gemm == "skinny"
    with pytest.raises(ValueError, match="gemm must be auto, cublas or skinny, got 'tf32'"):
        ServiceConfig(gemm="tf32")


def test_device_flag_takes_auto_cpu_cuda_or_an_index_and_resolves_to_an_exact_device() -> None:
    for ok in ("auto", "cpu", "cuda", "cuda:1"):
        assert ServiceConfig(device=ok).device == ok
    for bad in ("gpu", "cuda:", "cuda:x", "CUDA", "mps"):
        with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
            ServiceConfig(device=bad)
    assert resolve_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():  # a bare "cuda" gets the current index: set_device and IPC need one
        current = torch.device("cuda", torch.cuda.current_device())
        assert resolve_device("cuda") == resolve_device("auto") == current
        with pytest.raises(StartupError, match="are visible to this process"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(StartupError, match="no CUDA device is visible"):
            resolve_device("cuda")


def test_a_local_service_that_exits_at_start_up_is_noticed_at_once() -> None:
    local = Services(
        ["--model", "/nonexistent/model.gguf", "--device", "cpu"], port=0, prefill_port=0, echo=False
    )
    try:
        start = time.monotonic()
        assert local.wait_ready(120) is False
        assert time.monotonic() - start < 60
        assert local.failed() is not None and local.failed().wait(10) == 1
    finally:
        local.stop(30)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_idle_server_does_not_spin(server: ServerProcess, client: Client) -> None:
    client.complete([1, 2], max_tokens=4)
    time.sleep(0.2)
    before = _cpu_seconds(server.proc.pid)
    time.sleep(1.0)
    assert _cpu_seconds(server.proc.pid) - before < 0.2
