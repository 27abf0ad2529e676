"""The chaos client and its probes of the running stack.

- :class:`Target` names the stack (router URL, one key per chaos tenant, the model) and probes
  it white-box through Serve handles: every live engine replica's load, the router's admission
  state for the model, the model's replica actors; :meth:`Target.kill_replica` kills one
  replica actor for good (Serve starts a replacement).
- :func:`request` sends one completion and never raises (except when cancelled): it returns a
  :class:`Result` whose ``outcome`` says how the request ended, as the scenarios count it.
- :func:`wait_until` polls a predicate (blocking: call it through ``asyncio.to_thread`` from a
  scenario) and returns the seconds it took, or None on timeout.
- :func:`stack_idle` is the "holds nothing" bound shared by the storm and slow-reader
  scenarios: every engine runs and queues nothing with its KV cache back to ``kv_idle``
  (within half a percent), and the router has nothing in flight or queued.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import aiohttp

from serve_app.config import APP_NAME


REFUSED = (429, 503)  # statuses a request is refused with before any byte (outcome "refused")



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



def client_session() -> aiohttp.ClientSession:
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


def wait_until(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.05
               ) -> float | None:
    """Seconds until ``predicate()`` held, or None if it did not within ``timeout_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(interval_s)
    return None


def stack_idle(t: Target, kv_idle: float) -> bool:
    engines, adm = t.engines(), t.admission()
    return (bool(engines) and all(e["running"] == 0 and e["waiting"] == 0
                                  and e["kv_cache_usage"] <= kv_idle + 0.005 for e in engines)
            and adm["in_flight"] == 0 and adm["queued"] == 0)
