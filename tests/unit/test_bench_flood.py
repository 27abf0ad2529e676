"""`serve-app flood` against a small local server (aiohttp, no Ray): the quiet tenant sent from
a process of its own, and the client's own share of its first-token time (the flood's load on
the client's event loop; the time outside the stack's Server-Timing account)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math

from aiohttp import web

from serve_bench import flood

from .local_http import serve_completions


KEYS: set[str] = set()  # the Authorization headers the server saw


async def _serve() -> tuple[web.AppRunner, str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        KEYS.add(request.headers.get("Authorization", ""))
        await asyncio.sleep(0.02)
        if not body.get("stream"):
            return web.json_response({"choices": [{"index": 0, "text": "x"}],
                                      "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Server-Timing": "queue;dur=1.5, dispatch;dur=4"})
        await resp.prepare(request)
        if request.headers.get("Authorization") == "Bearer failing":
            # bare vLLM's answer to a prompt it refuses once streaming: 200, then an error event
            error = {"error": {"message": "bad prompt", "type": "BadRequestError", "code": 400}}
            await resp.write(f"data: {json.dumps(error)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            return resp
        for _ in range(2):
            await resp.write(f"data: {json.dumps({'choices': [{'text': 'x'}]})}\n\n".encode())
            await asyncio.sleep(0.005)
        if body.get("stream_options", {}).get("include_usage"):
            usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
            await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return await serve_completions(completions)


def _args(url: str, quiet_process: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    flood.add_arguments(p)
    argv = ["--base-url", url, "--model", "m", "--flood-concurrency", "4", "--duration-s", "1.5",
            "--settle-s", "0.2", "--alone-s", "0.3", "--token-range", "10-20"]
    return p.parse_args(argv + (["--quiet-process"] if quiet_process else []))


def test_the_quiet_tenant_from_its_own_process_and_the_clients_share_of_its_ttft():
    async def scenario() -> tuple[dict, dict]:
        runner, url = await _serve()
        try:
            return (await flood.run(_args(url, quiet_process=True)),
                    await flood.run(_args(url, quiet_process=False)))
        finally:
            await runner.cleanup()

    apart, together = asyncio.run(scenario())
    for result, own in ((apart, True), (together, False)):
        quiet = result["quiet_under_flood_ttft_ms"]
        assert quiet["n"] >= 3 and quiet["errors"] == {} and result["flood"]["completed"] > 0
        ttfts = [r["ttft_ms"] for r in quiet["requests"] if r["ttft_ms"] is not None]
        assert quiet["max"] == max(ttfts) and quiet["p50"] <= quiet["p90"] <= quiet["p99"]
        assert quiet["server_timing_p50_ms"] == {"queue": 1.5, "dispatch": 4.0}
        client = result["client"]
        assert client["quiet_process"] is own
        assert client["flood_loop_lag_ms"]["p50"] is not None
        # TTFT less the stack's 5.5 ms: what the server's sleep and the client added.
        request = quiet["requests"][0]
        assert request["outside_stack_ms"] == round(request["ttft_ms"] - 5.5, 1)
        assert client["quiet_outside_stack_ms"]["max"] >= client["quiet_outside_stack_ms"]["p50"]


def test_a_streamed_flood_from_several_tenants():
    """Issue 42's H200 shapes: the flood streamed, its concurrency split over three keys."""
    async def scenario() -> dict:
        runner, url = await _serve()
        try:
            args = _args(url, quiet_process=False)
            args.flood_key, args.flood_stream = ["k1", "k2", "k3"], True
            return await flood.run(args)
        finally:
            await runner.cleanup()

    KEYS.clear()
    result = asyncio.run(scenario())
    done = result["flood"]["completed"]
    assert done > 0 and result["flood"]["output_tok_s"] == round(3 * done / 1.5, 1)
    # the completions after the 0.2 s settle, over the 1.3 s left
    assert 0 < result["flood"]["steady_output_tok_s"] <= round(3 * done / 1.3, 1)
    # the same completions with their prompts, and the quiet requests sent in the window
    assert result["flood"]["steady_work_tok_s"] > result["flood"]["steady_output_tok_s"]
    assert {"Bearer k1", "Bearer k2", "Bearer k3"} <= KEYS
    assert "flood_key" not in result["config"]  # keys stay out of the results


def test_a_stream_that_fails_after_its_200_is_an_error_regression_counted_as_completed():
    """A flood stream whose server answered 200 and then an error event (bare vLLM with token ids
    outside the vocabulary) was counted as a completed request of 0 tokens: a CPU dry run of
    bench/gpu_flood.sh read 14,247 completions and 0 errors where nothing was served."""
    async def scenario(key: str) -> dict:
        runner, url = await _serve()
        try:
            args = _args(url, quiet_process=False)
            args.flood_key, args.flood_stream = [key], True
            return await flood.run(args)
        finally:
            await runner.cleanup()

    failing = asyncio.run(scenario("failing"))["flood"]
    assert failing["completed"] == 0 and failing["output_tok_s"] == 0
    assert failing["errors"].get("stream error event", 0) > 0, failing
    served = asyncio.run(scenario("k1"))["flood"]
    assert served["completed"] > 0 and served["errors"] == {}, served


