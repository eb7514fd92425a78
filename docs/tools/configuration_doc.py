"""Write docs/configuration.md from the services' configuration dataclasses.

Every service flag is a field of a frozen dataclass (`shared/serving/config.py` `CommonConfig`, and the
subclass each service's `parse_args` returns: `prefill_service/config.py`, `decode_service/config.py`);
`parse_config` turns each field into `--flag-name`, defaulting to `$PDSERVE_FLAG_NAME`, then to the
field's default. This script renders the same fields, with the help text the parser shows, so the page
cannot drift from the code. Environment variables that are not flags (read by `invariants/`, the
client CLI, the test hooks) are listed by hand in `OTHER_VARIABLES` below; `tests/docs/` checks that
every `PDSERVE_*` name in the code is on the page.

    python docs/tools/configuration_doc.py            # (re)write docs/configuration.md
    python docs/tools/configuration_doc.py --check    # exit 1 when docs/configuration.md is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from anywhere, installed or not
    sys.path.insert(0, str(ROOT))

import decode_service.config as decode_config  # noqa: E402
import prefill_service.config as prefill_config  # noqa: E402
from shared.serving.config import COMMON_HELP, CommonConfig  # noqa: E402

OUTPUT = ROOT / "docs" / "configuration.md"

# Variables read outside the config dataclasses: (name, who reads it, default, what it does).
OTHER_VARIABLES: tuple[tuple[str, str, str, str], ...] = (
    (
        "PDSERVE_INVARIANT_CHECK",
        "both services, any process that imports `invariants`",
        "`off`",
        "check level: `off`, `warn` or `strict`, optionally followed by comma-separated overrides "
        "`<name>=<level>` or `<namespace>.*=<level>` (e.g. `warn,swa.*=strict`); the most specific rule "
        "wins; a malformed value stops the process at import (`invariants/levels.py`, docs/invariants.md)",
    ),
    (
        "PDSERVE_PDL",
        "both services on a Hopper (or later) GPU, any process that launches the FP8 decode kernels",
        "on",
        "`0` launches the FP8 decode step's Triton kernels plainly instead of as programmatic dependents "
        "(which they are at decode batches of 1-2 and 33-64 rows, where that measured faster): an A/B "
        "switch, and a way out should a driver misbehave (`shared/kernels/_pdl.py`, docs/quantization.md)",
    ),
    (
        "PDSERVE_AUTH_TOKENS",
        "the decode service",
        "empty",
        "bearer tokens of the public API, as `--auth-tokens-file` lists them (`name:token` or "
        "`name:token:admin`), comma-separated; a variable, not a flag, so that no token shows on a command "
        "line. Both sources together are the accepted tokens (`shared/serving/security/tokens.py`)",
    ),
    (
        "PDSERVE_TARGET",
        "`pdserve generate`, `pdserve bench`, the OpenAI-compatible front",
        "`127.0.0.1:50051`",
        "default `--target`: the decode service to call (`shared/client/cli.py`, "
        "`shared/client/openai/server.py`)",
    ),
    (
        "PDSERVE_TOKEN",
        "`pdserve generate`, `pdserve bench`, the OpenAI-compatible front, `shared.client.credentials`",
        "empty (no token)",
        "the bearer token sent to the decode service (`authorization: Bearer <token>`) when no "
        "`--token-file` is given; the front uses its own for its `/health` alone and forwards each "
        "caller's API key instead (`shared/client/credentials.py`, docs/openai.md)",
    ),
    (
        "PDSERVE_API_KEY",
        "the OpenAI-compatible front (`python -m shared.client.openai`)",
        "empty (no key)",
        "default `--api-key`: requests to `/v1/*` must send `Authorization: Bearer <key>` (docs/openai.md)",
    ),
    (
        "PDSERVE_TEST_FAULTS",
        "both services' schedulers (tests only)",
        "empty (off)",
        "fault injection, comma-separated: `drop_swa_history[:TOKEN]` (decode drops the SWA history of "
        "every request whose prompt starts with TOKEN, default 3), `step_delay:SECONDS` (sleep after "
        "every engine step), `short_kv_chunk[:TOKEN]` (prefill sends an inline KV chunk one byte short); "
        "unreachable from the public API (`shared/serving/faults.py`)",
    ),
    (
        "PDSERVE_TEST_SPAN_FILE",
        "both services (tests only)",
        "empty (off)",
        "also export every span as a JSON line to this file (`shared/serving/span_file.py`)",
    ),
)

# Standard variables the services read (not pdserve's own): names, what they do.
STANDARD_VARIABLES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("OTEL_TRACES_EXPORTER",),
        "`otlp`, `console`, `none` (comma list); unset: `otlp` if an OTLP endpoint is set",
    ),
    (("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), "where spans go"),
    (
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
        "`grpc` (default) or `http/protobuf`",
    ),
    (
        ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"),
        "the resource; default names `pdserve-decode`, `pdserve-prefill`",
    ),
    (
        ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"),
        "the SDK's sampler, e.g. `parentbased_traceidratio` and a ratio",
    ),
    (("OTEL_BSP_*",), "batching of the OTLP exporter"),
    (("OTEL_SDK_DISABLED",), "`true`: no tracing, whatever else is set"),
)

HEADER = """\
# Configuration

<!-- Generated by docs/tools/configuration_doc.py from the config dataclasses; do not edit by hand.
     Regenerate: python docs/tools/configuration_doc.py -->

