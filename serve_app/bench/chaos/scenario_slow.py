"""`serve-app chaos` (`make chaos`): faults and overload against a real local stack, with figures.

Starts the embedded default (tiny model, vLLM CPU engine) with two engine replicas of a small
batch and two tenants, through :func:`serve_app.launch.start_stack`, and runs:

1. **disconnect storm**: 200 requests (half streamed) abandoned by their clients 0.5 to 2.5 s
   after they were sent, while the engines are saturated; bound: within 5 s the engines run and
   hold nothing, their KV cache is back to idle, and the router holds nothing.
2. **replica kill**: one of the two engine replicas is killed under 50 streams; bound: only
   requests in flight on the victim fail, each with a terminal signal (an SSE error event, or a
   503 with Retry-After before any byte), none hangs or is cut silently, no engine process is
   orphaned, and the replacement serves again (its time is recorded).
3. **overload**: 5x the engines' capacity (closed-loop clients that honour Retry-After, as the
   ``openai`` client does) for a while; bound: the excess gets
   429/503 with Retry-After in under 100 ms at p99, no 500s, no replica restarts, and a probe's
   latency is back to its baseline within 30 s.
4. **slow readers**: 2 streams (n=16 choices of 2,000 tokens, ~5 MB of SSE) whose clients read
   one byte a second through a 2 KB receive window, on the router replica's own port (through
   HAProxy a few MB fit in its buffers and the kernel's, so the router never waits), beside
   another tenant's ordinary streams, after a control (the same requests read at full speed);
   bound: every slow stream is cut by the stall watch (``router.stream_stall_timeout_s``,
   ``--stall-s``) and closed without its end, the router and the engines hold nothing
   afterwards, and the other tenant's streams all complete, with ITL p50 within 2x of its
   own alone and TTFT p50 no worse than beside the control plus the stall limit and 1 s.

Writes ``chaos.json`` and ``chaos.md`` under ``--out`` and exits 1 if a bound is missed. The
figures go to bench/RESULTS.md with the command that produced them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp

from serve_app.bench.slow_client import SLOW_BODY, open_slow_stream
from serve_app.bench.stats import percentile
from serve_app.config import APP_NAME, DEFAULT_CONFIG, AppConfig, TenantSettings, load_config

BATCH = 4  # max_num_seqs per engine replica: a small batch saturates on the CPU
HEADROOM = 2
QUEUE = 24  # router.max_queued_per_band
REPLICAS = 2
TENANTS = {"chaos-a": "normal", "chaos-b": "high"}
REFUSED = (429, 503)
STALL_S = 5.0  # router.stream_stall_timeout_s of the chaos stack (--stall-s)


@dataclass
class Result:
    """One request as a client saw it. ``outcome``: ok | refused (429/503 before any byte) |
    error_event (an SSE error event ended the stream) | error (another status) | cut (the
    connection ended without [DONE] or an error) | hung (no end within the client's timeout) |
    abandoned (the client left on purpose)."""

    status: int | None = None
    outcome: str = ""
    latency_s: float = 0.0
    retry_after: str | None = None
    started_s: float = 0.0  # since the scenario's load began (overload)


@dataclass
class Scenario:
    name: str
    passed: bool
    figures: dict[str, Any]
    bounds: dict[str, str]
    notes: list[str] = field(default_factory=list)


def _session() -> aiohttp.ClientSession:
    """A client session without aiohttp's default cap of 100 connections (scenarios open more)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


class Target:
    """The running stack: its URL, keys, and white-box probes through Serve handles."""

    def __init__(self, base: str, keys: dict[str, str], model: str) -> None:
        from ray import serve

        from serve_app.app import ROUTER_DEPLOYMENT, llm_server_name

        self.base, self.keys, self.model = base, keys, model
        self.server = serve.get_deployment_handle(llm_server_name(model), app_name=APP_NAME)
        self.router = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=APP_NAME)

    def engines(self) -> list[dict[str, Any]]:
        """Every live engine replica's load (running, waiting, KV-cache use, ...)."""
        from serve_app.engine.protocol import EngineLoad

        response = self.server.broadcast("engine_load")
        return [asdict(r) for r in response.results(timeout_s=30,
                                                     return_exceptions=True)
                if isinstance(r, EngineLoad)]

    def admission(self) -> dict[str, Any]:
        return self.router.admission_state.remote().result(timeout_s=30)[self.model]

    def replica_actors(self) -> list[str]:
        """Names of the model's live LLMServer replica actors."""
        import ray

        from serve_app.app import llm_server_name

        mark = f"#{llm_server_name(self.model)}#"
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if mark in a["name"])

    def kill_replica(self, name: str) -> None:
        import ray

        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


