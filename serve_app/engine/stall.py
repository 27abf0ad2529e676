"""Noticing an engine that holds requests but makes no progress, and never a slow one.

An engine core can hang rather than die: a process stopped by the kernel or a debugger, a
pipeline stage blocked in a send or receive to a peer whose node is gone, a driver stuck in a
collective. vLLM's ``check_health`` only reports an engine core that has exited, so such a
replica stays in Serve's view, keeps its GPUs and its requests, and its streams hang. The
engine adapter feeds a :class:`StallWatch` and asks it in ``check_health``; a stall fails the
health check (after the adapter has killed the engine's processes, which ends the requests in
it with an error and frees its devices), and Serve replaces the replica.

Killing a healthy engine costs every request in it and minutes of restart on a GPU, so the
watch errs towards patience. A step can legitimately take long: a long prefill with chunking
off, a TP/PP step riding out a network hiccup, first-use compilation or autotuning, a CPU under
load. So:

* the timeout is derived from the step times the watch has seen: ``STEP_MARGIN`` times the
  longest due-to-done step so far, never below the configured floor (production floor:
  :data:`serve_app.config.DEFAULT_STALL_TIMEOUT_S`, at least vLLM's own 300 s per execution,
  ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``);
* a stall is declared only by ``CHECKS_TO_FAIL`` consecutive health checks that each find the
  due step overdue; a step between them starts the count again.

A step is *due* from the moment a request arrives at an idle engine, and again after every
step that leaves requests running or waiting; a step that leaves none makes none due. A check
finds the engine overdue when a step has been due for longer than the timeout while the engine
still tracks unfinished requests.
"""

from __future__ import annotations

# The timeout is at least this many times the longest step observed: an engine that once took
# 200 s for a step (a compile, a slow collective) may take that long again.
STEP_MARGIN = 4.0
# Consecutive overdue health checks that declare a stall (one late check is not enough).
CHECKS_TO_FAIL = 2


class StallWatch:
    """Times how long the engine's next step has been due (see the module docstring).

    ``floor_s`` None turns the watch off (``stalled_for`` and ``check`` always answer None).
    Timestamps are seconds on one monotonic clock, passed in by the caller (the watch reads no
    clock, so a test or a scripted engine can drive it on a clock of its own).

    Called by the engine adapter: :meth:`submitted` when a request goes into the engine,
    :meth:`stepped` after each engine step (from the engine's per-step stats), :meth:`check`
    from the replica's health check.
    """

    __slots__ = ("floor_s", "due_since", "longest_step_s", "overdue_checks", "step_margin",
                 "checks_to_fail")

    def __init__(self, floor_s: float | None, step_margin: float = STEP_MARGIN,
                 checks_to_fail: int = CHECKS_TO_FAIL) -> None:
        self.floor_s = floor_s
        self.step_margin = step_margin
        self.checks_to_fail = checks_to_fail
        self.due_since: float | None = None
        self.longest_step_s = 0.0
        self.overdue_checks = 0

    @property
    def timeout_s(self) -> float | None:
        """How long a due step may take before a check counts it overdue: the floor, or
        ``step_margin`` times the longest step seen when that is longer. None: off."""
        if self.floor_s is None:
            return None
        return max(self.floor_s, self.step_margin * self.longest_step_s)

    def submitted(self, now: float, engine_idle: bool) -> None:
        """A request goes to the engine; ``engine_idle``: it tracked no unfinished request
        before this one (then whatever was due before is history: aborted requests)."""
        if engine_idle or self.due_since is None:
            self.due_since = now
            self.overdue_checks = 0

    def stepped(self, now: float, has_work: bool) -> None:
        """The engine finished a step; ``has_work``: requests still run or wait in it. The
        step's time (since it became due) joins the observed step times."""
        if self.due_since is not None:
            self.longest_step_s = max(self.longest_step_s, now - self.due_since)
        self.due_since = now if has_work else None
        self.overdue_checks = 0

    def stalled_for(self, now: float, unfinished: int) -> float | None:
        """One reading: seconds a step has been due, when that exceeds :attr:`timeout_s` and
        the engine still tracks ``unfinished`` > 0 requests; otherwise None. Unfinished
        requests with no step due (a step that saw no work ran while a request was on its way
        into the engine) make one due from ``now``: a hang right then is found later, not
        never. Counts nothing; :meth:`check` is what a health check calls."""
        timeout = self.timeout_s
        if timeout is None or unfinished == 0:
            return None
        if self.due_since is None:
            self.due_since = now
            return None
        waited = now - self.due_since
        return waited if waited > timeout else None

    def check(self, now: float, unfinished: int) -> float | None:
        """A health check's verdict: the seconds the due step has waited when this check and
        the ``checks_to_fail - 1`` before it (with no step in between) all found it overdue;
        otherwise None (an overdue reading is counted, not acted on)."""
        waited = self.stalled_for(now, unfinished)
        if waited is None:
            self.overdue_checks = 0
            return None
        self.overdue_checks += 1
        return waited if self.overdue_checks >= self.checks_to_fail else None


class EngineStalledError(RuntimeError):
    """The engine held requests without a step for longer than its stall timeout."""


def kill_child_processes() -> list[int]:
    """SIGKILL every process under this one: the engine core and the workers it started (a
    stopped or blocked process ignores anything milder). Returns their pids."""
    import psutil  # a dependency of vLLM

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    return [child.pid for child in children]
