"""The bench client's load loop against a small local SSE server (aiohttp, no Ray): in-flight
cap, plan order, and runs bounded by time."""

from __future__ import annotations

import asyncio
import itertools
import json

from aiohttp import web

from serve_bench.client import Target, run_concurrency
from serve_bench.workload import Tenant, iter_plan, plan

from .local_http import serve_completions

TENANTS = [Tenant("default", None, 1.0)]


async def _serve(delay_s: float) -> tuple[web.AppRunner, str, dict]:
    state = {"in_flight": 0, "peak": 0, "prompts": [], "models": []}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state["prompts"].append(body["prompt"])
        state["models"].append(body["model"])
        state["in_flight"] += 1
        state["peak"] = max(state["peak"], state["in_flight"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Server-Timing": "queue;dur=1.5, dispatch;dur=2"})
        await resp.prepare(request)
        try:
            for _ in range(2):
                await asyncio.sleep(delay_s)
                chunk = {"choices": [{"index": 0, "text": "x"}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        finally:
            state["in_flight"] -= 1
        return resp

    runner, url = await serve_completions(completions)
    return runner, url, state


def test_lazy_plan_is_the_listed_plan():
    lazy = iter_plan(None, (4, 8), (2, 6), TENANTS, (10, 99), seed=3, rate=5.0)
    assert list(itertools.islice(lazy, 50)) == plan(50, (4, 8), (2, 6), TENANTS, (10, 99),
                                                     seed=3, rate=5.0)


def test_cap_and_order_of_a_counted_run():
    async def scenario() -> None:
        runner, url, state = await _serve(0.01)
        try:
            reqs = plan(12, (4, 4), (2, 2), TENANTS, (10, 99), seed=1)
            records, _ = await run_concurrency(Target(url, "m"), reqs, 3)
        finally:
            await runner.cleanup()
        assert len(records) == 12 and all(r.error is None and r.ttft for r in records)
        assert state["peak"] == 3
        assert records[0].server_timing == {"queue": 1.5, "dispatch": 2.0}
        assert state["prompts"][:3] == [r.prompt_token_ids for r in reqs[:3]]

    asyncio.run(scenario())


def test_duration_run_draws_only_the_requests_it_sends():
    """A run bounded by time planned a million prompts up front: the client spent minutes
    building them instead of sending load (seen on the GPU host's profile phase)."""
    async def scenario() -> None:
        runner, url, state = await _serve(0.02)
        drawn = 0

        def counted():
            nonlocal drawn
            for r in iter_plan(20_000, (4, 4), (2, 2), TENANTS, (10, 99)):
                drawn += 1
                yield r

        try:
            records, wall = await asyncio.wait_for(
                run_concurrency(Target(url, "m"), counted(), 4, duration_s=0.5), 10)
        finally:
            await runner.cleanup()
        assert records and all(r.error is None for r in records)
        assert 0.5 <= wall < 5
        # Each worker draws at most one request past the deadline and drops it.
        assert len(records) <= drawn <= len(records) + 4
        assert len(state["prompts"]) == len(records)

    asyncio.run(scenario())


def test_the_cli_imports_the_benchmark_package_only_for_its_subcommands(capsys):
    """serve_bench lives outside serve_app (bench/serve_bench/); `serve-app run`, `keys` and
    the rest must not need it, `serve-app bench` and the other tools find it."""
    import subprocess
    import sys

    import pytest

    from serve_app.cli import BENCH_COMMANDS, main

    code = ("import sys; from serve_app.cli import main; main(['keys', 'new', 't']); "
            "print(sorted(m for m in sys.modules if m.startswith('serve_bench')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"
    for command in BENCH_COMMANDS:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert f"usage: serve-app {command}" in capsys.readouterr().out


def test_each_tenant_sends_to_its_model():
    """A tenant with a model (``name:key:share:model``) names it in every request; one without
    names the run's model (issue 39: tenants each on their own LoRA adapter)."""
    async def scenario() -> None:
        runner, url, state = await _serve(0.001)
        tenants = [Tenant("a", None, 1.0, "tune-a"), Tenant("b", None, 1.0)]
        try:
            reqs = plan(20, (4, 4), (2, 2), tenants, (10, 99), seed=2)
            records, _ = await run_concurrency(Target(url, "base"), reqs, 1)
        finally:
            await runner.cleanup()
        assert all(r.error is None for r in records)
        assert state["models"] == ["tune-a" if r.tenant.name == "a" else "base" for r in reqs]
        assert set(state["models"]) == {"tune-a", "base"}
        assert [r.tenant for r in records] == [r.tenant.name for r in reqs]

    asyncio.run(scenario())
