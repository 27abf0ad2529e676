"""The cluster simulation (bench/serve_bench/simulate*.py) on a small shape: it runs the real
admission classes on a virtual clock in seconds, and the invariants of issue 27 hold: nothing
is sent to a replica after its drain began, the engines stay busy while routers hold a
backlog, and the engines' own waiting queues stay near the headroom."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_bench.simulate import bars, simulate
from serve_bench.simulate_clock import run_virtual
from serve_bench.simulate_report import table


def test_the_virtual_clock_jumps_instead_of_sleeping():
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(asyncio.sleep(s) for s in (5.0, 30.0, 60.0)))
        return loop.time()

    started = time.monotonic()
    assert run_virtual(main()) == pytest.approx(60.0)
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("scenario", ["steady", "uneven", "scale-up", "drain", "slow-replica"])
def test_small_cluster_keeps_the_engines_busy_and_their_queues_short(scenario):
    res = simulate(4, 8, scenario, seconds=4.0, warmup_s=1.0)
    assert res.flood_done > 500 and res.quiet_n >= 5
    assert res.backlog_frac > 0.9  # the flood keeps a backlog in the routers
    assert res.util_mean >= 0.95, res
    assert res.waiting_mean <= res.headroom, res
    assert res.sent_to_draining == 0
    assert res.quiet_wait_p99_ms < 100  # a quiet tenant's request goes in beside the flood
    assert bars(res)["none sent to draining"]


def test_drained_replicas_take_no_new_request_and_finish_their_own():
    res = simulate(2, 8, "drain", seconds=4.0, warmup_s=1.0, event_s=1.5)
    assert res.sent_to_draining == 0
    assert res.failed == 0  # a drain cuts no stream
    assert res.util_mean >= 0.95


def test_a_restarted_router_fails_only_its_own_requests_and_the_rest_keep_running():
    res = simulate(4, 8, "router-restart", seconds=4.0, warmup_s=1.0)
    assert 0 < res.failed <= 8 * 32 * 2 // 4 + 1  # its own clients' requests (and the quiet one)
    assert res.flood_done > 300 and res.sent_to_draining == 0
    assert "| 4x8 | router-restart |" in table([res])
