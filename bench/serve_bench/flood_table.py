"""The arms of one `bench/gpu_flood.sh` call against its bare-vLLM arm, load by load.

Reads the `serve-app flood` result files of a call (``LABEL.json``, the label being the arm's
tag and the load, e.g. ``stackpbp-max_num_batched_tokens-1536-2048-128-1024-16-s3``) and writes
one markdown table: each arm's quiet TTFT, its flood's steady output and the engine's steady
work (the flood's and the quiet tenant's tokens), both as a ratio to the bare arm's on the same
load. Issue 42's bars are read from this table (bench/RESULTS.md 42j: why both figures)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

_MODE = re.compile(r"^[su]\d*$")


def split_label(label: str) -> tuple[str, str]:
    """``(arm tag, load)``: the load is the last four dash-separated numbers (FLOOD_IN, FLOOD_OUT,
    QUIET_IN, QUIET_OUT) and, when present, the flood's mode (s3, u1, ...)."""
    parts = label.split("-")
    n = 5 if parts and _MODE.match(parts[-1]) else 4
    if len(parts) <= n:
        raise ValueError(f"{label!r} is not ARM-FLOOD_IN-FLOOD_OUT-QUIET_IN-QUIET_OUT[-MODE]")
    return "-".join(parts[:-n]), "-".join(parts[-n:])


def _shown(value: float | None) -> str:
    return "-" if value is None or value != value else str(value)


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base != base or value != value or base == 0:
        return "-"
    return f"{value / base:.3f}x"


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown rows for ``{label: flood result}``; the first arm whose tag starts with ``bare``
    is each load's reference (none: the ratios are left out)."""
    by_load: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for label, result in results.items():
        tag, load = split_label(label)
        by_load.setdefault(load, []).append((tag, result))
    rows = ["| load | arm | quiet TTFT p50 / p99 / max ms (n, cut) | flood steady tok/s (x bare) "
            "| engine's steady work tok/s (x bare) |", "| --- | --- | --- | --- | --- |"]
    for load, arms in by_load.items():
        bare = next((r for tag, r in arms if tag.startswith("bare")), None)
        base_out = bare["flood"].get("steady_output_tok_s") if bare else None
        base_work = bare["flood"].get("steady_work_tok_s") if bare else None
        for tag, r in sorted(arms, key=lambda a: (not a[0].startswith("bare"), a[0])):
            q, f = r["quiet_under_flood_ttft_ms"], r["flood"]
            out, work = f.get("steady_output_tok_s"), f.get("steady_work_tok_s")
            rows.append(f"| {load} | {tag} | {_shown(q['p50'])} / {_shown(q.get('p99'))} / "
                        f"{_shown(q.get('max'))} ({q['n']}, {q.get('no_first_token', 0)}) | "
                        f"{_shown(out)} ({_ratio(out, base_out)}) | {_shown(work)} "
                        f"({_ratio(work, base_work)}) |")
    return "\n".join(rows) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m serve_bench.flood_table DIR  (a gpu_flood.sh call's flood/ folder)")
        return 2
    files = sorted(Path(argv[0]).glob("*.json"))
    results = {}
    for f in files:
        data = json.loads(f.read_text())
        if "flood" in data and "quiet_under_flood_ttft_ms" in data:
            results[f.stem] = data
    sys.stdout.write(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