async def request(session: aiohttp.ClientSession, t: Target, tenant: str, *, stream: bool,
                  max_tokens: int, timeout_s: float = 120.0) -> Result:
    """One completion; classifies how it ended (never raises, except when cancelled)."""
    body = {"model": t.model, "prompt": "hello there", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}
    headers = {"Authorization": f"Bearer {t.keys[tenant]}"}
    res = Result()
    t0 = time.perf_counter()
    try:
        async with session.post(f"{t.base}/v1/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            res.status, res.retry_after = r.status, r.headers.get("Retry-After")
            if r.status != 200:
                await r.read()
                res.outcome = "refused" if r.status in REFUSED else "error"
            elif not stream:
                await r.json()
                res.outcome = "ok"
            else:
                res.outcome = "cut"
                async for raw in r.content:
                    line = raw.strip()
                    if line == b"data: [DONE]":
                        res.outcome = "ok" if res.outcome == "cut" else res.outcome
                        break
                    if line.startswith(b"data: ") and b'"error"' in line:
                        res.outcome = "error_event"
    except asyncio.TimeoutError:
        res.outcome = "hung"
    except aiohttp.ClientError:
        res.outcome = "cut"
    res.latency_s = time.perf_counter() - t0
    return res


def _wait(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.05) -> float | None:
    """Seconds until ``predicate()`` held, or None if it did not within ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(interval_s)
    return None


def _idle(t: Target, kv_idle: float) -> bool:
    engines, adm = t.engines(), t.admission()
    return (bool(engines) and all(e["running"] == 0 and e["waiting"] == 0
                                  and e["kv_cache_usage"] <= kv_idle + 0.005 for e in engines)
            and adm["in_flight"] == 0 and adm["queued"] == 0)


async def disconnect_storm(t: Target, n: int = 200, after_s: float = 0.5) -> Scenario:
    kv_idle = max(e["kv_cache_usage"] for e in await asyncio.to_thread(t.engines))
    peak = {"running": 0, "queued": 0}

    async def abandon(session: aiohttp.ClientSession, i: int) -> None:
        task = asyncio.create_task(request(session, t, list(TENANTS)[i % 2], stream=i % 2 == 0,
                                           max_tokens=1000))
        # A fifth leave at after_s, the others up to 2 s later: on a small machine nothing of a
        # 200-request burst is running yet at 0.5 s, and the storm must catch requests in every
        # state (queued, in prefill, streaming, generating a non-streamed answer).
        await asyncio.sleep(after_s + 0.5 * (i % 5))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def sample(until: asyncio.Event) -> None:
        while not until.is_set():
            engines, adm = await asyncio.to_thread(t.engines), await asyncio.to_thread(t.admission)
            peak["running"] = max(peak["running"], sum(e["running"] for e in engines))
            peak["queued"] = max(peak["queued"], adm["queued"])
            await asyncio.sleep(0.05)

    done = asyncio.Event()
    async with _session() as session:
        sampler = asyncio.create_task(sample(done))
        await asyncio.gather(*[abandon(session, i) for i in range(n)])
        done.set()
        await sampler
    left = time.monotonic()
    idle_after = await asyncio.to_thread(_wait, lambda: _idle(t, kv_idle), 30)
    figures = {"requests": n, "abandoned_after_s": f"{after_s:g}-{after_s + 2:g}",
               "engines_running_at_peak":
               peak["running"], "router_queued_at_peak": peak["queued"],
               "idle_after_s": None if idle_after is None else round(idle_after, 2),
               "measured_from": "the last client left", "kv_cache_idle": round(kv_idle, 4),
               "waited_s": round(time.monotonic() - left, 2)}
    passed = (idle_after is not None and idle_after <= 5.0 and peak["running"] > 0
              and peak["queued"] > 0)
    return Scenario("disconnect storm", passed, figures,
                    {"idle_after_s": "<= 5", "engines_running_at_peak": "> 0",
                     "router_queued_at_peak": "> 0 (requests left while queued too)"})


async def replica_kill(t: Target, streams: int = 50, kill_after_s: float = 3.0,
                       max_tokens: int = 300) -> Scenario:
    from serve_app.launch import find_leftovers

    before = await asyncio.to_thread(t.replica_actors)
    async with _session() as session:
        tasks = [asyncio.create_task(request(session, t, list(TENANTS)[i % 2], stream=True,
                                             max_tokens=max_tokens, timeout_s=300))
                 for i in range(streams)]
        await asyncio.sleep(kill_after_s)
        victim = before[0]
        in_flight_at_kill = await asyncio.to_thread(t.admission)
        await asyncio.to_thread(t.kill_replica, victim)
        killed_at = time.monotonic()
        results = await asyncio.gather(*tasks)
    outcomes = {k: sum(1 for r in results if r.outcome == k)
                for k in ("ok", "error_event", "refused", "error", "cut", "hung")}
    refused_without_retry = sum(1 for r in results if r.outcome == "refused"
                                and not r.retry_after)
    # Serve replaces the victim: time until the model has two engines that answer again.
    back = await asyncio.to_thread(
        _wait, lambda: len(t.replica_actors()) == REPLICAS and victim not in t.replica_actors()
        and len(t.engines()) == REPLICAS, 600, 0.5)
    replaced_s = None if back is None else round(time.monotonic() - killed_at, 1)
    probe = None
    if back is not None:
        async with _session() as session:
            probe = await request(session, t, "chaos-a", stream=True, max_tokens=8)
    # An engine core whose replica died must go with it (no GPU held by an orphan).
    await asyncio.to_thread(_wait, lambda: not find_leftovers(), 30, 0.5)
    orphans = [f"{p.what} ({p.pid})" for p in find_leftovers()]
    failed = outcomes["error_event"] + outcomes["refused"] + outcomes["error"]
    victim_bound = BATCH + 2 * HEADROOM  # what one replica runs and holds at once
    figures = {"streams": streams, "killed_after_s": kill_after_s,
               "router_in_flight_at_kill": in_flight_at_kill["in_flight"], **outcomes,
               "refused_without_retry_after": refused_without_retry,
               "replacement_serving_after_s": replaced_s,
               "probe_after_replacement": probe.outcome if probe else None,
               "orphaned_engine_processes": orphans}
    passed = (outcomes["hung"] == 0 and outcomes["cut"] == 0 and outcomes["error"] == 0
              and refused_without_retry == 0 and failed <= victim_bound and replaced_s is not None
              and probe is not None and probe.outcome == "ok" and not orphans)
    return Scenario("replica kill", passed, figures, {
        "hung + cut + error": "0", "failed (error events + 503s)": f"<= {victim_bound} (the "
        "victim's batch and queue)", "replacement": "serves again", "orphans": "none"})


async def overload(t: Target, factor: int = 5, duration_s: float = 60.0,
                   recovery_bound_s: float = 30.0) -> Scenario:
    capacity = REPLICAS * (BATCH + HEADROOM)
    clients = factor * capacity
    before = await asyncio.to_thread(t.replica_actors)
    async with _session() as session:
        baseline = [await request(session, t, "chaos-a", stream=False, max_tokens=16)
                    for _ in range(5)]
        base_p50 = percentile([r.latency_s for r in baseline], 50)
        results: list[Result] = []
        stop_at = time.monotonic() + duration_s

        async def client(i: int) -> None:
            # As the openai client does: a refused request is retried after its Retry-After.
            while time.monotonic() < stop_at:
                res = await request(session, t, "chaos-a", stream=i % 2 == 0, max_tokens=32)
                began = stop_at - duration_s
                res.started_s = round(time.monotonic() - began - res.latency_s, 3)
                results.append(res)
                if res.outcome == "refused" and res.retry_after:
                    await asyncio.sleep(min(float(res.retry_after), 5.0))

        await asyncio.gather(*[client(i) for i in range(clients)])
        ended = time.monotonic()
        recovered = None
        probes: list[float] = []
        while time.monotonic() - ended < recovery_bound_s + 30:
            probe = await request(session, t, "chaos-a", stream=False, max_tokens=16)
            probes.append(probe.latency_s)
            if probe.outcome == "ok" and probe.latency_s <= 1.5 * base_p50 + 0.05:
                recovered = time.monotonic() - ended
                break
            await asyncio.sleep(0.5)
    refused = [r for r in results if r.outcome == "refused"]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    server_errors = sum(1 for r in results if r.status is not None and r.status >= 500
                        and not (r.status == 503 and r.retry_after))
    restarts = sorted(set(before) ^ set(await asyncio.to_thread(t.replica_actors)))
    figures = {"clients": clients, "capacity_definition": f"{REPLICAS} replicas x (batch "
               f"{BATCH} + headroom {HEADROOM})", "duration_s": duration_s,
               "requests": len(results), "statuses": statuses,
               "served_ok": sum(1 for r in results if r.outcome == "ok"),
               "refused": len(refused),
               "refused_p50_ms": round(1000 * percentile([r.latency_s for r in refused], 50), 1),
               "refused_p99_ms": round(1000 * percentile([r.latency_s for r in refused], 99), 1),
               # The bound applies once the overload runs: the first second is the herd of all
               # clients connecting at the same instant (their figure stays in refused_p99_ms).
               "refused_p99_ms_after_1s": round(1000 * percentile(
                   [r.latency_s for r in refused if r.started_s >= 1.0], 99), 1),
               "refused_without_retry_after": sum(1 for r in refused if not r.retry_after),
               "server_errors": server_errors, "replica_changes": restarts,
               "other_failures": sum(1 for r in results if r.outcome in ("cut", "hung",
                                                                        "error_event", "error")),
               "probe_baseline_p50_ms": round(1000 * base_p50, 1),
               "recovered_after_s": None if recovered is None else round(recovered, 1),
               "probe_latencies_ms": [round(1000 * p, 1) for p in probes],
               "slowest_refusals": sorted(([round(r.started_s, 2), round(1000 * r.latency_s, 1)]
                                           for r in refused), key=lambda x: -x[1])[:20]}
    passed = (bool(refused) and figures["refused_p99_ms_after_1s"] < 100
              and figures["refused_without_retry_after"] == 0 and server_errors == 0
              and not restarts and figures["other_failures"] == 0
              and recovered is not None and recovered <= recovery_bound_s)
    return Scenario("overload", passed, figures, {
        "refused_p99_ms_after_1s": "< 100", "refused_without_retry_after": "0",
        "server_errors": "0",
        "replica_changes": "none", "recovered_after_s": f"<= {recovery_bound_s:g}"})


async def _slow_reader(t: Target, port: int, tenant: str, read: dict[socket.socket, bytes],
                       read_every_s: float = 1.0) -> None:
    """One stream whose client reads a byte every ``read_every_s`` through a small window, on
    the router replica's own ``port``, until cancelled; ``read`` keeps what it got."""
    sock = await open_slow_stream("127.0.0.1", port, {"model": t.model, **SLOW_BODY},
                                  t.keys[tenant])
    read[sock] = b""
    while True:
        await asyncio.sleep(read_every_s)
        try:
            read[sock] += sock.recv(1)
        except BlockingIOError:
            pass
        except OSError:
            return


async def _fast_reader(session: aiohttp.ClientSession, t: Target, tenant: str,
                       timeout_s: float) -> bool:
    """The slow readers' request read at full speed; True if it completed."""
    body = {"model": t.model, **SLOW_BODY}
    async with session.post(f"{t.base}/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {t.keys[tenant]}"},
                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        data = await r.read()
    return r.status == 200 and b"data: [DONE]" in data[-200:]


def _drain(sock: socket.socket) -> bytes:
    """Everything left to read on ``sock`` until the server closed it (a few MB at most)."""
    sock.setblocking(True)
    sock.settimeout(30)
    received = b""
    try:
        while chunk := sock.recv(1 << 20):
            received += chunk
    except OSError:
        pass
    finally:
        sock.close()
    return received


async def slow_readers(t: Target, readers: int = 2, stall_s: float = STALL_S,
                       bound_s: float = 600.0) -> Scenario:
    """Slow readers beside another tenant's streams, against a control: the same requests read
    at full speed. A 16-choice request weighs 16 admission places, more than the chaos stack's
    12, so the slow tenant's requests run one at a time (on one engine replica; the other
    tenant's requests get the other); what the slow readers may add is their hold until the
    stall limit cuts them."""
    from serve_app.bench.client import Target as BenchTarget
    from serve_app.bench.client import send_one
    from serve_app.bench.stats import RequestRecord
    from serve_app.bench.workload import PlannedRequest
    from serve_app.bench.workload import Tenant as BenchTenant
    from serve_app.launch import router_replica_port

    slow, other = list(TENANTS)
    port = await asyncio.to_thread(router_replica_port)
    kv_idle = max(e["kv_cache_usage"] for e in await asyncio.to_thread(t.engines))
    target = BenchTarget(t.base, t.model)
    tenant = BenchTenant(other, t.keys[other], 1.0)

    async def streams(session: aiohttp.ClientSession, until: asyncio.Event, n: int | None
                      ) -> list[RequestRecord]:
        """The other tenant: two clients streaming 64-token completions back to back."""
        records: list[RequestRecord] = []

        async def worker(w: int) -> None:
            i = w
            while not until.is_set() and (n is None or i < n):
                req = PlannedRequest(i, [11 + i % 50] * 16, 64, tenant, None)
                records.append(await send_one(session, target, req))
                i += 2

        await asyncio.gather(worker(0), worker(1))
        return records

    def p50(records: list[RequestRecord], what: str) -> float:
        if what == "ttft":
            return 1000 * percentile([r.ttft for r in records if r.ttft is not None], 50)
        return 1000 * percentile([g for r in records for g in r.itl], 50)

    def slow_in_flight() -> int:
        return int(t.admission()["in_flight_by_tenant"].get(slow, 0))

    read: dict[socket.socket, bytes] = {}
    async with _session() as session:
        alone = await streams(session, asyncio.Event(), 12)
        # Control: the same requests, read at full speed.
        done = asyncio.Event()
        beside_fast_task = asyncio.create_task(streams(session, done, None))
        t0 = time.monotonic()
        fast_ok = await asyncio.gather(*[_fast_reader(session, t, slow, bound_s)
                                         for _ in range(readers)])
        fast_s = round(time.monotonic() - t0, 1)
        done.set()
        beside_fast = await beside_fast_task
        # The same requests, read a byte a second on the router's own port.
        readers_tasks = [asyncio.create_task(_slow_reader(t, port, slow, read))
                         for _ in range(readers)]
        started = time.monotonic()
        admitted = await asyncio.to_thread(_wait, lambda: slow_in_flight() >= 1, 60, 0.1)
        done = asyncio.Event()
        beside_slow_task = asyncio.create_task(streams(session, done, None))
        # The slow tenant's requests end only through the stall watch (nobody reads them).
        released = await asyncio.to_thread(_wait, lambda: slow_in_flight() == 0, bound_s, 0.2)
        released_s = None if released is None else round(time.monotonic() - started, 1)
        done.set()
        beside_slow = await beside_slow_task
        for task in readers_tasks:
            task.cancel()
        await asyncio.gather(*readers_tasks, return_exceptions=True)
    got = await asyncio.gather(*[asyncio.to_thread(lambda s=s: read[s] + _drain(s))
                                 for s in list(read)])
    cut = sum(1 for b in got if b.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in b[-200:])
    idle_after = await asyncio.to_thread(_wait, lambda: _idle(t, kv_idle), 30)
    failed_other = sum(1 for r in alone + beside_fast + beside_slow if not r.ok)
    ttft_fast, ttft_slow = p50(beside_fast, "ttft"), p50(beside_slow, "ttft")
    itl_alone, itl_slow = p50(alone, "itl"), p50(beside_slow, "itl")
    figures = {"slow_readers": readers, "stall_limit_s": stall_s,
               "control_fast_readers_completed": sum(fast_ok),
               "control_fast_readers_took_s": fast_s,
               "slow_tenant_released_after_s": released_s,
               "slow_streams_cut_without_end": cut,
               "bytes_each_slow_client_got": sorted(len(b) for b in got),
               "router_and_engines_idle_after_s": None if idle_after is None
               else round(idle_after, 2),
               "other_tenant_streams": len(alone) + len(beside_fast) + len(beside_slow),
               "other_tenant_failed": failed_other,
               "other_ttft_p50_ms alone / beside fast / beside slow":
                   f"{p50(alone, 'ttft'):.1f} / {ttft_fast:.1f} / {ttft_slow:.1f}",
               "other_itl_p50_ms alone / beside fast / beside slow":
                   f"{itl_alone:.2f} / {p50(beside_fast, 'itl'):.2f} / {itl_slow:.2f}"}
    passed = (all(fast_ok) and admitted is not None and released_s is not None
              and cut == readers and idle_after is not None and idle_after <= 5.0
              and failed_other == 0 and bool(beside_slow) and itl_slow <= 2 * itl_alone
              and ttft_slow <= ttft_fast + 1000 * stall_s + 1000)
    return Scenario("slow readers", passed, figures, {
        "slow_tenant_released_after_s": f"<= {bound_s:g}",
        "slow_streams_cut_without_end": f"{readers}",
        "router_and_engines_idle_after_s": "<= 5", "other_tenant_failed": "0",
        "other_itl_p50_ms alone / beside fast / beside slow": "beside slow <= 2x alone",
        "other_ttft_p50_ms alone / beside fast / beside slow":
            "beside slow <= beside fast + stall limit + 1 s"})


def chaos_config(base: AppConfig, port: int, stall_s: float = STALL_S
                 ) -> tuple[AppConfig, dict[str, str]]:
    """The embedded default with two engine replicas of a small batch, a short router queue and
    two tenants (fresh keys); returns the config and the keys."""
    from serve_app.tenancy.keys import key_digest, new_key

    keys = {name: new_key() for name in TENANTS}
    model = base.models[0]
    model = model.model_copy(update={
        "engine_kwargs": {**model.engine_kwargs, "max_num_seqs": BATCH},
        "autoscaling": model.autoscaling.model_copy(update={"min_replicas": REPLICAS,
                                                            "max_replicas": REPLICAS})})
    router = base.router.model_copy(update={
        "port": port, "max_queued_per_band": QUEUE, "stream_stall_timeout_s": stall_s,
        "admission": base.router.admission.model_copy(update={"headroom": HEADROOM,
                                                              "poll_interval_s": 0.05})})
    tenants = [TenantSettings(name=n, api_key_sha256=[key_digest(keys[n])], priority=p)
               for n, p in TENANTS.items()]
    return base.model_copy(update={"models": [model], "router": router,
                                   "tenants": tenants}), keys


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="deployment YAML to start from")
    p.add_argument("--port", type=int, default=8010)
    p.add_argument("--out", default="bench/out/chaos")
    p.add_argument("--scenarios", default="storm,kill,overload,slow",
                   help="comma-separated subset of storm, kill, overload, slow")
    p.add_argument("--overload-s", type=float, default=60.0, help="overload duration")
    p.add_argument("--slow-readers", type=int, default=2, help="slow-reader streams")
    p.add_argument("--stall-s", type=float, default=STALL_S,
                   help="router.stream_stall_timeout_s of the chaos stack")


