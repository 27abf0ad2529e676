"""The stall watch: when an engine that holds requests counts as hung (serve_app/engine/stall.py)."""

from __future__ import annotations

from serve_app.engine.stall import StallWatch


def test_off_without_a_timeout():
    watch = StallWatch(None)
    watch.submitted(0.0, engine_idle=True)
    assert watch.stalled_for(1e6, unfinished=1) is None


def test_a_request_at_an_idle_engine_waits_for_its_first_step():
    watch = StallWatch(10)
    watch.submitted(100.0, engine_idle=True)
    assert watch.stalled_for(109.0, unfinished=1) is None
    assert watch.stalled_for(111.0, unfinished=1) == 11.0
    watch.stepped(111.5, has_work=True)  # a step came: the next one is due from now
    assert watch.stalled_for(120.0, unfinished=1) is None
    assert watch.stalled_for(122.0, unfinished=1) == 10.5


def test_a_long_idle_spell_is_no_stall():
    """An engine idle for an hour gets a request: only the time since that request counts."""
    watch = StallWatch(10)
    watch.submitted(0.0, engine_idle=True)
    watch.stepped(1.0, has_work=False)  # finished everything
    watch.submitted(3600.0, engine_idle=True)
    assert watch.stalled_for(3605.0, unfinished=1) is None


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
