"""Slow readers: streams whose clients barely read, beside another tenant's ordinary streams.

``readers`` streams (n=16 choices of 2,000 tokens, ~5 MB of SSE: ``slow_client.SLOW_BODY``)
are read one byte a second through a 2 KB receive window, on the router replica's own port
(through HAProxy a few MB fit in its buffers and the kernel's, so the router would never
wait), after a control: the same requests read at full speed. Meanwhile the other tenant
streams 64-token completions, also measured alone. Bound: every slow stream is cut by the
stall watch (``router.stream_stall_timeout_s``) and closed without its end, the stack is idle
within 5 s afterwards (:func:`stack_idle`), and the other tenant's streams all complete, with
ITL p50 within 2x of its own alone and TTFT p50 no worse than beside the control plus the
stall limit and 1 s.
"""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp

from serve_bench.chaos.report import Scenario
from serve_bench.chaos.stack import STALL_S, TENANTS
from serve_bench.chaos.target import Target, client_session, stack_idle, wait_until
from serve_bench.slow_client import SLOW_BODY, open_slow_stream
from serve_bench.stats import percentile


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
    from serve_bench.client import Target as BenchTarget
    from serve_bench.client import send_one
    from serve_bench.stats import RequestRecord
    from serve_bench.workload import PlannedRequest
    from serve_bench.workload import Tenant as BenchTenant
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
    async with client_session() as session:
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
        admitted = await asyncio.to_thread(wait_until, lambda: slow_in_flight() >= 1, 60, 0.1)
        done = asyncio.Event()
        beside_slow_task = asyncio.create_task(streams(session, done, None))
        # The slow tenant's requests end only through the stall watch (nobody reads them).
        released = await asyncio.to_thread(wait_until, lambda: slow_in_flight() == 0, bound_s, 0.2)
        released_s = None if released is None else round(time.monotonic() - started, 1)
        done.set()
        beside_slow = await beside_slow_task
        for task in readers_tasks:
            task.cancel()
        await asyncio.gather(*readers_tasks, return_exceptions=True)
    got = await asyncio.gather(*[asyncio.to_thread(lambda s=s: read[s] + _drain(s))
                                 for s in list(read)])
    cut = sum(1 for b in got if b.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in b[-200:])
    idle_after = await asyncio.to_thread(wait_until, lambda: stack_idle(t, kv_idle), 30)
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
