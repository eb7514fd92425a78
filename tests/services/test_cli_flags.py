"""Command-line hygiene: `pdserve --version`, help with defaults on every flag, bad values refused at
parse time (usage line, exit 2) by `pdserve` and by both services before they bind or load anything,
the services' dtype spellings, and a port already taken failing at once with a clear message."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
from importlib import metadata

import pytest

from decode_service.config import ServiceConfig
from decode_service.config import parse_args as decode_args
from prefill_service.config import parse_args as prefill_args
from shared.client import cli
from shared.client.up import DECODE_FLAGS, split_service_args
from shared.serving.config import DTYPES, CommonConfig
from tests.services.service_testutil import ROOT, ServerProcess, random_spec


def run(*cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def subcommands(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_version_is_the_package_version() -> None:
    out = run("-m", "shared.client.cli", "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"pdserve {metadata.version('pdserve')}"


def test_every_flag_of_every_subcommand_has_help_showing_its_default() -> None:
    commands = subcommands(cli.build_parser())
    assert set(commands) == {"up", "generate", "bench", "health", "demo", "openai"}
    del commands["openai"]  # the front parses its own flags: checked through `pdserve openai --help` below
    for name, parser in commands.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            assert action.help, f"pdserve {name} {action.option_strings[0]}: no help"
            assert "(default: " in action.help, f"pdserve {name} {action.option_strings[0]}: no default"
        parser.format_help()  # every help string formats
    front = run("-m", "shared.client", "openai", "--help")
    assert front.returncode == 0 and front.stdout.startswith("usage: pdserve openai"), front.stderr
    for flag in ("--target", "--host", "--port", "--api-key", "--served-model-name", "--max-body-bytes"):
        assert flag in front.stdout
    assert front.stdout.count("default:") >= 6, front.stdout


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["up", "--dtype", "fp8"], "--dtype"),
        (["up", "--device", "tpu"], "--device"),
        (["up", "--port", "70000"], "--port"),
        (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "hi", "--temperature", "-1"], "--temperature"),
        (["bench", "--rate", "0"], "--rate"),
        (["bench", "--sessions", "many"], "--sessions"),
        (["generate", "hi", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_pdserve_refuses_a_bad_value_with_usage_and_exit_2(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("usage: pdserve") and flag in err.splitlines()[-1], err


def test_the_services_refuse_bad_values_before_binding_or_loading() -> None:
    cases = [
        (["-m", "decode_service", "--dtype", "fp8"], "decode_service", "--dtype"),
        (["-m", "decode_service", "--device", "tpu"], "decode_service", "--device"),
        (["-m", "prefill_service", "--max-running", "0"], "prefill_service", "--max-running"),
    ]
    pipe = subprocess.PIPE
    procs = [
        subprocess.Popen([sys.executable, *a], cwd=ROOT, stdout=pipe, stderr=pipe, text=True)
        for a, *_ in cases
    ]
    for proc, (_, module, flag) in zip(procs, cases, strict=True):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        assert err.startswith(f"usage: python -m {module}"), err
        assert f"error: argument {flag}" in err.splitlines()[-1], err
        assert "Traceback" not in err and "listening" not in out


def test_a_bad_variable_is_blamed_on_its_flag_and_variable() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "prefill_service"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PDSERVE_DEVICE": "gpu"},
    )  # fmt: skip
    assert proc.returncode == 2
    assert "argument --device (from $PDSERVE_DEVICE='gpu'): device must be" in proc.stderr


def test_an_explicit_argv_gets_a_value_error_instead() -> None:
    """Callers that parse on behalf of someone else (the Kubernetes manifests' checks) get the reason."""
    with pytest.raises(ValueError, match="dtype must be one of"):
        decode_args(["--dtype", "fp8"], env={})
    with pytest.raises(ValueError, match="invalid literal"):
        prefill_args([], env={"PDSERVE_PORT": "fifty"})


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--tp", "0"], r"tp must be in \[1, 8\], got 0"),
     (["--tp", "9"], r"tp must be in \[1, 8\], got 9"),
     (["--expert-parallel"], r"expert_parallel .* needs --tp 2 or more")],
)  # fmt: skip
def test_tensor_parallel_flags_are_checked_at_parse(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_args(argv, env={})
    assert prefill_args(["--tp", "2", "--expert-parallel"], env={}).expert_parallel


def test_an_fp8_lm_head_needs_fp8_projections_at_parse() -> None:
    with pytest.raises(ValueError, match=r"quantize_lm_head .* needs --quantization fp8, fp8-block or auto"):
        decode_args(["--quantize-lm-head", "--quantization", "none"], env={})
    assert prefill_args(["--quantize-lm-head", "--quantization", "fp8"], env={}).quantize_lm_head
    assert not decode_args([], env={}).quantize_lm_head  # not unless asked


@pytest.mark.parametrize(
    ("spelling", "name"),
    [("bf16", "bfloat16"), ("BFloat16", "bfloat16"), ("fp16", "float16"), ("half", "float16"),
     ("fp32", "float32"), ("float", "float32"), ("torch.float32", "float32"), ("auto", "auto")],
)  # fmt: skip
def test_dtype_spellings_are_normalized_at_parse(spelling: str, name: str) -> None:
    assert decode_args(["--dtype", spelling], env={}).dtype == name
    assert prefill_args([], env={"PDSERVE_DTYPE": spelling}).dtype == name


def test_dtype_defaults_to_auto_and_pdserve_up_knows_the_same_spellings() -> None:
    assert CommonConfig().dtype == "auto" and decode_args([], env={}).dtype == "auto"
    assert set(cli.DTYPES) == set(DTYPES)


def test_decode_only_flags_are_decodes_own_fields() -> None:
    """`pdserve up` sends decode's own flags to decode alone (the prefill parser would refuse them)."""
    common = {f.name for f in dataclasses.fields(CommonConfig)}
    want = {}
    for f in dataclasses.fields(ServiceConfig):
        if f.name in common:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            want |= {flag: False, "--no-" + flag[2:]: False}
        else:
            want[flag] = True
    assert want == DECODE_FLAGS


def test_pass_through_flags_are_routed_by_service() -> None:
    both, decode = split_service_args(
        ["--max-running", "4", "--prefill-timeout=60", "--no-metrics", "--kv-transfer", "inline",
         "--no-window-history", "--page-size", "8"]
    )  # fmt: skip
    assert both == ["--max-running", "4", "--no-metrics", "--page-size", "8"]
    assert decode == ["--prefill-timeout=60", "--kv-transfer", "inline", "--no-window-history"]


def test_a_port_in_use_fails_at_once_with_a_clear_message() -> None:
    """Taken by another gRPC server (which shares it silently unless we look first) or by anything."""
    srv = ServerProcess(random_spec(), "--no-metrics")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    procs: list[subprocess.Popen[str]] = []
    try:
        ports = (srv.target.rsplit(":", 1)[1], str(taken.getsockname()[1]))
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "prefill_service",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    port,
                    "--model",
                    random_spec(load_delay_s=60),
                    "--no-metrics",
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for port in ports
        ]
        for proc, port in zip(procs, ports, strict=True):
            out, err = proc.communicate(timeout=60)  # at once: the model (60 s to load) never starts
            assert proc.returncode == 1, err
            assert f"cannot listen on 127.0.0.1:{port}: address already in use" in err, err
            assert "Traceback" not in err and "listening" not in out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        taken.close()
        srv.terminate()
        assert srv.wait() == 0
        srv.kill()
