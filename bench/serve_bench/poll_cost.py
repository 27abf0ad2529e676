"""What the routers' load polls cost on real Serve (issue 27, "poll cost that scales").

Every router replica's :class:`~serve_app.admission.feed.EngineFeed` calls
``LLMServer.engine_load`` on every engine replica (``broadcast_each``) every
``router.admission.poll_interval_s`` while its model has work. This starts the stack the one
way (:func:`serve_app.launch.start_stack`) with the scripted engine on a local Ray, and for each
shape (routers x engine replicas) keeps every router busy (two closed-loop clients on each
router's own port, so each always has a request in flight or queued and its feed polls at the
busy rate) and measures over a window:

* polls per second each router achieved, and the time one poll spends inside
  ``broadcast_each`` (p50 / p99);
* the CPU (cores) of the router replica processes and of the engine replica processes;
* ``engine_load`` calls per second per engine replica, and the share of the replica's time its
  handler body takes.

Each shape runs twice under the same load: with the poll period under test (``--period``,
the default 0.02 s) and with a long one (``--base-period``, 1 s). The difference in CPU over the
difference in polls is what one poll costs a router and what one ``engine_load`` call costs an
engine replica; :func:`extrapolate` carries those per-call costs to shapes that cannot run here
(64 routers x 256 replicas, the simulation's).

The timings come from inside the replicas: ``instrument`` runs in every Ray worker (Ray's
``worker_process_setup_hook``), wraps ``serve_app.admission.feed.broadcast_each`` and
``LLMServer.engine_load`` with timers and appends their records to a file per process under
``$SERVE_APP_POLL_COST_DIR`` (a poll record per poll, engine counters every quarter second).
Nothing in the measured code changes.

Logical CPUs: an engine replica reserves ``cpus_per_replica`` (at least 1) and a router none, so
Ray is started with ``--num-cpus`` logical CPUs (16) to place 8 engines on a 2-core machine.

usage: python -m serve_bench.poll_cost [--routers 1,4,8] [--replicas 1,2,4,8]
           [--window-s 10] [--out bench/out/poll_cost]   (run under the integration lock)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from serve_bench.stats import percentile

DIR_ENV = "SERVE_APP_POLL_COST_DIR"
HOOK = "serve_bench.poll_cost.instrument"  # Ray loads it as module.attribute
MODEL = "scripted-poll"
ENGINE_FLUSH_S = 0.25  # how often an engine replica appends its counters
POLL_FLUSH_S = 0.5  # how often a router appends its poll records


# ---------------------------------------------------------------------------------------------
# Inside the replicas (Ray's worker_process_setup_hook)

class _Recorder:
    """Appends this process's poll records (router) and engine_load counters (engine) to
    ``<dir>/<pid>.txt``: ``p <end monotonic> <seconds> <answers> <late>`` per poll,
    ``l <monotonic> <calls> <handler seconds>`` (totals since start) every ENGINE_FLUSH_S."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.polls: list[str] = []
        self.calls = 0
        self.handler_s = 0.0
        self.flushed = 0.0

    def poll(self, end: float, seconds: float, answers: int, late: int) -> None:
        self.polls.append(f"p {end:.6f} {seconds:.6f} {answers} {late}\n")
        if end - self.flushed >= POLL_FLUSH_S:
            self._write("".join(self.polls))
            self.polls.clear()
            self.flushed = end

    def load(self, seconds: float) -> None:
        self.calls += 1
        self.handler_s += seconds
        now = time.monotonic()
        if now - self.flushed >= ENGINE_FLUSH_S:
            self._write(f"l {now:.6f} {self.calls} {self.handler_s:.6f}\n")
            self.flushed = now

    def _write(self, text: str) -> None:
        with self.path.open("a") as f:
            f.write(text)


