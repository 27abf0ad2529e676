"""An asyncio event loop on a virtual clock, for the cluster simulation
(:mod:`serve_bench.simulate`).

``loop.time()`` is virtual and starts at 0; when nothing is ready, the loop jumps its clock to
the next timer instead of sleeping, so ``asyncio.sleep(0.02)`` costs no wall time and a run of
simulated seconds takes only the CPU its callbacks need. Everything else is the ordinary
selector loop: futures, tasks and cancellation behave as in the router, so the admission
controller's ``acquire`` runs unchanged. ``time.monotonic`` stays real: the controller uses it
only for the ages of waiters (``expire_waiting``, a model with no replica), which the
simulation never reaches.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without blocking; a wait of ``timeout`` moves the loop's virtual clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualClockLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if ready or timeout is None or timeout <= 0 or self.loop is None:
            if not ready and timeout is None:
                raise RuntimeError("simulation deadlock: nothing scheduled and nothing ready")
            return ready
        self.loop.now += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual (see the module docstring)."""

    def __init__(self) -> None:
        selector = _JumpingSelector()
        self.now = 0.0
        super().__init__(selector)
        selector.loop = self
        self._clock_resolution = 1e-9  # timers due within this of now run (float sums)

    def time(self) -> float:
        return self.now


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualClockLoop`."""
    loop = VirtualClockLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        # The simulation stops mid-flight: cancel what still runs (clients, engines, feeds)
        # and let their cleanup run on the loop before it closes.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        asyncio.set_event_loop(None)
        loop.close()


__all__ = ["VirtualClockLoop", "run_virtual"]
