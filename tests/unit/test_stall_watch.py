"""The stall watch: when an engine that holds requests counts as hung (serve_app/engine/stall.py),
and that a slow but healthy engine never does."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.config import DEFAULT_STALL_TIMEOUT_S, parse_config
from serve_app.engine.stall import CHECKS_TO_FAIL, STEP_MARGIN, StallWatch


def test_off_without_a_timeout():
    watch = StallWatch(None)
    watch.submitted(0.0, engine_idle=True)
    assert watch.stalled_for(1e6, unfinished=1) is None
    assert watch.check(1e6, unfinished=1) is None and watch.check(2e6, unfinished=1) is None


def test_a_request_at_an_idle_engine_waits_for_its_first_step():
    watch = StallWatch(10)
    watch.submitted(100.0, engine_idle=True)
    assert watch.stalled_for(109.0, unfinished=1) is None
    assert watch.stalled_for(111.0, unfinished=1) == 11.0
    watch.stepped(101.0, has_work=True)  # a step came: the next one is due from now
    assert watch.stalled_for(110.0, unfinished=1) is None
    assert watch.stalled_for(112.0, unfinished=1) == 11.0


def test_a_long_idle_spell_is_no_stall():
    """An engine idle for an hour gets a request: only the time since that request counts."""
    watch = StallWatch(10)
    watch.submitted(0.0, engine_idle=True)
    watch.stepped(1.0, has_work=False)  # finished everything
    watch.submitted(3600.0, engine_idle=True)
    assert watch.stalled_for(3605.0, unfinished=1) is None
    assert watch.longest_step_s == 1.0  # the idle hour is no step time


def test_more_requests_do_not_reset_a_due_step():
    """A hung engine that keeps receiving requests is still hung."""
    watch = StallWatch(10)
    watch.submitted(0.0, engine_idle=True)
    for t in range(1, 30):
        watch.submitted(float(t), engine_idle=False)
    assert watch.stalled_for(30.0, unfinished=30) == 30.0


def test_nothing_unfinished_is_no_stall():
    """Requests aborted without a step (the engine idle again) leave nothing to wait for, and
    the next request at the idle engine starts a fresh wait."""
    watch = StallWatch(10)
    watch.submitted(0.0, engine_idle=True)
    assert watch.stalled_for(50.0, unfinished=0) is None
    watch.submitted(60.0, engine_idle=True)
    assert watch.stalled_for(65.0, unfinished=1) is None


def test_a_step_that_leaves_no_work_makes_none_due():
    watch = StallWatch(10)
    watch.submitted(0.0, engine_idle=True)
    watch.stepped(2.0, has_work=False)
    assert watch.stalled_for(100.0, unfinished=0) is None


def test_a_request_that_arrived_behind_an_empty_step_is_still_watched():
    """A step that saw no work ran while a request was on its way into the engine; the engine
    then hangs. The first check that sees the request unfinished starts the clock."""
    watch = StallWatch(10)
    watch.submitted(0.0, engine_idle=True)
    watch.stepped(0.001, has_work=False)  # the request was not in the engine yet
    assert watch.stalled_for(5.0, unfinished=1) is None  # clock starts here
    assert watch.stalled_for(14.0, unfinished=1) is None
    assert watch.stalled_for(16.0, unfinished=1) == 11.0


def test_one_overdue_check_is_not_a_stall_two_in_a_row_are():
    watch = StallWatch(10)
    watch.submitted(0.0, engine_idle=True)
    assert watch.check(11.0, unfinished=1) is None  # overdue once: counted, not acted on
    assert watch.overdue_checks == 1
    assert watch.check(16.0, unfinished=1) == 16.0  # the next check too: a stall
    assert CHECKS_TO_FAIL == 2


def test_a_step_between_two_overdue_checks_starts_the_count_again():
    """A step that took 11 s at a 10 s timeout, seen by one check: the engine was slow, not
    hung. The step also raises the timeout (4 x 11 s), so a step as slow as it is no stall."""
    watch = StallWatch(10)
    watch.submitted(0.0, engine_idle=True)
    assert watch.check(10.5, unfinished=1) is None
    watch.stepped(11.0, has_work=True)
    assert watch.overdue_checks == 0
    assert watch.timeout_s == STEP_MARGIN * 11.0
    assert watch.check(15.5, unfinished=1) is None
    assert watch.check(33.0, unfinished=1) is None  # 22 s for the next step: still in time
    assert watch.check(56.0, unfinished=1) is None  # 45 s > 44: overdue once
    assert watch.check(61.0, unfinished=1) == 50.0


def test_the_timeout_follows_the_longest_step_seen_never_below_the_floor():
    watch = StallWatch(300)
    watch.submitted(0.0, engine_idle=True)
    for t in range(1, 101):
        watch.stepped(t * 0.05, has_work=True)  # 50 ms steps
    assert watch.timeout_s == 300  # the floor
    watch.stepped(100.0, has_work=True)  # one step took 95 s (a compile)
    assert watch.timeout_s == pytest.approx(STEP_MARGIN * 95.0)
    assert watch.check(100.0 + 350.0, unfinished=1) is None  # past the floor, within 4 x 95 s
    assert watch.check(100.0 + 380.1, unfinished=1) is None  # overdue once
    assert watch.check(100.0 + 385.0, unfinished=1) == pytest.approx(385.0)


def test_stall_watch_defaults_gpu_floor_at_least_vllms_300_s_and_off_on_cpu():
    gpu = parse_config({"models": [{"name": "m", "path": "/m", "device": "gpu"}]}).models[0]
    assert gpu.engine_stall_timeout_s == DEFAULT_STALL_TIMEOUT_S >= 300
    cpu = parse_config({"models": [{"name": "m", "path": "/m", "device": "cpu"}]}).models[0]
    assert cpu.engine_stall_timeout_s is None
    # Set explicitly on CPU (the test suite's hung-engine test): on, at that floor.
    cpu_on = parse_config({"models": [{"name": "m", "path": "/m", "device": "cpu",
                                       "engine_stall_timeout_s": 10}]}).models[0]
    assert cpu_on.engine_stall_timeout_s == 10
    # The dumped config reads back the same (a live redeploy publishes and re-reads it).
    again = parse_config({"models": [cpu.model_dump(mode="json")]}).models[0]
    assert again.engine_stall_timeout_s is None


# The scripted engine on a fast clock: the real StallWatch decides, through the engine's own
# check_health, what Serve's health check would decide every HEALTH_CHECK_PERIOD_S.

async def _run_with_health_checks(engine, request, period_s: float) -> tuple[list, str]:
    """Drive ``request`` through ``engine`` while its check_health runs every ``period_s`` of
    the engine's clock, as Serve's health check would; returns (health-check failures, the
    generated text). A failed check ends the request, as the replica's replacement would."""
    failures: list[str] = []
    text: list[str] = []

    async def consume() -> None:
        async for chunk in engine.generate(request):
            text.extend(d.text for d in chunk.deltas)

    async def health_checks(generation: asyncio.Task) -> None:
        while not generation.done():
            next_at = engine.clock() + period_s
            while engine.clock() < next_at and not generation.done():
                await asyncio.sleep(0.001)
            try:
                await engine.check_health()
            except RuntimeError as err:
                failures.append(str(err))
                return

    generation = asyncio.create_task(consume())
    checker = asyncio.create_task(health_checks(generation))
    await asyncio.wait({generation, checker}, return_when=asyncio.FIRST_COMPLETED)
    generation.cancel()
    await asyncio.gather(generation, checker, return_exceptions=True)
    return failures, "".join(text)


