"""Noticing an engine that holds requests but makes no progress.

An engine core can hang rather than die: a process stopped by the kernel or a debugger, a
pipeline stage blocked in a send or receive to a peer whose node is gone, a driver stuck in a
collective. vLLM's ``check_health`` only reports an engine core that has exited, so such a
replica stays in Serve's view, keeps its GPUs and its requests, and its streams hang. The
engine adapter feeds a :class:`StallWatch` and asks it in ``check_health``; a stall fails the
health check (after the adapter has killed the engine's processes, which ends the requests in
it with an error and frees its devices), and Serve replaces the replica.

A step is *due* from the moment a request arrives at an idle engine, and again after every
step that leaves requests running or waiting; a step that leaves none makes none due. The
engine is stalled when a step has been due for longer than the timeout while the engine still
tracks unfinished requests.
"""

from __future__ import annotations


class StallWatch:
    """Times how long the engine's next step has been due (see the module docstring).

    ``timeout_s`` None turns the watch off (``stalled_for`` always answers None). Timestamps are
    ``time.monotonic()`` seconds, passed in by the caller (the watch reads no clock).
    """

    __slots__ = ("timeout_s", "due_since")

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.due_since: float | None = None

    def submitted(self, now: float, engine_idle: bool) -> None:
        """A request goes to the engine; ``engine_idle``: it tracked no unfinished request
        before this one (then whatever was due before is history: aborted requests)."""
        if engine_idle or self.due_since is None:
            self.due_since = now

    def stepped(self, now: float, has_work: bool) -> None:
        """The engine finished a step; ``has_work``: requests still run or wait in it."""
        self.due_since = now if has_work else None

    def stalled_for(self, now: float, unfinished: int) -> float | None:
        """Seconds a step has been due, when that exceeds the timeout and the engine still
        tracks ``unfinished`` > 0 requests; otherwise None. Unfinished requests with no step
        due (a step that saw no work ran while a request was on its way into the engine) make
        one due from ``now``: a hang right then is found one check later, not never."""
        if self.timeout_s is None or unfinished == 0:
            return None
        if self.due_since is None:
            self.due_since = now
            return None
        waited = now - self.due_since
        return waited if waited > self.timeout_s else None
