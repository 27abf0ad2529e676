"""A flood beside a quiet tenant: does the quiet one still get the GPU?

One tenant keeps ``flood_concurrency`` non-streaming completions in flight (``flood_in`` prompt
tokens, ``flood_out`` output tokens, ``ignore_eos``) for ``duration_s``; another sends one
streamed request at a time (``quiet_in`` / ``quiet_out``) and times its first token. Meanwhile
the engines' running/waiting counts are sampled from a Prometheus text endpoint (vLLM's own
``/metrics`` for bare vLLM, Ray's metrics agents for the stack). Works against any OpenAI
endpoint; keys are optional (bare vLLM has none).

usage: serve-app flood --base-url URL --model M [--flood-key K ... --quiet-key K] [--flood-stream]
    [--quiet-process] [--metrics-url U ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from serve_app.engine.timing import PHASES, parse_server_timing

# The quiet tenant's mean pause between its requests (``--quiet-think-s``).
QUIET_THINK_S = 0.1

_GAUGE = re.compile(r"^(?:ray_)?vllm[:_]num_requests_(running|waiting)(?:\{[^}]*\})? ([0-9.e+-]+)",
                    re.M)
# The stack's router: requests it holds queued and its admission capacity (absent on bare vLLM).
_ROUTER = re.compile(r"^ray_serve_app_(router_queued_requests|admission_capacity)"
                     r"(?:\{[^}]*\})? ([0-9.e+-]+)", re.M)


def _prompt(n_tokens: int, rng: random.Random, ids: tuple[int, int]) -> list[int]:
    # Token ids, so every arm gets exactly n prompt tokens whatever the tokenizer.
    return [rng.randrange(*ids) for _ in range(n_tokens)]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _completed(acc: dict[str, Any], tokens: int) -> None:
    acc["ok"] += 1
    acc["tokens"] += tokens
    acc["done"].append((time.monotonic(), tokens))


def steady_output_tok_s(done: list[tuple[float, int]], since: float, until: float) -> float:
    """Output tokens a second of the requests completed in ``since .. until`` (monotonic).

    Why beside the whole run's figure: every flood request starts at once, so the run's first
    seconds complete nothing, and the requests still running at its end are not counted. How
    much that takes off grows with how many requests the engine runs at once and how long
    each takes, so an arm that runs fewer of them, each sooner done, gained on the whole run's
    figure without processing more (bench/RESULTS.md 42i). Once the engine is full, completions
    come at its throughput whatever it holds in flight."""
    if until <= since:
        return float("nan")
    return round(sum(n for t, n in done if since <= t <= until) / (until - since), 1)


def steady_work_tok_s(flood_done: list[tuple[float, int]], flood_in: int, quiet_served: int,
                      quiet_tokens: int, since: float, until: float) -> float:
    """Prompt and output tokens a second the engine served in ``since .. until``: the flood's
    completions there (``flood_in`` prompt tokens each, plus their output) and the quiet
    tenant's ``quiet_served`` requests sent there (``quiet_tokens`` each, prompt + output).

    Why beside the flood's own rate: bare vLLM leaves the quiet tenant waiting behind the
    flood, so its flood has the whole engine; an arm that serves the quiet tenant gives it
    its tokens out of the same engine, and its flood's rate drops by about the quiet tenant's
    share (bench/RESULTS.md 42j: 3.0% of the flood on an H200 for 3.3% of the engine's work
    to the quiet tenant). This figure says whether the arm lost engine throughput."""
    if until <= since:
        return float("nan")
    flood = sum(flood_in + n for t, n in flood_done if since <= t <= until)
    return round((flood + quiet_served * quiet_tokens) / (until - since), 1)


async def _flood_worker(session: aiohttp.ClientSession, url: str, model: str, key: str | None,
                        n_in: int, n_out: int, stop_at: float, rng: random.Random,
                        acc: dict[str, Any], ids: tuple[int, int], stream: bool = False) -> None:
    """Keep one flood request in flight until ``stop_at``; the one still running then is cut
    off (the client goes away), so the run ends on time and counts only what finished.
    ``stream``: streamed requests, their tokens read from the final usage chunk. Each
    completion's time and tokens go to ``acc["done"]`` (for the steady-state rate)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def one() -> None:
        body: dict[str, Any] = {"model": model, "prompt": _prompt(n_in, rng, ids),
                                "max_tokens": n_out, "ignore_eos": True, "temperature": 0.0}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        async with session.post(url, json=body, headers=headers) as r:
            if r.status == 200 and stream:
                usage, failed = None, False
                async for line in r.content:
                    if line.startswith(b"data: {") and (b'"usage"' in line or b'"error"' in line):
                        event = json.loads(line[6:])
                        usage = event.get("usage") or usage
                        failed = failed or "error" in event
                if failed or usage is None:
                    # A stream that failed after its 200 (an error event; bare vLLM answers an
                    # invalid prompt so) or ended without its usage chunk finished nothing: an
                    # error, never a completion of 0 tokens.
                    what = "stream error event" if failed else "stream without usage"
                    acc["errors"][what] = acc["errors"].get(what, 0) + 1
                    return
                _completed(acc, usage.get("completion_tokens", 0))
                return
            data = await r.json(content_type=None)
            if r.status == 200:
                _completed(acc, data["usage"]["completion_tokens"])
            else:
                acc["errors"][str(r.status)] = acc["errors"].get(str(r.status), 0) + 1
                await asyncio.sleep(0.05)

    while (left := stop_at - time.monotonic()) > 0:
        try:
            await asyncio.wait_for(one(), left)
        except asyncio.TimeoutError:
            acc["cut"] += 1
            return
        except aiohttp.ClientError as err:
            acc["errors"][type(err).__name__] = acc["errors"].get(type(err).__name__, 0) + 1
            await asyncio.sleep(0.05)