def instrument() -> None:
    """Time every ``broadcast_each`` of the engine feed and every ``LLMServer.engine_load`` of
    this process (a Ray worker), when ``$SERVE_APP_POLL_COST_DIR`` is set."""
    where = os.environ.get(DIR_ENV)
    if not where:
        return
    from serve_app.admission import feed
    from serve_app.engine import server

    recorder = _Recorder(Path(where) / f"{os.getpid()}.txt")
    broadcast = feed.broadcast_each

    async def timed_broadcast(*args: Any, **kwargs: Any) -> list[Any]:
        t0 = time.monotonic()
        answers: list[Any] = []
        try:
            answers = await broadcast(*args, **kwargs)
            return answers
        finally:
            end = time.monotonic()
            late = sum(isinstance(a, asyncio.TimeoutError) for a in answers)
            recorder.poll(end, end - t0, len(answers) - late, late)

    feed.broadcast_each = timed_broadcast
    engine_load = server.LLMServer.engine_load

    @functools.wraps(engine_load)
    async def timed_engine_load(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await engine_load(self, *args, **kwargs)
        finally:
            recorder.load(time.perf_counter() - t0)

    server.LLMServer.engine_load = timed_engine_load  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------
# Pure summaries (unit-tested)

@dataclass(frozen=True)
class PollRecord:
    end: float
    seconds: float
    answers: int
    late: int


@dataclass(frozen=True)
class LoadCounter:
    at: float
    calls: int
    handler_s: float


def parse_records(text: str) -> tuple[list[PollRecord], list[LoadCounter]]:
    """The poll records and engine counters of one process's file (a torn last line is
    skipped)."""
    polls: list[PollRecord] = []
    loads: list[LoadCounter] = []
    for line in text.splitlines():
        parts = line.split()
        try:
            if parts[:1] == ["p"] and len(parts) == 5:
                polls.append(PollRecord(float(parts[1]), float(parts[2]), int(parts[3]),
                                        int(parts[4])))
            elif parts[:1] == ["l"] and len(parts) == 4:
                loads.append(LoadCounter(float(parts[1]), int(parts[2]), float(parts[3])))
        except ValueError:
            continue
    return polls, loads


def counter_rates(loads: list[LoadCounter], t0: float, t1: float) -> tuple[float, float]:
    """(engine_load calls per second, handler seconds per second) of one engine replica over
    ``[t0, t1]``: between its first and last counter inside the window (0, 0 with fewer than
    two)."""
    inside = [c for c in loads if t0 <= c.at <= t1]
    if len(inside) < 2 or inside[-1].at <= inside[0].at:
        return 0.0, 0.0
    span = inside[-1].at - inside[0].at
    return ((inside[-1].calls - inside[0].calls) / span,
            (inside[-1].handler_s - inside[0].handler_s) / span)


@dataclass(frozen=True)
class PollSummary:
    polls_per_s: float  # per router, mean over routers
    polls_per_s_min: float  # the slowest router's
    rtt_p50_ms: float
    rtt_p99_ms: float
    answers: float  # replicas answering a poll, mean
    late: int  # answers given up over the window, all routers


def poll_summary(per_router: list[list[PollRecord]], t0: float, t1: float) -> PollSummary:
    """Polls each router ended inside ``[t0, t1]``: rates, and the round trip's percentiles over
    every router's polls."""
    window = [[p for p in polls if t0 <= p.end <= t1] for polls in per_router]
    every = [p for polls in window for p in polls]
    rates = [len(polls) / (t1 - t0) for polls in window] or [0.0]
    seconds = [p.seconds for p in every]
    return PollSummary(
        polls_per_s=sum(rates) / len(rates), polls_per_s_min=min(rates),
        rtt_p50_ms=percentile(seconds, 50) * 1000, rtt_p99_ms=percentile(seconds, 99) * 1000,
        answers=sum(p.answers for p in every) / len(every) if every else 0.0,
        late=sum(p.late for p in every))


@dataclass(frozen=True)
class Run:
    """One shape at one poll period."""

    routers: int
    replicas: int
    period_s: float
    window_s: float
    polls: PollSummary
    router_cores: float  # CPU of one router replica process, mean
    engine_cores: float  # CPU of one engine replica process, mean
    other_cores: float  # every other process of the stack (controller, HAProxy, Ray), total
    calls_per_s: float  # engine_load calls per engine replica
    handler_share: float  # of an engine replica's time inside engine_load's body
    requests_per_s: float = 0.0  # the load's completions, all routers (the same at both periods)


@dataclass(frozen=True)
class PollCost:
    """What polling at the period under test costs, from a run at it (``fast``) and one at a
    long period (``slow``) under the same load."""

    routers: int
    replicas: int
    router_cores: float  # per router replica, attributable to polling
    engine_cores: float  # per engine replica, attributable to polling
    router_ms_per_poll: float  # CPU ms of one poll on its router (all its replicas' answers)
    engine_us_per_call: float  # CPU us of one engine_load call on its engine replica


def poll_cost(fast: Run, slow: Run) -> PollCost:
    """CPU over polls, as differences between the two runs (0 per call when the polls did not
    differ)."""
    router = fast.router_cores - slow.router_cores
    engine = fast.engine_cores - slow.engine_cores
    d_polls = fast.polls.polls_per_s - slow.polls.polls_per_s
    d_calls = fast.calls_per_s - slow.calls_per_s
    return PollCost(fast.routers, fast.replicas, router, engine,
                    router / d_polls * 1000 if d_polls > 0 else 0.0,
                    engine / d_calls * 1e6 if d_calls > 0 else 0.0)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; (mean, 0) when the xs do not vary."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


@dataclass(frozen=True)
class Model:
    """Per-call costs: a poll costs its router ``router_ms_fixed + router_ms_per_replica x
    replicas`` ms of CPU; an ``engine_load`` call costs its engine replica ``engine_us`` us."""

    router_ms_fixed: float
    router_ms_per_replica: float
    engine_us: float

    def router_cores(self, replicas: int, period_s: float) -> float:
        return (self.router_ms_fixed + self.router_ms_per_replica * replicas) / 1000 / period_s

    def engine_cores(self, routers: int, period_s: float) -> float:
        return routers * self.engine_us / 1e6 / period_s

    def max_routers(self, period_s: float, budget: float) -> float:
        """Routers that keep one engine replica's polling within ``budget`` cores."""
        return budget * period_s * 1e6 / self.engine_us if self.engine_us > 0 else float("inf")

    def max_replicas(self, period_s: float, budget: float) -> float:
        """Engine replicas one router polls within ``budget`` cores."""
        if self.router_ms_per_replica <= 0:
            return float("inf")
        return max(0.0, (budget * period_s * 1000 - self.router_ms_fixed)
                   / self.router_ms_per_replica)


def fit_model(costs: list[PollCost]) -> Model:
    """The per-call costs that explain ``costs``: the router's per poll as a line over the
    replicas, the engine's per call as the mean over the shapes with at least 2 routers (with
    one router an engine replica's difference is too small against the noise)."""
    a, b = fit_line([c.replicas for c in costs], [c.router_ms_per_poll for c in costs])
    multi = [c.engine_us_per_call for c in costs if c.routers > 1] or [
        c.engine_us_per_call for c in costs]
    return Model(a, b, sum(multi) / len(multi))


# ---------------------------------------------------------------------------------------------
# The stack

def _config(routers: int, replicas: int, period_s: float, args: argparse.Namespace) -> Any:
    from serve_app.config import AutoscalingSettings, ModelSettings, load_config
    from serve_app.config import DEFAULT_CONFIG

    cfg = load_config(Path(DEFAULT_CONFIG))
    model = ModelSettings(
        name=MODEL, path=cfg.models[0].path, device="cpu", max_model_len=2048,
        autoscaling=AutoscalingSettings(min_replicas=replicas, max_replicas=replicas),
        engine_kwargs={"max_num_seqs": args.max_num_seqs, "scripted_step_s": args.step_s})
    adm = cfg.router.admission.model_copy(update={"poll_interval_s": period_s})
    router = cfg.router.model_copy(update={
        "num_replicas": routers, "admission": adm, "port": args.ports[0],
        "haproxy_stats_port": args.ports[1], "haproxy_metrics_port": args.ports[2],
        "fallback_proxy_port": args.ports[3]})
    return cfg.model_copy(update={"router": router, "models": [model]})


def _stack_processes() -> dict[str, list[Any]]:
    """This stack's processes (descendants of this one) by role: router, engine, other."""
    import psutil

    from serve_app.app import llm_server_name
    from serve_app.config import APP_NAME

    me = psutil.Process()
    roles: dict[str, list[Any]] = {"router": [], "engine": [], "other": []}
    for proc in me.children(recursive=True):
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if f"ServeReplica:{APP_NAME}:Router" in line:
            roles["router"].append(proc)
        elif f"ServeReplica:{APP_NAME}:{llm_server_name(MODEL)}" in line:
            roles["engine"].append(proc)
        else:
            roles["other"].append(proc)
    return roles


def _shape(routers: int, replicas: int) -> dict[str, list[Any]] | None:
    """This stack's processes once it runs exactly ``routers`` and ``replicas``."""
    roles = _stack_processes()
    ok = len(roles["router"]) == routers and len(roles["engine"]) == replicas
    return roles if ok else None


def _cpu(procs: list[Any]) -> dict[int, float]:
    import psutil

    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def _router_port(proc: Any) -> int | None:
    """The HTTP port a router replica serves on itself."""
    import urllib.request

    for conn in proc.net_connections(kind="tcp"):
        if conn.status != "LISTEN":
            continue
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{conn.laddr.port}/health",
                                        timeout=2) as answer:
                if answer.status == 200:
                    return int(conn.laddr.port)
        except Exception:
            continue
    return None


