"""Render one real request's trace as a waterfall PNG for docs/observability.md.

Starts the prefill and decode services on the embedded default model (CPU), sends one chat request
that is prefilled remotely, reads back both services' spans (the test JSON-lines exporter) and draws
the request's trace. Needs matplotlib (`pip install matplotlib`; not a dependency of the package).

    python docs/tools/trace_waterfall.py docs/img/trace-waterfall.png
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from shared.client.cli import LocalServices, chatml
from shared.client.client import Client


def collect(span_file: Path) -> list[dict]:
    os.environ["PDSERVE_TEST_SPAN_FILE"] = str(span_file)
    services = LocalServices("--device", "cpu", "--num-pages", "128", "--max-running", "4")
    try:
        services.wait_ready(timeout=300)
        with Client(services.target) as client:
            client.complete(chatml("What is the capital of France?"), max_tokens=16, temperature=0.0)
        time.sleep(1.0)  # let both services export the finished spans
    finally:
        services.stop()
    return [json.loads(line) for line in span_file.read_text().splitlines() if line.strip()]


def draw(spans: list[dict], out: Path) -> None:
    root = next(s for s in spans if s["name"].endswith("Generate") and s["parent_id"] is None)
    trace = [s for s in spans if s["trace_id"] == root["trace_id"]]
    by_id = {s["span_id"]: s for s in trace}

    def depth(s: dict) -> int:
        d = 0
        while s["parent_id"] in by_id:
            s, d = by_id[s["parent_id"]], d + 1
        return d

    trace.sort(key=lambda s: (s["start_ns"], depth(s)))
    t0 = min(s["start_ns"] for s in trace)
    colors = {"pdserve-decode": "#4C72B0", "pdserve-prefill": "#DD8452"}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(trace) + 1.2))
    for row, s in enumerate(trace):
        start, end = (s["start_ns"] - t0) / 1e6, (s["end_ns"] - t0) / 1e6
        ax.barh(row, max(end - start, 0.05), left=start, color=colors.get(s["service"], "#888888"))
        label = "  " * depth(s) + f"{s['name']}  [{s['service']}]  {end - start:.1f} ms"
        ax.text(start, row, " " + label, va="center", fontsize=8)
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the request span began")
    ax.set_title(f"one disaggregated request, trace {root['trace_id'][:16]}... (embedded SmolLM2, CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img/trace-waterfall.png")
    with tempfile.TemporaryDirectory() as tmp:
        draw(collect(Path(tmp) / "spans.jsonl"), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
