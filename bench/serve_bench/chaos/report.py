"""A scenario's verdict and the run's report.

A :class:`Scenario` carries its figures (name: measured value) and its bounds (name: the bound
in words, keyed like the figure it applies to, or by a name of its own when it spans several);
``passed`` is decided by the scenario itself. :func:`write_report` writes ``chaos.json`` (the
command and every scenario as a dict) and ``chaos.md`` (one table per scenario: figure, value,
bound, then bounds without a figure in parentheses) under ``out`` and returns the markdown.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Scenario:
    name: str
    passed: bool
    figures: dict[str, Any]
    bounds: dict[str, str]
    notes: list[str] = field(default_factory=list)


def _markdown(scenarios: list[Scenario], command: str) -> str:
    lines = ["# Chaos run", "", f"`{command}`", ""]
    for s in scenarios:
        lines += [f"## {s.name}: {'PASS' if s.passed else 'FAIL'}", "",
                  "| figure | value | bound |", "| --- | --- | --- |"]
        for k, v in s.figures.items():
            lines.append(f"| {k} | {v} | {s.bounds.get(k, '')} |")
        for k, v in s.bounds.items():
            if k not in s.figures:
                lines.append(f"| ({k}) | | {v} |")
        lines.append("")
    return "\n".join(lines)


def write_report(out: Path, scenarios: list[Scenario], command: str) -> str:
    """Writes ``chaos.json`` and ``chaos.md`` under ``out`` (created if missing); returns the
    markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps({"command": command, "scenarios": [
        asdict(s) for s in scenarios]}, indent=2))
    (out / "chaos.md").write_text(_markdown(scenarios, command))
    return _markdown(scenarios, command)