def main(args: argparse.Namespace) -> int:
    import httpx

    from serve_app.launch import start_stack, stop_stack

    cfg, keys = chaos_config(load_config(Path(args.config)), args.port, args.stall_s)
    base = start_stack(cfg, log_to_driver=False)
    scenarios: list[Scenario] = []
    try:
        ok = _wait(lambda: _ready(httpx, base, keys["chaos-a"]), 600, 1.0)
        if ok is None:
            raise SystemExit("the stack did not become ready in 600 s")
        t = Target(base, keys, cfg.models[0].name)
        _wait(lambda: len(t.engines()) == REPLICAS, 600, 1.0)
        runs = {"storm": lambda: disconnect_storm(t),
                "kill": lambda: replica_kill(t),
                "overload": lambda: overload(t, duration_s=args.overload_s),
                "slow": lambda: slow_readers(t, args.slow_readers, args.stall_s)}
        for name in args.scenarios.split(","):
            print(f"chaos: {name} ...", flush=True)
            scenario = asyncio.run(runs[name.strip()]())
            print(f"chaos: {scenario.name}: {'PASS' if scenario.passed else 'FAIL'} "
                  f"{json.dumps(scenario.figures)}", flush=True)
            scenarios.append(scenario)
    finally:
        stop_stack()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = (f"serve-app chaos --scenarios {args.scenarios} --overload-s {args.overload_s:g} "
               f"--slow-readers {args.slow_readers} --stall-s {args.stall_s:g}")
    (out / "chaos.json").write_text(json.dumps({"command": command, "scenarios": [
        asdict(s) for s in scenarios]}, indent=2))
    (out / "chaos.md").write_text(_markdown(scenarios, command))
    print(_markdown(scenarios, command))
    return 0 if scenarios and all(s.passed for s in scenarios) else 1


def _ready(httpx: Any, base: str, key: str) -> bool:
    try:
        return httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
