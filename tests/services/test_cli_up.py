"""`pdserve up` as a user runs it: both services started at once, their output live and prefixed by
role, flags passed through to the service that takes them, SIGTERM/SIGINT drained through both
children (none left behind), and the worst child's exit code."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shared.client.client import Client
from shared.client.up import Placement, place, placed, visible_gpus
from tests.services.service_testutil import ROOT, random_spec

# A prompt longer than the 16 tokens `pdserve up` prefills locally: it goes to the prefill service.
LONG_PROMPT = list(range(1, 41))


class Up:
    """`pdserve up ...` in a subprocess; every line of its stdout and stderr collected as it comes."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "shared.client.cli", "up", "--port", "0", "--prefill-port", "0", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def expect(self, text: str, timeout: float = 120) -> str:
        """The first line (from now on, or already seen) containing `text`."""
        found = next((line for line in self.seen if text in line), None)
        deadline = time.monotonic() + timeout
        while found is None:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                pytest.fail(f"no {text!r} within {timeout:.0f}s; output:\n" + "\n".join(self.seen[-60:]))
            self.seen.append(line)
            if text in line:
                found = line
        return found

    def drain(self) -> list[str]:
        while True:
            try:
                self.seen.append(self.lines.get(timeout=1))
            except queue.Empty:
                return self.seen

    def children(self) -> list[int]:
        """Pids whose parent is `pdserve up` (from /proc)."""
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                out.append(int(stat.parent.name))
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if alive(p)]}"
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_starts_both_serves_and_drains_both_on_a_signal(sig: signal.Signals) -> None:
    # A model that takes 2 s to load: decode must not wait for prefill's to start its own.
    up = Up("--model", random_spec(load_delay_s=2), "--no-metrics", "--max-running", "4",
            "--prefill-timeout", "20")  # fmt: skip
    try:
        ready = up.expect("pdserve: ready: decode (the public API) on ")
        target = ready.split(" on ")[1].split(",")[0]
        lines = up.seen
        decode_listening = next(
            i for i, line in enumerate(lines) if "[decode] pdserve decode listening" in line
        )
        prefill_ready = next(i for i, line in enumerate(lines) if "[prefill] pdserve prefill ready" in line)
        assert decode_listening < prefill_ready, "decode started only once prefill was ready"
        assert any(line.startswith("[prefill] ") and "INFO prefill_service: ready" in line for line in lines)
        assert any(line.startswith("[decode] ") and "INFO decode_service: ready" in line for line in lines)
        with Client(target) as client:
            done = client.complete(LONG_PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
            assert done.usage.completion_tokens == 4
        children = up.children()
        assert len(children) == 2
        up.proc.send_signal(sig)
        assert up.proc.wait(60) == 0
        wait_gone(children)
        out = up.drain()
        assert any("[decode] pdserve decode stopped" in line for line in out)
        assert any("[prefill] pdserve prefill stopped" in line for line in out)
        assert any("pdserve: stopped (exit 0)" in line for line in out)
    finally:
        up.close()


def test_a_service_that_dies_stops_the_other_and_sets_the_exit_code() -> None:
    up = Up("--model", random_spec(), "--no-metrics")
    try:
        up.expect("pdserve: ready")
        children = up.children()
        decode = next(p for p in children if "decode_service" in Path(f"/proc/{p}/cmdline").read_text())
        os.kill(decode, signal.SIGKILL)
        assert up.proc.wait(60) == 128 + signal.SIGKILL
        wait_gone(children)
        assert any("the decode service exited (137): stopping the other" in line for line in up.drain())
    finally:
        up.close()


def test_a_bad_service_flag_fails_up_with_the_services_usage() -> None:
    up = Up("--model", random_spec(), "--max-running", "0")
    try:
        assert up.proc.wait(120) == 2
        out = up.drain()
        # The first service to refuse it stops the other (which may not have read its flags yet).
        roles = [r for r in ("prefill", "decode") if any(line.startswith(f"[{r}] usage: ") for line in out)]
        assert roles, out
        error = f"[{roles[0]}] python -m {roles[0]}_service: error: argument --max-running"
        assert any(line.startswith(error) for line in out), out
    finally:
        up.close()


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_hf_checkpoint(path: Path) -> None:
    """A tiny random Llama checkpoint as Hugging Face writes one: config.json, safetensors weights, and a
    character-level tokenizer whose tokenizer_config.json carries a ChatML chat template."""
    import json

    from shared.serving.api.model_source import _char_tokenizer
    from tests.model.model_testutil import save_hf_model

    save_hf_model(path, "LlamaConfig", vocab_size=100, max_position_embeddings=256)
    tok = _char_tokenizer(98, ())  # + the two turn markers: the model's 100
    tok.backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.backend.save(str(path / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_up_serves_a_hugging_face_checkpoint_and_its_chat_template(tmp_path: Path) -> None:
    from shared.model import Tokenizer

    ckpt = tmp_path / "tiny-llama"
    write_hf_checkpoint(ckpt)
    up = Up("--model", str(ckpt), "--device", "cpu", "--no-metrics", "--max-running", "2")
    try:
        ready = up.expect("pdserve: ready: decode (the public API) on ")
        target = ready.split(" on ")[1].split(",")[0]
        messages = [{"role": "user", "content": "What is the capital of France? " * 2}]
        with Client(target) as client:
            info = client.model_info()
            assert info.model_name == "tiny-llama" and info.has_chat_template and info.dtype == "float32"
            reply = client.complete(messages=messages, max_tokens=6, temperature=0.0)
        # The server rendered the checkpoint's own template: the prompt it counted is that rendering.
        rendered = Tokenizer.from_hf_dir(ckpt).encode_chat(messages)
        assert reply.usage.prompt_tokens == len(rendered) > 16  # > 16: prefilled by the prefill service
        assert reply.finish_reason in ("stop", "length")
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
    finally:
        up.close()


def test_each_service_gets_gpus_of_its_own_where_the_host_shows_enough() -> None:
    """A rank a GPU: decode's ranks on the GPUs after prefill's, from --device's on; a host with too
    few shares them (a single-GPU box runs both on its one GPU), and says so."""
    assert place("cuda", 1, 1, gpus=2) == Placement("cuda:0", "cuda:1")
    assert place("auto", 2, 4, gpus=8) == Placement("cuda:0", "cuda:2")
    assert place("cuda:4", 2, 2, gpus=8) == Placement("cuda:4", "cuda:6")
    shared = place("cuda", 1, 1, gpus=1)
    assert (shared.prefill, shared.decode) == ("cuda:0", "cuda:0")
    assert shared.note == (
        "prefill and decode share cuda:0: the host shows 1 GPU, and a GPU each for prefill's 1 and "
        "decode's 1 rank(s) from cuda:0 needs 2"
    )
    assert place("cuda:1", 2, 2, gpus=4).note.startswith(
        "prefill and decode share cuda:1-2: the host shows 4 GPUs"
    )
    # CPU ranks, no GPU, or GPUs nobody can count: the services' own --device
    assert place("cpu", 2, 1, gpus=8) == Placement("cpu", "cpu")
    assert place("auto", 1, 1, gpus=0) == Placement("auto", "auto")
    assert place("cuda", 2, 2, gpus=None) == Placement("cuda", "cuda")
    assert placed("cuda:2", 1) == "cuda:2" and placed("cuda:0", 4) == "cuda:0-3" and placed("cpu", 2) == "cpu"


@pytest.mark.parametrize(
    ("visible", "count"), [("0,1,2", 3), ("3", 1), ("", 0), ("0,1,-1,2", 2), ("GPU-5d2e,GPU-77aa", 2)]
)
def test_the_gpus_counted_are_the_ones_cuda_visible_devices_shows(
    visible: str, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert visible_gpus() == count


def test_up_runs_prefill_and_decode_at_different_tensor_parallel_degrees() -> None:
    """`--tp 2 --decode-tp 1`: prefill runs two ranks (gloo on CPU), decode one, and a prompt prefilled
    remotely is decoded from the KV its two ranks handed over, regrouped."""
    up = Up("--model", random_spec(), "--device", "cpu", "--tp", "2", "--decode-tp", "1", "--no-metrics",
            "--max-running", "2")  # fmt: skip
    try:
        assert "(prefill on cpu, decode on cpu, dtype auto)" in up.expect(
            "pdserve: starting prefill and decode"
        )
        ready = up.expect("pdserve: ready: decode (the public API) on ")
        target = ready.split(" on ")[1].split(",")[0]
        assert any(
            line.startswith("[prefill] ") and "tensor parallel: rank 0 of 2" in line for line in up.seen
        )
        assert not any(line.startswith("[decode] ") and "tensor parallel" in line for line in up.seen)
        with Client(target) as client:
            done = client.complete(LONG_PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
            assert done.usage.completion_tokens == 4 and done.usage.prompt_tokens == len(LONG_PROMPT)
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
    finally:
        up.close()