def test_a_quiet_stream_that_fails_after_its_200_has_no_first_token():
    """The quiet tenant's stream that answered 200 and then an error event took the error's
    arrival for its first token."""
    async def scenario() -> dict:
        runner, url = await _serve()
        try:
            args = _args(url, quiet_process=False)
            args.quiet_key = "failing"
            return await flood.run(args)
        finally:
            await runner.cleanup()

    quiet = asyncio.run(scenario())["quiet_under_flood_ttft_ms"]
    assert quiet["n"] == 0 and quiet["errors"].get("stream error event", 0) > 0, quiet


def test_the_quiet_tenant_arrives_at_any_point_of_the_step_regression_phase_locked():
    """A fixed pause after each quiet request, whose end comes with an engine step, sent every
    next one at the same point of a later step: on the H100 each waited almost a whole step for
    the engine's intake (bench/RESULTS.md 42h). Against a server that answers only on its
    40 ms step boundaries, the requests' arrival points in the step must spread over it."""
    step_s = 0.04
    phases: list[float] = []

    async def next_step() -> None:
        now = asyncio.get_running_loop().time()
        await asyncio.sleep(step_s - now % step_s)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):  # the flood, here unstreamed
            await next_step()
            return web.json_response({"choices": [{"index": 0, "text": "x"}],
                                      "usage": {"prompt_tokens": 4, "completion_tokens": 1}})
        phases.append(asyncio.get_running_loop().time() % step_s / step_s)
        await next_step()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(2):
            await resp.write(f"data: {json.dumps({'choices': [{'text': 'x'}]})}\n\n".encode())
            await next_step()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def scenario() -> None:
        runner, url = await serve_completions(completions)
        try:
            args = _args(url, quiet_process=False)
            args.flood_concurrency, args.duration_s, args.quiet_think_s = 1, 3.0, 0.05
            await flood.run(args)
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    quarters = {int(p * 4) for p in phases}
    assert len(phases) >= 20, phases
    assert len(quarters) == 4, sorted(round(p, 2) for p in phases)


def test_the_steady_rate_ignores_how_long_each_request_takes_regression_whole_run_figure():
    """Two engines of the same throughput (10 requests a second of 128 tokens), one holding
    each request 8 s, the other 6 s: over a 30 s run that starts them all at once the whole
    run's figure gave the second 1.09x (it completes its first requests 2 s sooner, 42i);
    counted once both are full (from 10 s), they are equal."""
    def completions(latency_s: float) -> list[tuple[float, int]]:
        return [(latency_s + k / 10, 128) for k in range(int((30 - latency_s) * 10) + 1)]

    slow, fast = completions(8.0), completions(6.0)
    whole = [sum(n for _, n in done) / 30 for done in (slow, fast)]
    assert whole[1] / whole[0] > 1.08
    steady = [flood.steady_output_tok_s(done, 10.0, 30.0) for done in (slow, fast)]
    assert abs(steady[1] / steady[0] - 1) < 0.01, steady
    assert abs(steady[0] - 1280) < 10
    assert math.isnan(flood.steady_output_tok_s(slow, 30.0, 30.0))  # no window


def test_the_engine_work_counts_the_quiet_tenants_tokens_regression_flood_share_taken_as_loss():
    """42j's H200 call: bare vLLM left the quiet tenant waiting and its flood had the whole
    engine (15.96 requests a second of 2,048 + 128 tokens); the stack served the quiet tenant
    28 requests of 1,024 + 16 tokens in the 25 s window and its flood completed 15.48 a second.
    The flood's rate is 0.970x, the engine's work 1.003x: the flood lost the quiet tenant's
    share, not throughput. An arm that loses throughput as well still shows it."""
    def completions(per_s: float) -> list[tuple[float, int]]:
        return [(15 + k / per_s, 128) for k in range(int(25 * per_s))]

    bare, stack = completions(15.96), completions(15.48)
    out = [flood.steady_output_tok_s(done, 15.0, 40.0) for done in (bare, stack)]
    assert out[1] / out[0] < 0.975, out
    work_bare = flood.steady_work_tok_s(bare, 2048, 0, 1040, 15.0, 40.0)
    work_stack = flood.steady_work_tok_s(stack, 2048, 28, 1040, 15.0, 40.0)
    assert abs(work_stack / work_bare - 1) < 0.01, (work_stack, work_bare)
    slower = flood.steady_work_tok_s(completions(14.9), 2048, 28, 1040, 15.0, 40.0)
    assert slower / work_bare < 0.975  # an engine that lost throughput still shows it
    assert math.isnan(flood.steady_work_tok_s(bare, 2048, 0, 1040, 40.0, 40.0))