class Load:
    """``per_router`` closed-loop clients on each router's own port, each sending one
    non-streaming completion after another: every router always holds work."""

    def __init__(self, ports: list[int], per_router: int, max_tokens: int) -> None:
        self.stop = threading.Event()
        self.errors = 0
        self.done = 0
        self.threads = [threading.Thread(target=self._client, args=(port, max_tokens, i),
                                         daemon=True)
                        for port in ports for i in range(per_router)]
        for t in self.threads:
            t.start()

    def _client(self, port: int, max_tokens: int, index: int) -> None:
        import httpx

        time.sleep(index * 0.3)  # staggered: the router's in-flight never drops to zero
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            while not self.stop.is_set():
                try:
                    r = client.post("/v1/completions", json={
                        "model": MODEL, "prompt": "hi", "max_tokens": max_tokens})
                    self.done += 1
                    self.errors += r.status_code != 200
                except Exception:
                    self.errors += 1
                    time.sleep(0.5)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=130)


def _wait(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s:g} s")
        time.sleep(interval_s)


def _records(pid: int, where: Path) -> tuple[list[PollRecord], list[LoadCounter]]:
    try:
        return parse_records((where / f"{pid}.txt").read_text())
    except OSError:
        return [], []


def _views_full(routers: list[Any], replicas: int, where: Path) -> bool:
    """Every router's latest polls were answered by ``replicas`` replicas."""
    for proc in routers:
        polls, _ = _records(proc.pid, where)
        if len(polls) < 3 or any(p.answers != replicas for p in polls[-3:]):
            return False
    return True


