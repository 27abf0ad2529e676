"""vLLM's scheduler with one change for tenants: a waiting request that the router ranked well
ahead starts before the lower-ranked requests still part-way through a chunked prefill.

Why: vLLM's scheduler gives each step's token budget to the RUNNING requests first, then to the
waiting ones in priority order, and a long prompt part-way through its chunked prefill is
running. So a flood of long prompts takes the budget a step before a quiet tenant's request is
looked at, whatever that request's priority (measured on an H100, bench/RESULTS.md 42d: beside
2k- and 4k-token floods a quiet tenant's 1,024-token prompt waited a whole step in the engine's
queue, or was chunked over two steps; its first token took ~200 ms where one step is 63 ms).

What: before each step, the running requests that still have prompt tokens to prefill and that
the waiting queue's head outranks (:func:`~serve_app.engine.priority.outranks`: a better
band, or its tenant has fewer than half as many requests in the engines) are held out of that
step. The step's budget then goes to the decodes, the head and whatever else waits, in vLLM's
own order; the held prefills keep their KV blocks and resume at the next step. Decodes are never
held, nothing is preempted or recomputed, and when no such head waits (the flood alone, every
request alike) vLLM's scheduling runs unchanged. The cost is one step's delay of the held
chunks each time a request that outranks them arrives.

Held requests are out of ``running`` only during :meth:`schedule`: they are not candidates for
vLLM's preemption under KV pressure in that step (another running request is), and the step
admits at most ``max_num_seqs`` less the held ones from the queue.

This module imports vLLM (its scheduler classes are internal API: vLLM warns that their
interface is not public); ``tests/unit/test_vllm_scheduler.py`` runs it against the installed
vLLM's real scheduler, so a change there fails loudly. The model's ``priority_before_prefill``
turns it on (``serve_app/config/model.py``); :func:`use_priority_before_prefill` picks the
variant matching the engine's asynchronous scheduling.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from serve_app.engine.priority import outranks


# The scheduler's queues of waiting requests (vLLM 0.26: waiting, skipped_waiting; 0.32 also
# kv_holding_waiting) and its limits on running requests (0.26 admits against
# max_num_running_reqs; 0.32 against max_num_active_reqs and asserts the other).
_WAITING_QUEUES = ("waiting", "skipped_waiting", "kv_holding_waiting")
_SLOT_LIMITS = ("max_num_running_reqs", "max_num_active_reqs")


class _PriorityBeforePrefill:
    """The change (module docstring), mixed in before one of vLLM's scheduler classes."""

    running: list[Any]

    def _waiting_head_priority(self) -> int | None:
        best = None
        for name in _WAITING_QUEUES:
            queue = getattr(self, name, None)
            if queue:  # vLLM's priority queue: its head is the lowest (priority, arrival)
                head = queue.peek_request().priority
                best = head if best is None else min(best, head)
        return best

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        head = self._waiting_head_priority()
        held = [] if head is None else [
            r for r in self.running if r.is_prefill_chunk and outranks(head, r.priority)]
        if not held:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        order = {id(r): i for i, r in enumerate(self.running)}
        held_ids = {id(r) for r in held}
        # In place: the list is vLLM's, and nothing may keep a stale alias of it.
        self.running[:] = [r for r in self.running if id(r) not in held_ids]
        caps = {name: getattr(self, name) for name in _SLOT_LIMITS if hasattr(self, name)}
        for name, cap in caps.items():
            setattr(self, name, cap - len(held))
        try:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            for name, cap in caps.items():
                setattr(self, name, cap)
            # The held requests go back where they were among the requests that were already
            # running; the ones this step admitted stay after them, as vLLM appends them.
            before = [r for r in self.running if id(r) in order] + held
            before.sort(key=lambda r: order[id(r)])
            self.running[:] = before + [r for r in self.running if id(r) not in order]


class PriorityBeforePrefillScheduler(_PriorityBeforePrefill, Scheduler):
    """For engines with asynchronous scheduling off."""


class AsyncPriorityBeforePrefillScheduler(_PriorityBeforePrefill, AsyncScheduler):
    """For engines with asynchronous scheduling on (vLLM's default where supported)."""


def use_priority_before_prefill(vllm_config: Any) -> None:
    """Make ``vllm_config``'s engine run the scheduler of this module: the variant for its
    resolved ``async_scheduling`` (a synchronous scheduler in an asynchronous engine would
    lose vLLM's step overlap)."""
    scheduler = vllm_config.scheduler_config
    scheduler.scheduler_cls = (AsyncPriorityBeforePrefillScheduler if scheduler.async_scheduling
                               else PriorityBeforePrefillScheduler)
