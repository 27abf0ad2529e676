"""The benchmark's HTTP driver: streams OpenAI completions and times every chunk.

aiohttp (as ``vllm bench serve`` uses) keeps the client's own cost per chunk small, so the
numbers describe the server. Three schedules: a concurrency cap (continuous batching as a user
sees it), a request rate (gamma arrivals), and static batches (send B, wait for all, repeat).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp

from serve_bench.stats import RequestRecord
from serve_bench.workload import PlannedRequest
from serve_app.engine.timing import parse_server_timing


@dataclass(frozen=True)
class Target:
    """Where and what to send: ``base_url`` ends before ``/v1``."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    timeout_s: float = 1800


class Progress:
    """A one-line progress bar on stderr (only when it is a terminal, or when forced)."""

    def __init__(self, total: int, label: str, enabled: bool | None = None) -> None:
        self.total, self.label, self.done = total, label, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled

    def tick(self) -> None:
        self.done += 1
        if self.enabled and not self.total:  # a run bounded by time: no known end
            sys.stderr.write(f"\r{self.label} {self.done} done")
            sys.stderr.flush()
        elif self.enabled:
            filled = int(30 * self.done / max(self.total, 1))
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] "
                             f"{self.done}/{self.total}")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _payload(target: Target, req: PlannedRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": req.tenant.model or target.model,
        "max_tokens": req.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.endpoint.endswith("/chat/completions"):
        # Chat prompts are text, so their token count is the tokenizer's; usage reports it.
        body["messages"] = [{"role": "user", "content": " ".join(map(str, req.prompt_token_ids))}]
    else:
        body["prompt"] = req.prompt_token_ids
    return body


async def send_one(session: aiohttp.ClientSession, target: Target, req: PlannedRequest
                   ) -> RequestRecord:
    """Send ``req`` and record its timings; never raises (failures are recorded)."""
    headers = {"Content-Type": "application/json"}
    if req.tenant.api_key:
        headers["Authorization"] = f"Bearer {req.tenant.api_key}"
    rec = RequestRecord(start=time.perf_counter(), tenant=req.tenant.name,
                        prompt_tokens=len(req.prompt_token_ids))
    last = rec.start
    try:
        async with session.post(target.base_url + target.endpoint, json=_payload(target, req),
                                headers=headers) as resp:
            rec.status = resp.status
            rec.server_timing = parse_server_timing(resp.headers.get("Server-Timing"))
            if resp.status != 200:
                rec.error = (await resp.text())[:500]
                return rec
            buffer = b""
            async for part in resp.content.iter_any():
                now = time.perf_counter()
                buffer += part
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    data = json.loads(event[6:])
                    if "error" in data:
                        rec.error = str(data["error"])[:500]
                        continue
                    if data.get("usage"):
                        rec.output_tokens = data["usage"]["completion_tokens"]
                        rec.prompt_tokens = data["usage"]["prompt_tokens"]
                    choices = data.get("choices") or []
                    has_content = any(c.get("text") or (c.get("delta") or {}).get("content")
                                      for c in choices)
                    if has_content:
                        if rec.ttft is None:
                            rec.ttft = now - rec.start
                        else:
                            rec.itl.append(now - last)
                        last = now
            rec.end = time.perf_counter()
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as err:
        rec.error = f"{type(err).__name__}: {err}"[:500]
    return rec


def _session(concurrency: int, timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max(concurrency, 1) + 8, force_close=False),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def run_concurrency(target: Target, reqs: Iterable[PlannedRequest], concurrency: int,
                          progress: Progress | None = None, duration_s: float | None = None
                          ) -> tuple[list[RequestRecord], float]:
    """At most ``concurrency`` requests in flight; a new one starts as soon as one ends (or at
    its planned arrival when the plan has a rate), in plan order. ``reqs`` may be a lazy plan
    without end when ``duration_s`` bounds the run: requests not started by then are never
    drawn (those in flight finish). Returns records and the wall time."""
    records: list[RequestRecord] = []
    pending = iter(reqs)  # shared by the workers: each takes the next request when it is free
    async with _session(concurrency, target.timeout_s) as session:
        t0 = time.perf_counter()

        async def worker() -> None:
            for r in pending:
                if r.send_at is not None:
                    await asyncio.sleep(max(0.0, t0 + r.send_at - time.perf_counter()))
                if duration_s is not None and time.perf_counter() - t0 > duration_s:
                    return
                records.append(await send_one(session, target, r))
                if progress:
                    progress.tick()

        await asyncio.gather(*(worker() for _ in range(max(concurrency, 1))))
        return records, time.perf_counter() - t0


async def run_static(target: Target, reqs: list[PlannedRequest], batch: int,
                     progress: Progress | None = None) -> tuple[list[RequestRecord], float]:
    """Static batching as a client can impose it: send ``batch`` requests, wait for all of them,
    then send the next batch. The slowest request of each batch holds the others' slots idle."""
    records: list[RequestRecord] = []
    async with _session(batch, target.timeout_s) as session:
        t0 = time.perf_counter()
        for i in range(0, len(reqs), batch):
            done = await asyncio.gather(*(send_one(session, target, r)
                                          for r in reqs[i:i + batch]))
            records.extend(done)
            if progress:
                for _ in done:
                    progress.tick()
        return records, time.perf_counter() - t0