Both services take their settings as flags. Every flag also reads an environment variable: `--page-size`
defaults to `$PDSERVE_PAGE_SIZE`, and to the default below when the variable is unset. A flag on the
command line wins over the variable. `python -m decode_service --help` and `python -m prefill_service
--help` print the same list with the values in effect.

- Booleans are `--x` / `--no-x`; their variables take `1`, `0`, `true`, `false`, `yes` or `no` (any case).
- Values are checked at start-up; a bad one stops the process with a message naming the setting:
  `--device` must be `auto`, `cpu`, `cuda` or `cuda:N`; `--gemm` one of `auto`, `cublas`, `skinny`;
  `--kv-transfer` one of `inline`, `cuda_ipc`, `nixl` (`cuda_ipc` needs a CUDA device); page size,
  pages, running requests and batch tokens must be >= 1.
- The KV layout settings (`--model`, `--dtype`, `--page-size`) must be equal on both services: decode's
  start-up handshake refuses a prefill service whose layout differs (docs/disaggregation.md).
- In Kubernetes every variable lives in the ConfigMaps generated from `k8s/base/*.env`
  (docs/deployment.md).
"""


def _config_class(module: ModuleType) -> type[CommonConfig]:
    """The dataclass the module's `parse_args` returns."""
    cls = typing.get_type_hints(module.parse_args)["return"]
    assert isinstance(cls, type) and issubclass(cls, CommonConfig), cls
    return cls


def _help_for(module: ModuleType, cls: type[CommonConfig]) -> Mapping[str, str]:
    """The help dict the module passes to `parse_config`: the one of its dicts that covers every field."""
    names = {f.name for f in dataclasses.fields(cls)}
    found = [v for v in vars(module).values() if isinstance(v, dict) and names <= set(v)]
    if not found:
        raise LookupError(f"{module.__name__}: no help dict covers every field of {cls.__name__}")
    return min(found, key=len)


@dataclasses.dataclass(frozen=True)
class Service:
    name: str
    cls: type[CommonConfig]
    help: Mapping[str, str]


def services() -> tuple[Service, Service]:
    """(decode, prefill), each with its config dataclass and help texts."""
    out = []
    for name, module in (("decode", decode_config), ("prefill", prefill_config)):
        cls = _config_class(module)
        out.append(Service(name, cls, _help_for(module, cls)))
    return out[0], out[1]


def env_var(field: str) -> str:
    return f"PDSERVE_{field.upper()}"  # as shared/serving/config.py parse_config names it


def flag(field: dataclasses.Field) -> str:
    name = field.name.replace("_", "-")
    return f"`--{name}` / `--no-{name}`" if isinstance(field.default, bool) else f"`--{name}`"


def show(value: object) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return "empty"
    return f"`{value}`"


def cell(text: str) -> str:
    """Help text from the code as one Markdown table cell (no code spans there: `<json>` is text)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| flag | environment variable | default | description |", "|---|---|---|---|"]
    lines += [f"| {a} | `{b}` | {c} | {cell(d)} |" for a, b, c, d in rows]
    return lines


def _defaults(field: str, decode: Service, prefill: Service) -> str:
    d, p = (next(f for f in dataclasses.fields(s.cls) if f.name == field).default for s in (decode, prefill))
    return show(d) if d == p else f"decode {show(d)}, prefill {show(p)}"


def _own_rows(svc: Service) -> list[tuple[str, str, str, str]]:
    common = {f.name for f in dataclasses.fields(CommonConfig)}
    return [
        (flag(f), env_var(f.name), show(f.default), svc.help[f.name])
        for f in dataclasses.fields(svc.cls)
        if f.name not in common
    ]


def render() -> str:
    decode, prefill = services()
    common_rows = [
        (flag(f), env_var(f.name), _defaults(f.name, decode, prefill), COMMON_HELP[f.name])
        for f in dataclasses.fields(CommonConfig)
    ]
    out = [HEADER]
    out += ["## Both services", "", "`python -m decode_service` and `python -m prefill_service`.", ""]
    out += [*_table(common_rows), ""]
    sections = (
        ("## Decode service only", decode, "`python -m decode_service`: where and how prompts prefill."),
        ("## Prefill service only", prefill, "`python -m prefill_service`."),
    )
    for title, svc, intro in sections:
        rows = _own_rows(svc)
        out += [title, "", intro, ""]
        out += [*_table(rows), ""] if rows else ["None: it takes only the flags both services share.", ""]
    out += [
        "## Other environment variables",
        "",
        "Read outside the flags (not settable on a command line).",
        "",
    ]
    out += ["| variable | read by | default | description |", "|---|---|---|---|"]
    out += [f"| `{n}` | {who} | {d} | {text} |" for n, who, d, text in OTHER_VARIABLES]
    out += ["", "## Standard variables", ""]
    out += ["OpenTelemetry tracing reads the standard `OTEL_*` variables (docs/observability.md):", ""]
    out += ["| variable | effect |", "|---|---|"]
    out += [f"| {', '.join(f'`{n}`' for n in names)} | {text} |" for names, text in STANDARD_VARIABLES]
    out += [
        "",
        "`cuda_ipc` needs PyTorch's default CUDA allocator: do not enable expandable segments or",
        "`cudaMallocAsync` through `PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF` on the decode service",
        "(memory from them has no CUDA IPC handle). `nixl` takes UCX's own `UCX_*` variables.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(
                f"{OUTPUT.relative_to(ROOT)} is stale: run python docs/tools/configuration_doc.py",
                file=sys.stderr,
            )
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