def measure(routers: int, replicas: int, period_s: float, args: argparse.Namespace,
            where: Path, load: Load) -> Run:
    """One window over the running stack (its routers busy, its engines at ``replicas``)."""
    roles = _wait(lambda: _shape(routers, replicas), 180,
                  f"{routers} routers and {replicas} engine replicas")
    _wait(lambda: _views_full(roles["router"], replicas, where), 120,
          f"every router polling {replicas} replicas")
    time.sleep(args.settle_s)
    procs = roles["router"] + roles["engine"] + roles["other"]
    before, t0, done = _cpu(procs), time.monotonic(), load.done
    time.sleep(args.window_s)
    after, t1, done = _cpu(procs), time.monotonic(), load.done - done
    time.sleep(POLL_FLUSH_S + 0.2)  # the routers' last records reach their files

    def cores(group: list[Any]) -> list[float]:
        return [(after[p.pid] - before[p.pid]) / (t1 - t0) for p in group
                if p.pid in before and p.pid in after]

    polls = poll_summary([_records(p.pid, where)[0] for p in roles["router"]], t0, t1)
    rates = [counter_rates(_records(p.pid, where)[1], t0, t1) for p in roles["engine"]]
    rc, ec = cores(roles["router"]), cores(roles["engine"])
    return Run(routers, replicas, period_s, t1 - t0, polls,
               router_cores=sum(rc) / len(rc), engine_cores=sum(ec) / len(ec),
               other_cores=sum(cores(roles["other"])),
               calls_per_s=sum(r[0] for r in rates) / len(rates),
               handler_share=sum(r[1] for r in rates) / len(rates),
               requests_per_s=done / (t1 - t0))