def _scripted(step_s_at: dict[int, float], stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
              scale: float = 200.0):
    from serve_app.config import ModelSettings
    from serve_app.engine.scripted import ScriptedEngine

    # device gpu: the production default of the watch, without any GPU being used.
    settings = ModelSettings(name="m", path="/m", device="gpu", engine_kwargs={
        "scripted_step_s_at": step_s_at, "scripted_clock_scale": scale},
        engine_stall_timeout_s=stall_timeout_s)
    return ScriptedEngine(settings)


def _request(max_tokens: int = 3):
    from serve_app.engine.protocol import GenerationRequest, SamplingOptions

    return GenerationRequest(request_id="r", prompt="hello", stream=True,
                             sampling=SamplingOptions(max_tokens=max_tokens))


async def test_a_90_s_step_with_default_settings_does_not_kill_the_engine():
    """The issue's case: one step of 90 s (longer than the old 60 s timeout), health checks
    every 5 s, the GPU default floor. The request finishes and no check fails."""
    from serve_app.app import HEALTH_CHECK_PERIOD_S

    engine = _scripted({0: 90.0})
    await engine.start()
    try:
        t0 = engine.clock()
        failures, text = await _run_with_health_checks(engine, _request(), HEALTH_CHECK_PERIOD_S)
        assert engine.clock() - t0 >= 90.0  # the step really took 90 s on the engine's clock
        assert failures == [] and text == " t0 t1 t2", (failures, text)
        assert engine.watch.longest_step_s >= 90.0
        await engine.check_health()  # and the engine is still healthy
    finally:
        await engine.shutdown()


async def test_a_hung_step_is_killed_after_the_floor_and_two_checks():
    """The same engine whose step never ends (a stopped core): the watch does fire, after the
    floor plus at most two health-check periods, on the same code path."""
    from serve_app.app import HEALTH_CHECK_PERIOD_S

    engine = _scripted({0: 1e9})
    await engine.start()
    try:
        t0 = engine.clock()
        failures, _ = await _run_with_health_checks(engine, _request(), HEALTH_CHECK_PERIOD_S)
        waited = engine.clock() - t0
        assert failures and "without a step" in failures[0], failures
        floor = DEFAULT_STALL_TIMEOUT_S
        assert floor < waited <= floor + 2 * HEALTH_CHECK_PERIOD_S + 2, waited
    finally:
        await engine.shutdown()
