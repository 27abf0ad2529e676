"""The simulated engine replica: batch slots with step times, reporting an ``EngineLoad`` as
the real LLMServer does (for :mod:`serve_bench.simulate`).

One engine runs at most ``max_num_seqs`` requests; each step processes at most
``step_tokens`` tokens: one per decoding request, then chunks of prompts (those in a partial
prefill first, then waiting requests by vLLM priority, then arrival) while places are free. A
request's first token comes out of the step that finishes its prompt, one more per step after;
a step takes ``step_base_s`` plus time per prompt token and per decoding request. Its counts
(``running``, ``waiting``, KV use) are those of its latest step, as vLLM's are; ``active`` is
live (requests sent to the replica and not yet finished), as the LLMServer's is.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

from serve_app.engine.protocol import EngineLoad


@dataclass(frozen=True)
class EngineShape:
    max_num_seqs: int = 32
    step_tokens: int = 2048
    step_base_s: float = 0.008
    prefill_token_s: float = 4e-6
    decode_seq_s: float = 1e-4
    kv_tokens: int = 32 * 1024  # KV-cache capacity in tokens (use is reported, not enforced)


@dataclass(eq=False)
class SimRequest:
    tenant: str
    prompt: int
    output: int
    priority: int
    first: asyncio.Future[str]
    done: asyncio.Future[None]
    sent_at: float = 0.0
    started_at: float | None = None
    prefilled: int = 0
    decoded: int = 0
    aborted: bool = False
    finished: bool = False


_SEQ = itertools.count()


@dataclass(eq=False)
class SimReplica:
    """One LLMServer replica: its engine, its state in Serve and its routers' reports."""

    replica: str
    shape: EngineShape
    joined_at: float
    state: str = "serving"  # serving -> draining -> gone
    drain_at: float | None = None
    slow: bool = False  # its load answers miss the poll timeout
    running: list[SimRequest] = field(default_factory=list)
    waiting: list[tuple[int, int, SimRequest]] = field(default_factory=list)
    active: int = 0
    requests_total: int = 0
    steps: int = 0
    step_running: int = 0
    step_waiting: int = 0
    step_kv: float = 0.0
    prefill_avg: float = 0.0
    sent_while_draining: int = 0
    waiting_sum: int = 0  # over steps, for the mean engine-side waiting
    waiting_max: int = 0
    measured_steps: int = 0
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _load: tuple[tuple[object, ...], EngineLoad] | None = None

    def submit(self, req: SimRequest, now: float) -> None:
        """Serve delivered ``req`` to this replica."""
        if self.state != "serving":
            self.sent_while_draining += 1
        req.sent_at = now
        self.active += 1
        self.requests_total += 1
        heapq.heappush(self.waiting, (req.priority, next(_SEQ), req))
        self._wake.set()

    def abort(self, req: SimRequest) -> None:
        """The router's stream was cut: the engine drops the request."""
        if not req.aborted and not req.finished:
            req.aborted = True
            self.active -= 1
            if req in self.running:
                self.running.remove(req)
            else:
                self.waiting = [w for w in self.waiting if w[2] is not req]
                heapq.heapify(self.waiting)

    def load(self, router_demand: tuple[tuple[str, int], ...]) -> EngineLoad:
        """What ``LLMServer.engine_load`` answers (the same record while nothing changed)."""
        key = (self.steps, self.active, self.requests_total, router_demand)
        if self._load is not None and self._load[0] == key:
            return self._load[1]
        load = EngineLoad(self.step_running, self.step_waiting, self.step_kv,
                          self.shape.max_num_seqs, self.shape.step_tokens, self.prefill_avg,
                          replica=self.replica, active=self.active,
                          requests_total=self.requests_total,
                          unfinished=self.step_running + self.step_waiting,
                          router_demand=router_demand)
        self._load = (key, load)
        return load

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], float]:
        """One step's work: (request, prompt tokens it computes; 0 = a decode) and its time."""
        s = self.shape
        budget = s.step_tokens
        work: list[tuple[SimRequest, int]] = []
        prefill = 0
        for req in self.running:
            if req.prefilled >= req.prompt:
                work.append((req, 0))
                budget -= 1
        for req in self.running:  # partial prefills first
            if req.prefilled < req.prompt and budget > 0:
                chunk = min(req.prompt - req.prefilled, budget)
                work.append((req, chunk))
                budget -= chunk
                prefill += chunk
        while self.waiting and budget > 0 and len(self.running) < s.max_num_seqs:
            *_, req = heapq.heappop(self.waiting)
            req.started_at = asyncio.get_running_loop().time()
            self.running.append(req)
            self.prefill_avg = req.prompt if not self.prefill_avg else \
                0.9 * self.prefill_avg + 0.1 * req.prompt
            chunk = min(req.prompt, budget)
            work.append((req, chunk))
            budget -= chunk
            prefill += chunk
        decodes = len(work) - sum(1 for _, c in work if c)
        step_s = s.step_base_s + prefill * s.prefill_token_s + decodes * s.decode_seq_s
        return work, step_s

    async def run(self, measure_from: float) -> None:
        """The engine's step loop, until the replica is gone."""
        loop = asyncio.get_running_loop()
        while self.state != "gone":
            if not self.running and not self.waiting:
                self.step_running = self.step_waiting = 0
                self._wake.clear()
                await self._wake.wait()
                continue
            work, step_s = self._schedule()
            self.steps += 1
            self.step_running = len(self.running)
            self.step_waiting = len(self.waiting)
            self.step_kv = sum(r.prefilled + r.decoded for r in self.running) / \
                self.shape.kv_tokens
            if self.state == "serving" and loop.time() >= measure_from:
                self.measured_steps += 1
                self.waiting_sum += self.step_waiting
                self.waiting_max = max(self.waiting_max, self.step_waiting)
            await asyncio.sleep(step_s)
            for req, chunk in work:
                if req.aborted:
                    continue
                if chunk:
                    req.prefilled += chunk
                    if req.prefilled < req.prompt:
                        continue
                req.decoded += 1
                if req.decoded == 1 and not req.first.done():
                    req.first.set_result(self.replica)
                if req.decoded >= req.output:
                    self.running.remove(req)
                    self.active -= 1
                    req.finished = True
                    if not req.done.done():
                        req.done.set_result(None)
            if self.state == "draining" and self.active == 0:
                self.state = "gone"


__all__ = ["EngineShape", "SimReplica", "SimRequest"]