async def _quiet_worker(session: aiohttp.ClientSession, url: str, model: str, key: str | None,
                        n_in: int, n_out: int, start_at: float, stop_at: float,
                        rng: random.Random, ttfts: list[float], errors: dict[str, int],
                        ids: tuple[int, int], log: list[dict[str, Any]] | None = None,
                        think_s: float = QUIET_THINK_S) -> None:
    """One streamed request at a time until ``stop_at``; first-token times go to ``ttfts``,
    and with ``log`` each request's send time (from ``start_at``) and TTFT (None: cut at the
    end of the run before its first token) is recorded too.

    Between requests the worker thinks for a time drawn from an exponential distribution of
    mean ``think_s``, so its arrivals fall at any point of the engine's step, as independent
    users' do. Why not a fixed pause: a request ends with an engine step, so a fixed pause
    after it lands every next request at the same point of a later step; on the H100 that was
    just after a step began (bench/RESULTS.md 42h), and each request waited almost a whole step
    for the engine's intake, the worst case every time instead of its share of the time."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    while time.monotonic() < stop_at:
        body = {"model": model, "prompt": _prompt(n_in, rng, ids), "max_tokens": n_out,
                "ignore_eos": True, "temperature": 0.0, "stream": True}
        t0 = time.monotonic()
        first: list[float] = []
        chunks: list[float] = []  # arrival of every data event, for the stream's step time
        phases: dict[str, float] = {}

        async def one() -> None:
            async with session.post(url, json=body, headers=headers) as r:
                if r.status != 200:
                    errors[str(r.status)] = errors.get(str(r.status), 0) + 1
                    await r.read()
                    await asyncio.sleep(0.1)
                    return
                phases.update(parse_server_timing(r.headers.get("server-timing")))
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        if b'"error"' in line and "error" in json.loads(line[6:]):
                            # failed after its 200: no first token, whatever came before
                            errors["stream error event"] = errors.get("stream error event",
                                                                      0) + 1
                            first.clear()
                            return
                        chunks.append(time.monotonic())
                        if not first:
                            first.append(chunks[0] - t0)

        try:
            await asyncio.wait_for(one(), max(0.001, stop_at - time.monotonic()))
        except asyncio.TimeoutError:
            pass  # cut off at the end of the run; a first token already seen still counts
        except aiohttp.ClientError as err:
            errors[type(err).__name__] = errors.get(type(err).__name__, 0) + 1
        ttfts.extend(first)
        if log is not None:
            gaps = [b - a for a, b in zip(chunks, chunks[1:])]
            inside = phases.get("queue", 0.0) + phases.get("dispatch", 0.0)
            log.append({"sent_s": round(t0 - start_at, 3),
                        "ttft_ms": round(first[0] * 1000, 1) if first else None,
                        # the client's TTFT less the stack's own account (router queue and
                        # dispatch): the client's lag, the network and HAProxy
                        "outside_stack_ms": round(first[0] * 1000 - inside, 1)
                        if first and phases else None,
                        # the engine's step as this stream saw it (chunks may merge steps)
                        "itl_p50_ms": round(statistics.median(gaps) * 1000, 1) if gaps
                        else None,
                        "server_timing_ms": phases})
        await asyncio.sleep(rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0)


def _phase_medians(log: list[dict[str, Any]]) -> dict[str, float]:
    """Per Server-Timing phase, its median over the requests that reported it."""
    by_phase: dict[str, list[float]] = {}
    for r in log:
        for name, ms in r.get("server_timing_ms", {}).items():
            by_phase.setdefault(name, []).append(ms)
    return {name: round(statistics.median(v), 1)
            for name, v in sorted(by_phase.items(), key=lambda kv: _phase_order(kv[0]))}


def _phase_order(name: str) -> int:
    return PHASES.index(name) if name in PHASES else len(PHASES)


async def _sample_engines(session: aiohttp.ClientSession, urls: list[str], stop_at: float,
                          samples: list[dict[str, float]]) -> None:
    while time.monotonic() < stop_at:
        totals = {"t": time.monotonic(), "running": 0.0, "waiting": 0.0,
                  "router_queued_requests": 0.0, "admission_capacity": 0.0}
        for url in urls:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    text = await r.text()
                for kind, value in _GAUGE.findall(text) + _ROUTER.findall(text):
                    totals[kind] += float(value)
            except Exception:
                pass
        samples.append(totals)
        await asyncio.sleep(1.0)


async def _loop_lag(stop_at: float, lags: list[float], every_s: float = 0.01) -> None:
    """How late this client's event loop wakes a task (the flood's own load on the client):
    a quiet request sent from the same loop waits that long before it is even sent."""
    while time.monotonic() < stop_at:
        t = time.monotonic()
        await asyncio.sleep(every_s)
        lags.append(time.monotonic() - t - every_s)


def _quiet_process(args: argparse.Namespace, url: str, start_at: float, stop_at: float,
                   seed: float, out: Any) -> None:
    """The quiet tenant in a process of its own (``--quiet-process``): its requests are sent
    and read by a loop the flood does not load. Puts (ttfts, errors, log) on ``out``."""
    async def main() -> tuple[list[float], dict[str, int], list[dict[str, Any]]]:
        ttfts: list[float] = []
        errors: dict[str, int] = {}
        log: list[dict[str, Any]] = []
        lo, hi = (int(x) for x in args.token_range.split("-"))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=args.duration_s + 600)) as session:
            await _quiet_worker(session, url, args.model, args.quiet_key, args.quiet_in,
                                args.quiet_out, start_at, stop_at, random.Random(seed), ttfts,
                                errors, (lo, hi), log, args.quiet_think_s)
        return ttfts, errors, log

    out.put(asyncio.run(main()))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    url = args.base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.token_range.split("-"))
    ids = (lo, hi)
    timeout = aiohttp.ClientTimeout(total=args.duration_s + 600)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()
                                             if not k.endswith("key") and k != "func"}}
        # Quiet alone first: the reference TTFT.
        alone: list[float] = []
        alone_err: dict[str, int] = {}
        t0 = time.monotonic()
        await _quiet_worker(session, url, args.model, args.quiet_key, args.quiet_in,
                            args.quiet_out, t0, t0 + args.alone_s, rng, alone, alone_err, ids,
                            think_s=args.quiet_think_s)
        # Then the flood, with the quiet tenant beside it once the flood has built up.
        acc: dict[str, Any] = {"ok": 0, "tokens": 0, "errors": {}, "cut": 0, "done": []}
        quiet: list[float] = []
        quiet_err: dict[str, int] = {}
        quiet_log: list[dict[str, Any]] = []
        samples: list[dict[str, float]] = []
        start = time.monotonic()
        stop_at = start + args.duration_s
        keys = args.flood_key or [None]  # several: the flood's workers take them in turn
        tasks = [asyncio.ensure_future(_flood_worker(
            session, url, args.model, keys[i % len(keys)], args.flood_in, args.flood_out,
            stop_at, random.Random(rng.random()), acc, ids, args.flood_stream))
            for i in range(args.flood_concurrency)]
        lags: list[float] = []
        tasks.append(asyncio.ensure_future(_loop_lag(stop_at, lags)))
        proc = None
        if args.quiet_process:
            import multiprocessing

            ctx = multiprocessing.get_context("spawn")
            box = ctx.Queue()
            proc = ctx.Process(target=_quiet_process, args=(
                args, url, start + args.settle_s, stop_at, rng.random(), box), daemon=True)
            proc.start()
        else:
            tasks.append(asyncio.ensure_future(_quiet_worker(
                session, url, args.model, args.quiet_key, args.quiet_in, args.quiet_out,
                start + args.settle_s, stop_at, rng, quiet, quiet_err, ids, quiet_log,
                args.quiet_think_s)))
        if args.metrics_url:
            tasks.append(asyncio.ensure_future(_sample_engines(session, args.metrics_url,
                                                               stop_at, samples)))
        await asyncio.gather(*tasks)
        if proc is not None:
            got_ttfts, got_err, got_log = await asyncio.to_thread(box.get, True, 120)
            quiet.extend(got_ttfts)
            quiet_err.update(got_err)
            quiet_log.extend(got_log)
            proc.join(30)
        elapsed = args.duration_s
    ms = lambda xs: [round(x * 1000, 1) for x in xs]  # noqa: E731
    during = [s for s in samples if s["t"] >= start + args.settle_s]
    result.update({
        "quiet_alone_ttft_ms": {"n": len(alone), "p50": _pct(ms(alone), 0.5),
                                "p90": _pct(ms(alone), 0.9), "errors": alone_err},
        "quiet_under_flood_ttft_ms": {"n": len(quiet), "p50": _pct(ms(quiet), 0.5),
                                      "p90": _pct(ms(quiet), 0.9),
                                      # issue 42's bar is on the p99; with ~20 requests
                                      # a call, that is their max
                                      "p99": _pct(ms(quiet), 0.99),
                                      "max": max(ms(quiet), default=None),
                                      "mean": round(statistics.fmean(ms(quiet)), 1) if quiet
                                      else None, "errors": quiet_err,
                                      "no_first_token": sum(r["ttft_ms"] is None
                                                            for r in quiet_log),
                                      "itl_p50_ms": _pct([r["itl_p50_ms"] for r in quiet_log
                                                          if r["itl_p50_ms"] is not None], 0.5),
                                      # median of each phase the stack reported per request
                                      "server_timing_p50_ms": _phase_medians(quiet_log),
                                      "requests": quiet_log},
        "client": {"quiet_process": bool(args.quiet_process),
                   "flood_loop_lag_ms": {"p50": _pct(ms(lags), 0.5), "p99": _pct(ms(lags), 0.99),
                                         "max": max(ms(lags), default=None)},
                   "quiet_outside_stack_ms": {
                       "p50": _pct([r["outside_stack_ms"] for r in quiet_log
                                    if r["outside_stack_ms"] is not None], 0.5),
                       "max": max((r["outside_stack_ms"] for r in quiet_log
                                   if r["outside_stack_ms"] is not None), default=None)}},
        "flood": {"completed": acc["ok"], "output_tok_s": round(acc["tokens"] / elapsed, 1),
                  # from the quiet tenant's start (settle_s) to the end: the engine full
                  "steady_output_tok_s": steady_output_tok_s(
                      acc["done"], start + args.settle_s, stop_at),
                  # the flood's and the quiet tenant's prompt + output tokens in the
                  # same window: what the engine served, whoever it served
                  "steady_work_tok_s": steady_work_tok_s(
                      acc["done"], args.flood_in,
                      sum(r["ttft_ms"] is not None for r in quiet_log),
                      args.quiet_in + args.quiet_out, start + args.settle_s, stop_at),
                  "cut_at_end": acc["cut"], "errors": acc["errors"]},
        "engines": {"samples": len(during),
                    "running_median": _pct([s["running"] for s in during], 0.5),
                    "waiting_median": _pct([s["waiting"] for s in during], 0.5),
                    "waiting_max": max((s["waiting"] for s in during), default=None),
                    "router_queued_median": _pct([s["router_queued_requests"] for s in during],
                                                 0.5),
                    "admission_capacity_median": _pct([s["admission_capacity"] for s in during],
                                                      0.5),
                    "timeline": [{k: round(v - start, 1) if k == "t" else v
                                  for k, v in smp.items()} for smp in samples]},
    })
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="endpoint, without /v1")
    p.add_argument("--model", required=True)
    p.add_argument("--flood-key", action="append", default=[],
                   help="API key of a flooding tenant (repeat it: several tenants flood, the "
                   "concurrency split evenly among them)")
    p.add_argument("--flood-stream", action="store_true",
                   help="the flood's requests streamed (their tokens from the usage chunk)")
    p.add_argument("--quiet-key", default=None, help="API key of the quiet tenant")
    p.add_argument("--flood-concurrency", type=int, default=768)
    p.add_argument("--flood-in", type=int, default=1024)
    p.add_argument("--flood-out", type=int, default=128)
    p.add_argument("--quiet-in", type=int, default=128)
    p.add_argument("--quiet-out", type=int, default=16)
    p.add_argument("--quiet-think-s", type=float, default=QUIET_THINK_S,
                   help="the quiet tenant's mean pause between requests (exponential; 0: none)")
    p.add_argument("--duration-s", type=float, default=60.0, help="length of the flood")
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="flood time before the quiet tenant's measured requests start")
    p.add_argument("--alone-s", type=float, default=5.0, help="quiet tenant alone, first")
    p.add_argument("--quiet-process", action="store_true",
                   help="send the quiet tenant's requests from a process of their own, so the "
                   "flood's load on this client's event loop does not delay them")
    p.add_argument("--metrics-url", action="append", default=[],
                   help="Prometheus text endpoint(s) with the engines' running/waiting gauges")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-range", default="10-250",
                   help="prompt token ids are drawn from LO-HI (inside every model's vocabulary)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.add_argument("--label", default="")


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    q, f, e = (result["quiet_under_flood_ttft_ms"], result["flood"], result["engines"])
    print(f"{args.label}: quiet TTFT p50 alone {result['quiet_alone_ttft_ms']['p50']} ms, under "
          f"flood {q['p50']} ms (p90 {q['p90']}, p99 {q['p99']}, max {q['max']}, n={q['n']}, "
          f"{q['no_first_token']} cut before "
          f"a first token; stream step ~{q['itl_p50_ms']} ms; stack phases "
          f"{q['server_timing_p50_ms'] or '-'}); flood {f['output_tok_s']} out "
          f"tok/s ({f['steady_output_tok_s']} after {args.settle_s:g} s; the engine's work with "
          f"the quiet tenant's {f['steady_work_tok_s']} tok/s), errors "
          f"{f['errors']} {q['errors']}; engines running~{e['running_median']} "
          f"waiting~{e['waiting_median']} (max {e['waiting_max']}); client: flood loop lag "
          f"{result['client']['flood_loop_lag_ms']}, quiet outside the stack "
          f"{result['client']['quiet_outside_stack_ms']}")
    return 0
