"""Admission at cluster scale, simulated: the real admission, capacity-policy, router-share and
fair-queue classes driving modelled engines on a virtual clock (no Ray, no vLLM; issue 27).

Engines are batch slots with step times (:mod:`.simulate_engine`), routers hold the project's
``AdmissionController`` and ``EngineFeed`` and poll the engines' loads every
``poll_interval_s`` of simulated time (:mod:`.simulate_cluster`), all on an asyncio loop whose
clock jumps (:mod:`.simulate_clock`). A flooding tenant keeps about twice the engines' batch
places in requests (closed loop), a quiet tenant sends one request at a time, round robin over
the routers. One scenario per event, on top of a steady baseline:

* ``steady``: flood clients spread evenly over the routers;
* ``uneven``: 70% of the flood clients on one router;
* ``scale-up``: a quarter more replicas join at the event;
* ``drain``: a quarter of the replicas start draining at the event (they leave Serve's set);
* ``router-restart``: one router dies at the event (its queued and streaming requests fail and
  are sent again elsewhere; its demand report lingers on the replicas for the report TTL), and
  a new one starts ``restart_s`` later;
* ``slow-replica``: from the event one replica's load answer misses the poll timeout;
* ``load-moves``: the load moves between routers under long streams (issue 37, finding 8).
  From the start, long-stream clients (a quarter more than the batch places, outputs of
  ``long_output`` tokens) send through the first half of the routers only, so those routers
  hold every batch place; at the event the flood arrives on the other half. The first half's
  share falls to what the water-fill leaves it, but their streams run on: a router that takes
  its new share at once over-admits into the engines' waiting queues;
* ``load-alternates``: as ``load-moves``, and from then on the flood moves between the two
  halves of the routers every ``alternate_s`` (a client's next request goes to the other half).

Reported per scenario (measured after ``warmup_s``): engine utilisation (running over the batch
places of the serving replicas, sampled while some router holds a queue: mean and the worst
one-second window), engine-side waiting per replica (vLLM's waiting count at each step: the mean
replica's mean, and the max), the quiet tenant's queue wait and time to first token, requests
sent to a replica after its drain began, and the time one ``EngineFeed.apply`` takes. The
engines' waiting is also sampled every 50 ms (mean per serving replica) and its worst
one-second window reported: a burst of over-admission lasts a second or two, and a mean over
the run hides it. The bar for it is ``headroom`` plus one step's worth: the prompts one engine
step's token budget starts (``step_tokens // flood_prompt``, 2,048 // 512 = 4), which is also
the most the engine-feedback policy lets an engine with free places queue beyond the
headroom (:func:`step_worth`).

usage: serve-app simulate [--shape 8x32] [--shape 64x256] [--seconds S] [--scenario NAME ...]
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

from serve_bench.simulate_clock import run_virtual
from serve_bench.simulate_cluster import SimCluster, SimRouter
from serve_bench.simulate_engine import EngineShape
from serve_app.config import AdmissionSettings, RouterSettings

SCENARIOS = ("steady", "uneven", "scale-up", "drain", "router-restart", "slow-replica",
             "load-moves", "load-alternates")
MOVING = ("load-moves", "load-alternates")


@dataclass(frozen=True)
class Workload:
    flood_prompt: int = 512
    flood_output: int = 64  # each request's output is drawn from 1/2x..3/2x of this
    flood_per_place: float = 2.0  # flood clients per engine batch place
    quiet_prompt: int = 128
    quiet_output: int = 16
    quiet_think_s: float = 0.05
    uneven_share: float = 0.7  # of the flood clients on the first router (scenario uneven)
    retry_s: float = 1.0  # a client's wait after a 429 (the router's Retry-After)
    restart_s: float = 2.0  # a dead router's replacement starts after this long
    long_output: int = 256  # scenario load-moves: the long streams' mean output
    long_per_place: float = 1.25  # scenario load-moves: long-stream clients per batch place
    alternate_s: float = 1.0  # scenario load-alternates: the flood changes sides this often


@dataclass
class Result:
    routers: int
    replicas: int
    scenario: str
    seconds: float
    util_mean: float = 0.0
    util_min_1s: float = 0.0
    backlog_frac: float = 0.0  # of the samples with a router queue
    waiting_mean: float = 0.0
    waiting_worst: float = 0.0  # the highest replica's mean
    waiting_max: int = 0
    waiting_worst_1s: float = 0.0  # engine waiting per serving replica, worst 1 s window
    step_worth: int = 0  # requests one engine step starts (the waiting bar's allowance)
    headroom: int = 0
    quiet_n: int = 0
    quiet_wait_p50_ms: float = 0.0
    quiet_wait_p99_ms: float = 0.0
    quiet_ttft_p50_ms: float = 0.0
    quiet_ttft_p99_ms: float = 0.0
    sent_to_draining: int = 0
    failed: int = 0
    rejected: int = 0
    flood_done: int = 0
    apply_ms: float = 0.0
    polls_per_s: float = 0.0  # views applied per router per second
    poll_interval_s: float = 0.0
    cpu_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _windows(samples: list[tuple[float, float]]) -> list[float]:
    """The mean of ``samples`` (time, value) in each whole second of simulated time."""
    windows: dict[int, list[float]] = {}
    for t, v in samples:
        windows.setdefault(int(t), []).append(v)
    return [statistics.fmean(v) for v in windows.values()]


def step_worth(shape: EngineShape, workload: Workload) -> int:
    """One step's worth of requests: the flood prompts one engine step's token budget starts
    (at least 1). The engine-feedback policy lets an engine with free places queue this many
    beyond the headroom; more waiting than that was over-admitted."""
    return max(1, shape.step_tokens // max(1, workload.flood_prompt))


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Simulation:
    def __init__(self, routers: int, replicas: int, scenario: str, seconds: float,
                 warmup_s: float, event_s: float, workload: Workload, shape: EngineShape,
                 settings: AdmissionSettings, max_queued: int, seed: int,
                 report_ttl_s: float | None = None, channel_goodbye: bool = True) -> None:
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; one of {SCENARIOS}")
        self.n_routers, self.n_replicas, self.scenario = routers, replicas, scenario
        self.seconds, self.warmup_s, self.event_s = seconds, warmup_s, event_s
        self.w, self.settings, self.max_queued = workload, settings, max_queued
        self.cluster = SimCluster(shape, settings, seed, channel_goodbye=channel_goodbye)
        if report_ttl_s is not None:
            self.cluster.reports.demand_ttl_s = report_ttl_s
        self.cluster.measure_from = warmup_s
        self.slots: list[SimRouter | None] = []
        self.quiet_wait: list[float] = []
        self.quiet_ttft: list[float] = []
        self.util: list[tuple[float, float]] = []  # (time, utilisation) under backlog
        self.waiting: list[tuple[float, float]] = []  # (time, engine waiting per replica)
        self.samples = 0
        self.flood_done = 0
        self.stop = False
        self._restarts = 0

    def router_for(self, slot: int) -> SimRouter:
        """The client's router (HAProxy keeps its connection there), or the next live one."""
        n = len(self.slots)
        for k in range(n):
            r = self.slots[(slot + k) % n]
            if r is not None:
                return r
        raise RuntimeError("no router alive")

    def _new_router(self, slot: int) -> None:
        name = f"router-{slot}" + (f"-{self._restarts}" if self._restarts else "")
        r = SimRouter(name, self.settings, self.max_queued)
        self.slots[slot] = r
        self.cluster.start_router(r)

    def _flood_slot(self, i: int, clients: int) -> int:
        if self.scenario in MOVING and self.n_routers > 1:  # the second half of routers
            half = self.n_routers // 2
            since = asyncio.get_running_loop().time() - self.event_s
            if self.scenario == "load-alternates" and int(since / self.w.alternate_s) % 2:
                return i % half  # the first half, every other period
            return half + i % (self.n_routers - half)
        if self.scenario == "uneven" and self.n_routers > 1:
            if i < self.w.uneven_share * clients:
                return 0
            return 1 + i % (self.n_routers - 1)
        return i % self.n_routers

    async def _flood(self, i: int, clients: int, long: bool = False) -> None:
        loop = asyncio.get_running_loop()
        start = self.event_s if self.scenario in MOVING and not long else 0.0
        await asyncio.sleep(start + i / clients * 0.5)  # clients arrive over half a second
        # load-moves: the long streams on the first half of the routers.
        rng = random.Random(i + (1 << 20 if long else 0))
        mean = self.w.long_output if long else self.w.flood_output
        while not self.stop:
            slot = i % max(1, self.n_routers // 2) if long else self._flood_slot(i, clients)
            output = rng.randint(mean // 2, mean * 3 // 2)
            got = await self.cluster.request(self.router_for(slot), "flood",
                                             self.w.flood_prompt, output)
            if got is None:
                await asyncio.sleep(self.w.retry_s)
            elif loop.time() >= self.warmup_s:
                self.flood_done += 1

    async def _quiet(self) -> None:
        loop = asyncio.get_running_loop()
        k = 0
        while not self.stop:
            k += 1
            got = await self.cluster.request(self.router_for(k % self.n_routers), "quiet",
                                             self.w.quiet_prompt, self.w.quiet_output)
            if got is not None and loop.time() >= self.warmup_s:
                self.quiet_wait.append(got[0])
                self.quiet_ttft.append(got[1])
            await asyncio.sleep(self.w.quiet_think_s)

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stop:
            await asyncio.sleep(0.05)
            if loop.time() < self.warmup_s:
                continue
            self.samples += 1
            serving = self.cluster.serving
            if serving:
                self.waiting.append((loop.time(), sum(r.step_waiting for r in serving)
                                     / len(serving)))
            if not any(r is not None and len(r.admission.queue) for r in self.slots):
                continue
            serving = self.cluster.serving
            places = sum(r.shape.max_num_seqs for r in serving)
            if places:
                self.util.append((loop.time(), sum(len(r.running) for r in serving) / places))

    async def _event(self) -> None:
        await asyncio.sleep(self.event_s)
        c = self.cluster
        quarter = max(1, self.n_replicas // 4)
        if self.scenario == "scale-up":
            for j in range(quarter):
                c.add_replica(f"replica-new-{j}")
        elif self.scenario == "drain":
            for r in list(c.serving[:quarter]):
                c.drain(r)
        elif self.scenario == "slow-replica":
            c.serving[0].slow = True
        elif self.scenario == "router-restart":
            dead = self.slots[0]
            assert dead is not None
            self.slots[0] = None
            c.kill_router(dead)
            await asyncio.sleep(self.w.restart_s)
            self._restarts += 1
            self._new_router(0)

    async def main(self) -> Result:
        loop = asyncio.get_running_loop()
        c = self.cluster
        for j in range(self.n_replicas):
            c.add_replica(f"replica-{j}")
        self.slots = [None] * self.n_routers
        for k in range(self.n_routers):
            self._new_router(k)
        clients = int(self.w.flood_per_place * self.n_replicas * c.shape.max_num_seqs)
        tasks = [loop.create_task(self._flood(i, clients)) for i in range(clients)]
        if self.scenario in MOVING:
            n = int(self.w.long_per_place * self.n_replicas * c.shape.max_num_seqs)
            tasks += [loop.create_task(self._flood(i, n, long=True)) for i in range(n)]
        tasks += [loop.create_task(self._quiet()), loop.create_task(self._sample()),
                  loop.create_task(self._event())]
        await asyncio.sleep(self.seconds)
        return self._result()

    def _result(self) -> Result:
        c = self.cluster
        res = Result(self.n_routers, self.n_replicas, self.scenario, self.seconds,
                     headroom=self.settings.headroom,
                     step_worth=step_worth(c.shape, self.w))
        if self.util:
            res.util_mean = statistics.fmean(u for _, u in self.util)
            res.util_min_1s = min(_windows(self.util))
        if self.waiting:
            res.waiting_worst_1s = max(_windows(self.waiting))
        res.backlog_frac = len(self.util) / max(1, self.samples)
        measured = [r for r in c.replicas.values() if r.measured_steps]
        if measured:
            res.waiting_mean = statistics.fmean(r.waiting_sum / r.measured_steps
                                                for r in measured)
            res.waiting_worst = max(r.waiting_sum / r.measured_steps for r in measured)
            res.waiting_max = max(r.waiting_max for r in measured)
        res.quiet_n = len(self.quiet_wait)
        res.quiet_wait_p50_ms = 1000 * _pct(self.quiet_wait, 0.5)
        res.quiet_wait_p99_ms = 1000 * _pct(self.quiet_wait, 0.99)
        res.quiet_ttft_p50_ms = 1000 * _pct(self.quiet_ttft, 0.5)
        res.quiet_ttft_p99_ms = 1000 * _pct(self.quiet_ttft, 0.99)
        res.sent_to_draining = sum(r.sent_while_draining for r in c.replicas.values())
        res.failed, res.rejected, res.flood_done = c.failed, c.rejected, self.flood_done
        routers = [r for r in self.slots if r is not None]
        applies = sum(r.applies for r in routers)
        res.apply_ms = 1000 * sum(r.apply_s for r in routers) / max(1, applies)
        res.polls_per_s = applies / max(1, len(routers)) / self.seconds
        res.poll_interval_s = self.settings.poll_interval_s
        return res


def simulate(routers: int, replicas: int, scenario: str, seconds: float = 10.0,
             warmup_s: float = 2.0, event_s: float | None = None,
             workload: Workload | None = None, shape: EngineShape | None = None,
             settings: AdmissionSettings | None = None, max_queued: int | None = None,
             seed: int = 0, report_ttl_s: float | None = None, channel_goodbye: bool = True
             ) -> Result:
    """Run one scenario on a fresh virtual clock; the event happens at ``event_s`` (default:
    a third of the way)."""
    sim = Simulation(routers, replicas, scenario, seconds, warmup_s,
                     seconds / 3 if event_s is None else event_s, workload or Workload(),
                     shape or EngineShape(), settings or AdmissionSettings(),
                     RouterSettings().max_queued_per_band if max_queued is None else max_queued,
                     seed, report_ttl_s, channel_goodbye)
    cpu = time.process_time()
    res = run_virtual(sim.main())
    res.cpu_s = time.process_time() - cpu
    return res


def bars(res: Result) -> dict[str, bool]:
    """Issue 27's bars for one result. Utilisation must hold through the event, so every
    one-second window counts (the mean over a run dilutes a dip of a few seconds); so must the
    engines' waiting (issue 37, finding 8): its worst second within the headroom plus one
    step's worth."""
    return {"utilisation >= 95%": min(res.util_mean, res.util_min_1s) >= 0.95,
            "waiting <= headroom": res.waiting_mean <= res.headroom,
            "worst-second waiting <= headroom + 1 step":
                res.waiting_worst_1s <= res.headroom + res.step_worth,
            "none sent to draining": res.sent_to_draining == 0}