def sweep(args: argparse.Namespace) -> list[Run]:
    """Every shape at both periods, on one stack; the engines scale in place between shapes,
    the routers roll when their count or period changes."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import APP_NAME
    from serve_app.engine.scripted import SCRIPTED_ENGINE_CLASS
    from serve_app.launch import start_stack, stop_stack

    where = args.out / "records"
    where.mkdir(parents=True, exist_ok=True)
    for old in where.glob("*.txt"):
        old.unlink()
    os.environ[DIR_ENV] = str(where.resolve())
    runs: list[Run] = []
    first = _config(args.routers[0], args.replicas[0], args.period, args)
    try:
        start_stack(first, engine_class=SCRIPTED_ENGINE_CLASS, num_cpus=args.num_cpus,
                    log_to_driver=False, include_dashboard=False,
                    runtime_env={"worker_process_setup_hook": HOOK,
                                 "env_vars": {DIR_ENV: str(where.resolve())}})
        for routers in args.routers:
            for period in (args.period, args.base_period):
                cfg = _config(routers, args.replicas[0], period, args)
                serve.run(build_app(cfg, SCRIPTED_ENGINE_CLASS), name=APP_NAME,
                          route_prefix="/", blocking=False)
                roles = _wait(lambda: _shape(routers, args.replicas[0]), 300,
                              f"{routers} routers")
                ports = _wait(lambda: (all(found := [_router_port(p) for p in roles["router"]])
                                       and found), 120, "every router's port")
                load = Load(ports, args.clients_per_router, args.max_tokens)
                try:
                    for replicas in args.replicas:
                        if replicas != args.replicas[0]:
                            cfg = _config(routers, replicas, period, args)
                            serve.run(build_app(cfg, SCRIPTED_ENGINE_CLASS), name=APP_NAME,
                                      route_prefix="/", blocking=False)
                        run = measure(routers, replicas, period, args, where, load)
                        runs.append(run)
                        print(json.dumps({**asdict(run), "load_errors": load.errors}),
                              flush=True)
                        (args.out / "runs.json").write_text(
                            json.dumps([asdict(r) for r in runs], indent=1))
                finally:
                    load.close()
                if load.errors:
                    print(f"load: {load.errors} of {load.done} requests failed", flush=True)
    finally:
        stop_stack()
    return runs


def report(runs: list[Run], period_s: float, base_period_s: float, budget: float,
           extrapolate_to: list[tuple[int, int]]) -> str:
    """The markdown table of both periods per shape, the costs attributable to polling and
    the extrapolation."""
    fast = {(r.routers, r.replicas): r for r in runs if r.period_s == period_s}
    slow = {(r.routers, r.replicas): r for r in runs if r.period_s == base_period_s}
    costs = [poll_cost(fast[k], slow[k]) for k in fast if k in slow]
    lines = [
        f"| routers x replicas | polls/s per router (min) | poll p50 / p99 ms | router cores "
        f"at {period_s:g} s / {base_period_s:g} s | engine cores at {period_s:g} s / "
        f"{base_period_s:g} s | engine_load calls/s per replica | handler share | router CPU "
        "ms per poll | engine CPU us per call | load req/s (both periods) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in costs:
        f, s = fast[(c.routers, c.replicas)], slow[(c.routers, c.replicas)]
        lines.append(
            f"| {c.routers} x {c.replicas} | {f.polls.polls_per_s:.1f} "
            f"({f.polls.polls_per_s_min:.1f}) | {f.polls.rtt_p50_ms:.1f} / "
            f"{f.polls.rtt_p99_ms:.1f} | {f.router_cores:.3f} / {s.router_cores:.3f} | "
            f"{f.engine_cores:.3f} / {s.engine_cores:.3f} | {f.calls_per_s:.0f} | "
            f"{f.handler_share:.2%} | {c.router_ms_per_poll:.2f} | {c.engine_us_per_call:.0f} | "
            f"{f.requests_per_s:.1f} / {s.requests_per_s:.1f} |")
    if not costs:
        return "\n".join(lines) + "\n"
    m = fit_model(costs)
    lines += ["", f"Per-call model: a poll costs its router {m.router_ms_fixed:.2f} ms + "
              f"{m.router_ms_per_replica:.3f} ms x replicas of CPU; an engine_load call costs "
              f"its engine replica {m.engine_us:.0f} us.", "",
              "| routers x replicas | period s | router cores | engine replica cores |",
              "| --- | --- | --- | --- |"]
    for routers, replicas in extrapolate_to:
        for p in sorted({period_s, 0.1, 0.25}):
            lines.append(f"| {routers} x {replicas} | {p:g} | "
                         f"{m.router_cores(replicas, p):.3f} | "
                         f"{m.engine_cores(routers, p):.3f} |")
    lines += ["", f"Break point at {period_s:g} s ({budget:.0%} of a core): "
              f"{m.max_routers(period_s, budget):.1f} routers per engine replica, "
              f"{m.max_replicas(period_s, budget):.1f} replicas per router."]
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", type=_ints, default=[1, 4, 8])
    parser.add_argument("--replicas", type=_ints, default=[1, 2, 4, 8])
    parser.add_argument("--period", type=float, default=0.02,
                        help="poll_interval_s under test (the default config's)")
    parser.add_argument("--base-period", type=float, default=1.0,
                        help="the long poll_interval_s the costs are measured against")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--step-s", type=float, default=0.02, help="scripted engine step")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=50)
    parser.add_argument("--clients-per-router", type=int, default=2)
    parser.add_argument("--num-cpus", type=int, default=16, help="Ray's logical CPUs")
    parser.add_argument("--budget", type=float, default=0.05,
                        help="cores per process that polling may take (break point)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/poll_cost"))
    parser.add_argument("--report-only", action="store_true",
                        help="write the report from OUT/runs.json without running")
    args = parser.parse_args(argv)
    # A TERM (timeout, a CI job cancelled) unwinds through sweep's finally: the stack stops.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        runs = [Run(**{**r, "polls": PollSummary(**r["polls"])})
                for r in json.loads((args.out / "runs.json").read_text())]
    else:
        args.ports = _free_ports(4)
        runs = sweep(args)
    text = report(runs, args.period, args.base_period, args.budget, [(64, 256), (8, 32)])
    (args.out / "summary.md").write_text(text)
    print(text)


def _free_ports(n: int) -> list[int]:
    """Ports for the stack's fixed listeners that nothing holds now, below the ephemeral
    range (as the integration suite picks them)."""
    import random
    import socket

    ports: list[int] = []
    while len(ports) < n:
        port = random.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


if __name__ == "__main__":
    main()
