"""Where the CPU goes while a command runs: every process's (and its busiest threads') CPU time
over the command's run, as cores kept busy, labelled by role (router replica, LLMServer replica,
vLLM engine core, bare vLLM API server, HAProxy, the load client, Ray's own processes).

A thread near 1.00 core is saturated: it is the stage that merges chunks or caps throughput.
Works without ptrace (the GPU host refused py-spy); reads /proc through psutil only.

usage: python bench/proc_cpu.py --out FILE.md [--title TITLE] [--threads 3] -- COMMAND [ARGS...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import psutil

# (role, substring of the command line), first match wins.
ROLES = (
    ("router replica", ":Router"),
    ("LLMServer replica", ":LLMServer"),
    ("vLLM engine core", "EngineCore"),
    ("vLLM worker", "VLLM::Worker"),
    ("bare vLLM API server", "vllm serve"),
    ("bare vLLM API server", "vllm.entrypoints"),
    ("load client", "serve_app.cli bench"),
    ("HAProxy", "haproxy"),
    ("Serve controller", "ServeController"),
    ("Serve proxy", "ProxyActor"),
)

Key = tuple[int, float]  # pid, create time: a pid reused during the run is another process


def _role(cmdline: str) -> str:
    for role, needle in ROLES:
        if needle in cmdline:
            return role
    return "other"


def snapshot() -> dict[Key, dict]:
    """CPU seconds of every process and of each of its threads, now."""
    procs: dict[Key, dict] = {}
    for p in psutil.process_iter(["pid", "create_time", "cmdline", "name", "cpu_times"]):
        try:
            t = p.info["cpu_times"]
            if t is None:
                continue
            threads = {th.id: th.user_time + th.system_time for th in p.threads()}
        except (psutil.Error, OSError):
            continue
        cmdline = " ".join(p.info["cmdline"] or [p.info["name"] or "?"])
        procs[(p.info["pid"], p.info["create_time"])] = {
            "cpu": t.user + t.system, "threads": threads, "cmdline": cmdline,
            "name": p.info["name"] or "?"}
    return procs


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def busy(before: dict[Key, dict], after: dict[Key, dict], wall_s: float,
         threads: int) -> list[dict]:
    """Per process alive at the end: cores kept busy over the window, busiest threads first."""
    rows = []
    for key, now in after.items():
        then = before.get(key, {"cpu": 0.0, "threads": {}})  # started during the run
        cores = (now["cpu"] - then["cpu"]) / wall_s
        if cores < 0.02:
            continue
        per_thread = sorted(((now["threads"][tid] - then["threads"].get(tid, 0.0)) / wall_s,
                             _thread_name(key[0], tid)) for tid in now["threads"])[::-1]
        rows.append({"pid": key[0], "role": _role(now["cmdline"]), "cores": cores,
                     "name": " ".join(now["cmdline"].split())[:70], "threads": per_thread[:threads]})
    return sorted(rows, key=lambda r: -r["cores"])


def markdown(rows: list[dict], wall_s: float, title: str) -> str:
    lines = [f"### {title} ({wall_s:.1f} s)", "",
             "| role | pid | cores busy | busiest threads (cores) | command |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        th = ", ".join(f"{name} {c:.2f}" for c, name in r["threads"])
        lines.append(f"| {r['role']} | {r['pid']} | {r['cores']:.2f} | {th} | `{r['name']}` |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="CPU while the command ran")
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    a = parser.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        parser.error("give the command to measure after --")
    before, t0 = snapshot(), time.monotonic()
    rc = subprocess.call(command)
    wall = time.monotonic() - t0
    text = markdown(busy(before, snapshot(), wall, a.threads), wall, a.title)
    a.out.write_text(text)
    print(text)
    sys.exit(rc)


if __name__ == "__main__":
    main()
