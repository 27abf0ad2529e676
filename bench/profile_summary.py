"""Summarize a py-spy profile recorded with ``--format raw`` (collapsed stacks, one
``frame;frame;... count`` line per stack) as a markdown table: where the process spent its
samples, by the frame on top (self) and by every frame on the stack (inclusive).

usage: python bench/profile_summary.py PROFILE.txt [--top 25] [--title TITLE]
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def summarize(text: str, top: int) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return total, own.most_common(top), inclusive.most_common(top)


def markdown(path: Path, top: int, title: str | None) -> str:
    total, own, inclusive = summarize(path.read_text(errors="replace"), top)
    lines = [f"### {title or path.name}: {total} samples", "",
             "| self % | frame |", "| --- | --- |"]
    lines += [f"| {n / max(total, 1) * 100:.1f} | `{f[:140]}` |" for f, n in own]
    lines += ["", "| inclusive % | frame |", "| --- | --- |"]
    lines += [f"| {n / max(total, 1) * 100:.1f} | `{f[:140]}` |" for f, n in inclusive]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--title", default=None)
    a = parser.parse_args()
    print(markdown(a.profile, a.top, a.title))
